"""mlxrt's CPU kernels for MLX (`kernels.cpp`): compiled once per MLX version, checked, loaded.

MLX's CPU backend on x86-64 Linux evaluates its elementwise kernels one float at a time, with an
`exp` that costs ~14 ns an element here (six `fmaf` calls), so the SiLU of the MLPs and the
attention's softmax are most of a CPU forward's time besides the matrix products. `kernels.cpp`
computes the same formulas with the same roundings eight floats at a time (AVX2 + FMA): MLX
primitives of our own (`swiglu`, `softmax`, `scaled_dot_product_attention` = MLX's CPU attention
with that softmax, `rms_norm` and `rope` = MLX's CPU RMSNorm and RoPE, six and ~20 ops, as one
each), 10-20x faster and bit for bit MLX's results. `quantized.h` adds `quantized_matmul`, MLX's
`quantized_matmul` for affine 4- and 8-bit weights read as stored (AVX-512 where the CPU has it,
a helper thread for large products): the same function summed in another order, so it is checked
within float rounding, not bit for bit (`_check_quantized`).

`load()` builds the extension with g++ against the installed MLX's headers and library and
nanobind (in the package's `_build` directory, else `fallback_dir`; `.ci/bootstrap.sh` builds it
at setup, `python -m engine.native` builds it by hand), then checks each function against MLX's
own on random inputs before returning the module. It returns None, and the engine computes with
MLX's ops (the same bits, slower), on anything but Linux x86-64 with AVX2 and FMA, without a
compiler, when the build or the check fails (each logged once), with `MLXRT_NATIVE=0`, and in a
distributed world's ranks (`disable`: when a peer died, rank 0's step hung with the kernels in it
instead of failing; not explained yet).
Only the engine's step uses the kernels (`engine.lanes`), on the CPU backend, for float32; whether
they loaded also decides what `model.cpu_dequantize = "auto"` does (`engine.model.weights`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    import mlx.core as mx

log = structlog.get_logger("engine.native")

SOURCE = Path(__file__).with_name("kernels.cpp")
HEADERS = (Path(__file__).with_name("quantized.h"), Path(__file__).with_name("layer.h"))  # (included by SOURCE)
_UNSET = object()
_loaded: object = _UNSET


def supported_platform() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def _key() -> str:
    from importlib.metadata import version

    flags = " ".join(_command(Path("out"))[1:]).encode()
    parts = [
        SOURCE.read_bytes(),
        *(header.read_bytes() for header in HEADERS),
        flags,
        version("mlx").encode(),
        version("nanobind").encode(),
        str(sysconfig.get_config_var("EXT_SUFFIX")).encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _library_name() -> str:
    return "_kernels" + str(sysconfig.get_config_var("EXT_SUFFIX"))


def _command(output: Path) -> list[str]:
    import mlx.core
    import nanobind

    mlx_root = Path(mlx.core.__file__).parent  # (`mlx` is a namespace package: its path may have other entries)
    nb_root = Path(nanobind.__file__).parent
    python_include = sysconfig.get_paths()["include"]
    compiler = shlex.split(os.environ.get("CXX", "g++"))
    return [
        *compiler,
        "-std=c++20",
        "-O3",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        "-fno-strict-aliasing",
        "-ffp-contract=off",  # (a product and a sum stay two roundings, as in MLX's build)
        "-DNB_DOMAIN=mlx",  # share mlx's nanobind types (`mlx.core.array`)
        f"-I{nb_root / 'include'}",
        f"-I{nb_root / 'ext' / 'robin_map' / 'include'}",
        f"-I{python_include}",
        f"-I{mlx_root / 'include'}",
        str(SOURCE),
        str(nb_root / "src" / "nb_combined.cpp"),
        f"-L{mlx_root / 'lib'}",
        "-lmlx",
        f"-Wl,-rpath,{mlx_root / 'lib'}",
        "-o",
        str(output),
    ]


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def build_dir(fallback_dir: Path | None = None) -> Path:
    """Where this source, MLX and nanobind's build lives: the package's `_build`, where it can
    be written (a checkout), else `fallback_dir` (mlxrt's home)."""
    key = _key()
    package = Path(__file__).with_name("_build")
    if fallback_dir is None or _writable(package):
        return package / key
    return fallback_dir / "native" / key


@contextlib.contextmanager
def _lock(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # (two processes building at once: one builds)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(fallback_dir: Path | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """The compiled extension's path, compiling it first where it is not there yet (~10-20 s)."""
    directory = build_dir(fallback_dir)
    library = directory / _library_name()
    if library.exists():
        return library
    with _lock(directory):
        if library.exists():
            return library
        if progress is not None:
            progress("compiling mlxrt's CPU kernels (once per MLX version, ~15 s)")
        log.info("native_build_started", directory=str(directory))
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".so", delete=False) as partial:
            output = Path(partial.name)
        try:
            done = subprocess.run(_command(output), capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"g++ failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
            output.replace(library)
        finally:
            output.unlink(missing_ok=True)
        log.info("native_build_finished", library=str(library))
        _prune(directory)
    return library


def _prune(directory: Path) -> None:
    """Builds for other sources or MLX versions beside this one (best effort)."""
    for other in directory.parent.iterdir():
        if other != directory and other.is_dir() and (other / ".lock").exists():
            shutil.rmtree(other, ignore_errors=True)


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine.native._kernels", library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(module: ModuleType) -> str | None:
    """What differs between the module's results and MLX's own on random inputs (None: nothing).
    The inputs come from numpy's generator: MLX's random state is the caller's."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)

    def normal(*shape: int, scale: float = 1.0) -> mx.array:
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))

    from mlx_lm.models.activations import swiglu

    with mx.stream(mx.cpu):
        gate, up = normal(37, 301, scale=8.0), normal(37, 301)
        if not mx.array_equal(module.swiglu(gate, up), swiglu(gate, up)).item():
            return "swiglu"
        x, weight = normal(3, 11, 301, scale=3.0), normal(301)
        if not mx.array_equal(module.rms_norm(x, weight, 1e-5), mx.fast.rms_norm(x, weight, 1e-5)).item():
            return "rms_norm"
        heads, offsets = normal(3, 4, 5, 64), mx.array([0, 17, 4000], dtype=mx.int32)
        for traditional in (False, True):
            expected = mx.fast.rope(heads, 48, traditional=traditional, base=10000.0, scale=1.0, offset=offsets)
            if not mx.array_equal(module.rope(heads, 48, traditional=traditional, base=10000.0, scale=1.0, offset=offsets), expected).item():
                return "rope"
        scores = normal(5, 7, 133, scale=6.0)
        if not mx.array_equal(module.softmax(scores), mx.softmax(scores, axis=-1, precise=True)).item():
            return "softmax"
        q, k, v = normal(2, 6, 9, 16), normal(2, 2, 21, 16), normal(2, 2, 21, 16)
        for mask in ("causal", None, mx.array(rng.random((2, 1, 9, 21)) > 0.4)):
            mode, array = (mask, None) if isinstance(mask, str) or mask is None else ("", mask)
            expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
            got = module.scaled_dot_product_attention(q, k, v, scale=0.25, mask_mode=mode or "", mask=array)
            if not mx.array_equal(got, expected).item():
                return f"scaled_dot_product_attention (mask {mode or 'array' if array is not None else 'none'})"
        if (difference := _check_quantized(module, normal)) is not None:
            return difference
    return None


def _check_quantized(module: ModuleType, normal: Callable[..., mx.array]) -> str | None:
    """The quantized product against `mx.quantized_matmul`: the same function summed in another
    order, so within float rounding (a relative 1e-5 of the products' magnitudes), for each
    bit width and group size, one row to a prefill's many, and the uneven tails."""
    import mlx.core as mx

    for bits in (4, 8):
        for group in (32, 64, 128):
            weight = normal(72, 256)
            w, scales, biases = mx.quantize(weight, group_size=group, bits=bits)
            for rows in (1, 2, 3, 5, 8, 9, 13, 30):
                x = normal(rows, 256)
                expected = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group, bits=bits)
                got = module.quantized_matmul(x, w, scales, biases, group_size=group, bits=bits)
                bound = 1e-5 * (mx.abs(x) @ mx.abs(mx.dequantize(w, scales, biases, group_size=group, bits=bits)).T).max()
                if got.shape != expected.shape or not bool(mx.all(mx.abs(got - expected) <= bound).item()):
                    return f"quantized_matmul ({bits} bits, groups of {group}, {rows} rows)"
    return None


def load(fallback_dir: Path | None = None, progress: Callable[[str], None] | None = None) -> ModuleType | None:
    """The checked kernels module, built where needed; None where the engine uses MLX's ops.
    Once per process (on the MLX thread: the check evaluates arrays)."""
    global _loaded
    if _loaded is not _UNSET:
        return _loaded  # type: ignore[return-value]
    module: ModuleType | None = None
    if os.environ.get("MLXRT_NATIVE", "1") == "0":
        log.info("native_off", reason="MLXRT_NATIVE=0")
    elif not supported_platform():
        log.debug("native_off", reason=f"{sys.platform}/{platform.machine()}")
    else:
        try:
            candidate = _import(build(fallback_dir, progress))
            if not candidate.supported:
                log.warning("native_off", reason="this CPU lacks AVX2 or FMA")
            elif (difference := check(candidate)) is not None:
                log.warning("native_off", reason=f"{difference} differs from MLX's result")
            else:
                module = candidate
        except Exception as error:  # (no compiler, another MLX ABI): MLX's ops serve
            log.warning("native_off", reason=f"{type(error).__name__}: {error}")
    _loaded = module
    return module


def disable(reason: str) -> None:
    """MLX's ops serve in this process from now on (logged with `reason`)."""
    global _loaded
    if _loaded is not None:
        log.info("native_off", reason=reason)
    _loaded = None


def loaded() -> ModuleType | None:
    """The module if `load()` has run and succeeded."""
    return None if _loaded is _UNSET else _loaded  # type: ignore[return-value]


def main() -> None:
    """`python -m engine.native`: build (and check) the kernels now, e.g. at setup."""
    module = load(progress=lambda message: print(f"[setup] {message}", flush=True))
    if module is None:
        print("[setup] mlxrt's CPU kernels are off on this machine: MLX's own ops serve (same results, slower)")
    else:
        print(f"[setup] mlxrt's CPU kernels: {build_dir()}")
