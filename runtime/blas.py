"""Give MLX's CPU backend a fast BLAS before `mlx.core` loads (Linux).

The mlx-cpu wheel bundles the reference BLAS (~5 GFLOP/s float32 matmul here);
loading OpenBLAS with RTLD_GLOBAL first makes its symbols win (~250 GFLOP/s).
`ensure_fast_blas()` runs once, from `import runtime`; `status()` says what
happened so the runtime can log it, with the remedy when nothing was found.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from dataclasses import dataclass

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
    for path in paths:
        try:
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
        except OSError:
            continue
        return BlasStatus("loaded", path)
    return BlasStatus("not_found")


def status() -> BlasStatus:
    return ensure_fast_blas()
