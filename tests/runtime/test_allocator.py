"""`runtime.allocator`: `mlxrt serve` re-executes itself under jemalloc where it is installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runtime import allocator

LIBRARY = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is Linux's")
def test_the_environment_names_jemalloc_first_once():
    assert allocator.jemalloc_environment({"PATH": "/bin"}, LIBRARY, None) == {"PATH": "/bin", "LD_PRELOAD": LIBRARY}
    # (another preloaded library stays, after it: OpenBLAS, say)
    assert allocator.jemalloc_environment({"LD_PRELOAD": "/x/libblas.so.3"}, LIBRARY, "jemalloc") == {"LD_PRELOAD": f"{LIBRARY} /x/libblas.so.3"}
    # Nothing to do: preloaded already (either separator), turned off, or no library.
    assert allocator.jemalloc_environment({"LD_PRELOAD": f"/x/libblas.so.3:{LIBRARY}"}, LIBRARY, None) is None
    assert allocator.jemalloc_environment({}, LIBRARY, "system") is None
    assert allocator.jemalloc_environment({}, None, None) is None
    assert allocator.preloaded({"LD_PRELOAD": f"/a.so {LIBRARY}"}) == LIBRARY
    assert allocator.preloaded({"LD_PRELOAD": "/usr/lib/libmimalloc.so.2"}) is None


_PROBE = (
    "from runtime import allocator; allocator.reexec_with_jemalloc(); import sys; "
    "maps = open('/proc/self/maps').read(); print(allocator.name(), 'libjemalloc' in maps, sys.argv[1:])"
)


@pytest.mark.skipif(allocator.find_jemalloc() is None, reason="jemalloc is not installed here")
def test_a_process_restarts_under_jemalloc_with_its_own_arguments(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MLXRT_MALLOC", raising=False)
    out = subprocess.run([sys.executable, "-c", _PROBE, "serve", "--x"], capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert out == ["jemalloc", "True", "['serve',", "'--x']"]
    # Turned off: the system's malloc, no restart.
    monkeypatch.setenv("MLXRT_MALLOC", "system")
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120).stdout.split()
    assert out == ["system", "False", "[]"]
