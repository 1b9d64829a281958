"""`import runtime` gives MLX a fast BLAS on Linux before mlx.core loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runtime import blas

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS preload is Linux-only")

MEASURE = """
import time, runtime, runtime.blas as blas
import mlx.core as mx
a = mx.random.normal((512, 512)); b = mx.random.normal((512, 512)); mx.eval(a, b, a @ b)
best = float("inf")
for _ in range(6):
    start = time.perf_counter()
    mx.eval(a @ b)
    best = min(best, time.perf_counter() - start)
maps = open("/proc/self/maps").read()
print(blas.status().state, "openblas" in maps, 2 * 512**3 / best / 1e9)
"""


def _run(code: str, env: dict | None = None) -> list[str]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.slow  # two Python processes that load MLX and time matmuls
@pytest.mark.skipif(blas.status().state != "loaded", reason="no OpenBLAS on this machine")
def test_import_runtime_loads_openblas_and_matmul_is_fast():
    import os

    state, mapped, gflops = _run(MEASURE)
    assert state == "loaded" and mapped == "True"
    # Against the bundled reference BLAS in the same conditions (a busy machine slows both):
    # OpenBLAS is ~50x faster here; a 5x margin tells them apart without timing anything absolute.
    off_state, _, reference = _run(MEASURE, env={**os.environ, "MLXRT_BLAS": "off"})
    assert off_state == "disabled"
    assert float(gflops) >= 5 * float(reference), (gflops, reference)


def test_importing_mlx_first_is_reported():
    state, warning = _run("import mlx.core, runtime.blas as b; s = b.ensure_fast_blas(); print(s.state, bool(s.warning()))")
    assert state == "already_imported" and warning == "True"


def test_missing_library_gives_one_clear_warning():
    state, warning = _run("import runtime.blas as b; s = b._load(['/nonexistent/libblas.so']); print(s.state, 'apt-get install' in s.warning())")
    assert state == "not_found" and warning == "True"


@pytest.mark.skipif(blas.status().state != "loaded", reason="no OpenBLAS on this machine")
def test_openblas_workers_spin_briefly_unless_the_environment_says():
    """OpenBLAS reads `OPENBLAS_THREAD_TIMEOUT` as it loads: the preload sets the shortest spin
    (its workers otherwise hold a core ~0.1 s after each call), and keeps a user's own value."""
    import os

    code = "import os, runtime; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    assert _run(code, env=env) == [blas.THREAD_TIMEOUT]
    assert _run(code, env={**env, "OPENBLAS_THREAD_TIMEOUT": "20"}) == ["20"]
