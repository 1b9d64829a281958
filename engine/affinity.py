"""A core of its own for the thread that runs the model's kernels (Linux, CPU device).

MLX runs a stream's tasks on a thread of its own (the stream thread: every kernel of a step,
mlxrt's native ones included), fed by the thread that builds and evaluates the graphs (the MLX
thread, `actors.mlx_thread`). While a step runs, the MLX thread waits for task completions (MLX
keeps at most ten tasks of ten dispatches queued) and wakes at each: ~80 times a SmolLM2 decode
step. On a machine with few cores the scheduler often runs it on the stream thread's core, which
then waits for it; the quantized products' helper thread (`engine.native`) spins on the other.

`pin()`, on the MLX thread, gives its stream thread one core and keeps the MLX thread and the
helper off it, so that the MLX thread's wake-ups take the helper's time (whatever chunks of a
product the helper has not taken, the stream thread computes) instead of the kernels'. Threads
these create later inherit their masks: the MLX thread's second stream (`engine.lanes`) keeps
off the pinned core too. Other threads of the process (BLAS's workers, an embedding
application's) are left as they are; `mlxrt serve` keeps its event loop off the pinned core
(`keep_off_pinned`). Measured on two cores (SmolLM2 Q4_1, `mlxrt
serve`, one stream): a token every 9.2-10.7 ms pinned against 9.6-11.7 unpinned, in every one
of three alternating pairs (docs/benchmarks/log.md).

A core is claimed with a lock file per core (`flock`, held until `release()` or the process
ends) so that two MLX threads, in one process or in several of one user's (two servers, test
workers), never pin the same core; a core is pinned only while another core of the mask stays
unclaimed for everything else. On two cores, the first claim wins and the others run unpinned.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import structlog

from engine import native

log = structlog.get_logger(__name__)

_local = threading.local()
_lock = threading.Lock()
# Cores pinned by this process's MLX threads.
_claimed: set[int] = set()


def default_lock_dir() -> Path:
    """Where the per-core lock files are: one directory per user, shared by their processes."""
    return Path(tempfile.gettempdir()) / f"mlxrt-cores-{os.getuid()}"


class _Pin:
    def __init__(self, core: int, lock_fd: int, allowed: set[int], stream_tid: int, helper_tid: int):
        self.core, self.lock_fd, self.allowed = core, lock_fd, allowed
        self.stream_tid, self.helper_tid = stream_tid, helper_tid


def pin(lock_dir: Path | None = None) -> int | None:
    """On the MLX thread: pin its default CPU stream's thread to a core of its own and keep this
    thread and the helper off it (see the module). Returns the core; None where nothing was
    pinned (not Linux, not the CPU device, no native kernels, no core left to claim, or a
    mask the system refuses). Pinned already by this thread: its core."""
    held: _Pin | None = getattr(_local, "pin", None)
    if held is not None:
        return held.core
    module = native.loaded()
    if sys.platform != "linux" or module is None or mx.default_device() != mx.cpu:
        return None
    allowed = os.sched_getaffinity(0)
    stream_tid = int(module.stream_thread_id().item())
    helper_tid = int(module.helper_thread_id())
    with _lock:
        claim = _claim(allowed - _claimed, lock_dir or default_lock_dir())
        if claim is None:
            return None
        core, fd = claim
        rest = allowed - _claimed - {core}
        try:
            os.sched_setaffinity(stream_tid, {core})
            os.sched_setaffinity(0, rest)
            os.sched_setaffinity(helper_tid, rest)
        except OSError as exc:  # (a mask the container refuses: everything back as it was)
            _set_masks([stream_tid, 0, helper_tid], allowed)
            os.close(fd)
            log.warning("kernel_thread_not_pinned", error=str(exc))
            return None
        _claimed.add(core)
    _local.pin = _Pin(core, fd, allowed, stream_tid, helper_tid)
    log.info("kernel_thread_pinned", core=core, others=sorted(rest))
    return core


def release() -> None:
    """On the MLX thread that pinned: the masks `pin` set back to the one it found, its core's
    claim given up (the helper keeps off the cores other MLX threads still pin)."""
    held: _Pin | None = getattr(_local, "pin", None)
    if held is None:
        return
    with _lock:
        _claimed.discard(held.core)
        _set_masks([held.stream_tid, 0], held.allowed)
        _set_masks([held.helper_tid], held.allowed - _claimed)
        os.close(held.lock_fd)
    _local.pin = None


def keep_off_pinned() -> set[int] | None:
    """On a thread of the process's own (`mlxrt serve`'s event loop): keep it off the cores this
    process's MLX threads pinned, where another core is left to it. Returns its mask, or None where
    nothing changed. Measured on two cores (SmolLM2 Q4_1, `mlxrt serve`, 300-token greedy streams,
    two servers in turn): 10.71 -> 9.94 and 9.41 -> 9.06 ms a token (paired medians 0.938 and 0.968,
    23 of 32 pairs faster): the loop's ~1 ms a token no longer preempts the kernels' thread."""
    if sys.platform != "linux":
        return None
    with _lock:
        pinned_cores = set(_claimed)
    allowed = os.sched_getaffinity(0)
    rest = allowed - pinned_cores
    if not pinned_cores or not rest or rest == allowed:
        return None
    try:
        os.sched_setaffinity(0, rest)
    except OSError:
        return None
    log.info("event_loop_off_kernel_core", cores=sorted(rest))
    return rest


def pinned() -> int | None:
    """The core this MLX thread's stream thread is pinned to, if any."""
    held: _Pin | None = getattr(_local, "pin", None)
    return held.core if held is not None else None


def _claim(candidates: set[int], lock_dir: Path) -> tuple[int, int] | None:
    """The highest of `candidates` no other process claims, with its lock file's descriptor
    (locked), if another candidate stays unclaimed besides it; else None, nothing held."""
    try:
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    taken: tuple[int, int] | None = None
    # (The last core first: interrupts and a process's first threads favour core 0.)
    for core in sorted(candidates, reverse=True):
        fd = _lock_core(lock_dir, core)
        if fd is None:
            continue
        if taken is None:
            taken = (core, fd)
            continue
        os.close(fd)  # another core is free: the claim stands
        return taken
    if taken is not None:
        os.close(taken[1])
    return None


def _lock_core(lock_dir: Path, core: int) -> int | None:
    try:
        fd = os.open(lock_dir / f"core-{core}", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another MLX thread's (this process's or another's)
        os.close(fd)
        return None
    return fd


def _set_masks(tids: list[int], mask: set[int]) -> None:
    for tid in tids:
        with contextlib.suppress(OSError):  # (a thread gone, an empty mask)
            os.sched_setaffinity(tid, mask)
