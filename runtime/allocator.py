"""jemalloc for a serving process, preloaded by re-executing it (Linux).

A decode step's graphs are built and evaluated on the MLX thread while the stream's thread runs
the kernels and frees what the evaluation allocated (MLX's nodes, hash tables, buffers). glibc's
malloc serves the MLX thread's many small allocations from its slow path: `_int_malloc` and
`malloc_consolidate` took ~29% of that thread's CPU in a served SmolLM2 stream (perf, one
request), and on two cores every thread's CPU is taken from the kernels'. jemalloc's per-thread
caches do not: measured with `mlxrt serve` on the SmolLM2 Q4_1 GGUF, two servers answering
300-token greedy streams in turn, 20 pairs: 10.81 -> 9.92 ms a token (paired median 0.900, 16 of
20 pairs faster), the MLX thread's CPU 3.6-4.3 -> 2.5-3.1 ms a token; mimalloc 1.019x jemalloc's
(14 pairs). docs/benchmarks/log.md.

An allocator is chosen when a process starts (`LD_PRELOAD`), so `mlxrt serve` re-executes itself
with jemalloc named first there (`reexec_with_jemalloc`, before it loads anything) where jemalloc
is installed (`make setup` installs Debian's `libjemalloc2`) and `MLXRT_MALLOC` is not `system`.
An application embedding the runtime chooses its own (`LD_PRELOAD=<libjemalloc.so.2> python app.py`
has the same effect). Nothing found, or the exec refused: the process goes on with glibc's.
"""

from __future__ import annotations

import ctypes.util
import os
import platform
import sys
from collections.abc import Mapping

from runtime import env

LIBRARY = "libjemalloc.so.2"


def find_jemalloc() -> str | None:
    """jemalloc's shared library, where this machine has it."""
    arch = platform.machine()
    for path in (f"/usr/lib/{arch}-linux-gnu/{LIBRARY}", f"/usr/lib64/{LIBRARY}", f"/usr/lib/{LIBRARY}", f"/usr/local/lib/{LIBRARY}"):
        if os.path.exists(path):
            return path
    found = ctypes.util.find_library("jemalloc")
    return found if found and os.path.isabs(found) else None


def preloaded(environ: Mapping[str, str]) -> str | None:
    """The jemalloc this process's environment preloads, if any."""
    return next((part for part in environ.get("LD_PRELOAD", "").replace(":", " ").split() if "jemalloc" in os.path.basename(part)), None)


def jemalloc_environment(environ: Mapping[str, str], library: str | None, choice: str | None) -> dict[str, str] | None:
    """The environment to re-execute with so that `library` is the process's malloc, or None where
    nothing is to be done (not Linux, `choice` (`MLXRT_MALLOC`) "system", no library, or preloaded
    already)."""
    if sys.platform != "linux" or library is None or choice == "system" or preloaded(environ):
        return None
    new = dict(environ)
    new["LD_PRELOAD"] = " ".join(part for part in (library, environ.get("LD_PRELOAD", "")) if part)
    return new


def reexec_with_jemalloc() -> None:
    """Replace this process with the same command under jemalloc (see the module), where that
    applies; returns only where it does not (or the exec failed)."""
    new = jemalloc_environment(os.environ, find_jemalloc(), env.get("MALLOC"))
    if new is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], new)
    except OSError as exc:  # (the process goes on with glibc's malloc)
        print(f"mlxrt: could not restart with jemalloc ({exc}); using the system's malloc", file=sys.stderr)


def name() -> str:
    """The malloc this process runs with: "jemalloc" or "system"."""
    return "jemalloc" if preloaded(os.environ) else "system"
