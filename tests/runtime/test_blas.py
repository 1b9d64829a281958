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
a = mx.random.normal((1024, 1024)); b = mx.random.normal((1024, 1024)); mx.eval(a, b, a @ b)
start = time.perf_counter()
for _ in range(8):
    mx.eval(a @ b)
gflops = 8 * 2 * 1024**3 / (time.perf_counter() - start) / 1e9
maps = open("/proc/self/maps").read()
print(blas.status().state, "openblas" in maps, round(gflops))
"""


def _run(code: str, env: dict | None = None) -> list[str]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.skipif(blas.status().state != "loaded", reason="no OpenBLAS on this machine")
def test_import_runtime_loads_openblas_and_matmul_is_fast():
    state, mapped, gflops = _run(MEASURE)
    assert state == "loaded" and mapped == "True"
    # ~250 GFLOP/s with OpenBLAS here, ~5 with the bundled reference BLAS: a 10x margin.
    assert int(gflops) >= 50


def test_importing_mlx_first_is_reported():
    state, warning = _run("import mlx.core, runtime.blas as b; s = b.ensure_fast_blas(); print(s.state, bool(s.warning()))")
    assert state == "already_imported" and warning == "True"


def test_missing_library_gives_one_clear_warning():
    state, warning = _run("import runtime.blas as b; s = b._load(['/nonexistent/libblas.so']); print(s.state, 'apt-get install' in s.warning())")
    assert state == "not_found" and warning == "True"
