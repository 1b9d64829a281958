"""Give MLX's CPU backend a fast BLAS before `mlx.core` loads (Linux).

The mlx-cpu wheel bundles the reference BLAS (~5 GFLOP/s float32 matmul here);
loading OpenBLAS with RTLD_GLOBAL first makes its symbols win (~250 GFLOP/s).
`ensure_fast_blas()` runs once, from `import runtime`; `status()` says what
happened so the runtime can log it, with the remedy when nothing was found.

OpenBLAS's worker threads spin after every call for 2^28 cycles (~0.1 s) before they sleep,
on the cores MLX's own stream threads need between matrix products (the engine's second CPU
lane, `engine.lanes`, found its core taken). Unless the environment says otherwise, they spin
2^`THREAD_TIMEOUT` cycles: measured on `builtin:bench`, 16 rows' decode steps on two lanes
1.11x faster, paged 1.57x, a lone row's unchanged (docs/benchmarks/log.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from dataclasses import dataclass

# OpenBLAS's `OPENBLAS_THREAD_TIMEOUT` (read when it loads): its smallest, 2^4 cycles.
THREAD_TIMEOUT = "4"
REMEDY = "install OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread) or set MLXRT_BLAS=/path/to/libblas.so"


@dataclass(frozen=True)
class BlasStatus:
    # "loaded", "not_linux", "already_imported", "not_found" or "disabled"
    state: str
    library: str | None = None

    @property
    def is_fast(self) -> bool:
        return self.state in ("loaded", "not_linux")

    def warning(self) -> str | None:
        if self.state == "not_found":
            return f"no fast BLAS found: MLX float32 matmul on CPU will be ~50x slower; {REMEDY}"
        if self.state == "already_imported":
            return "mlx.core was imported before runtime, so OpenBLAS could not be preloaded; import runtime first"
        return None


_status: BlasStatus | None = None


def _candidates() -> list[str]:
    arch = platform.machine()
    paths = [
        f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3",
        f"/usr/lib/{arch}-linux-gnu/openblas-openmp/libblas.so.3",
        f"/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",
    ]
    found = ctypes.util.find_library("openblas")
    return [p for p in paths if os.path.exists(p)] + ([found] if found else [])


def ensure_fast_blas(override: str | None = None) -> BlasStatus:
    """Preload OpenBLAS globally if we are on Linux and mlx.core is not loaded yet."""
    global _status
    if _status is not None:
        return _status
    if sys.platform != "linux":
        _status = BlasStatus("not_linux")
    elif override == "off":
        _status = BlasStatus("disabled")
    elif "mlx.core" in sys.modules:
        _status = BlasStatus("already_imported")
    else:
        _status = _load([override] if override else _candidates())
    return _status


def _load(paths: list[str]) -> BlasStatus:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    for path in paths:
        try:
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
        except OSError:
            continue
        return BlasStatus("loaded", path)
    return BlasStatus("not_found")


def status() -> BlasStatus:
    return ensure_fast_blas()
