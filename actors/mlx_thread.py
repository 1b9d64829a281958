"""The dedicated OS thread that runs all MLX work.

MLX streams are thread-local, so every `mx` call for a model must come from one
thread. `MlxThread.run(fn, *args)` queues `fn` on that thread (bounded queue)
and awaits its result without blocking the event loop. The thread wakes the
loop directly when a job is done (no worker-thread hop): with BLAS using every
core, each extra thread switch per step costs decode speed.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

T = TypeVar("T")

_STOP = object()


def loop_caller(token: anyio.lowlevel.EventLoopToken) -> Callable[[Callable[[], None]], None]:
    """A non-blocking way to run a callback on the event loop from another thread."""
    native: Any = token.native_token
    if hasattr(native, "call_soon_threadsafe"):  # asyncio loop
        return native.call_soon_threadsafe
    return native.run_sync_soon  # trio token


class Job(Generic[T]):
    """One job queued on the MLX thread; its result is awaited on the event loop."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        # The result, or (None, the exception it raised).
        self._outcome: list = []

    def entry(self, fn: Callable[..., T], args: tuple) -> tuple:
        """What the thread's queue holds for it."""
        return (loop_caller(anyio.lowlevel.current_token()), self._done.set, self._outcome, fn, args)

    async def result(self) -> T:
        await self._done.wait()
        if len(self._outcome) == 2:
            raise self._outcome[1]
        return self._outcome[0]


class MlxThread:
    """One worker thread, started by `start()` and ended by `stop()`."""

    def __init__(self, name: str = "mlx", max_pending: int = 8):
        self._jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._stopped = threading.Event()
        # When each user of the thread (a model actor, by `note`) last ran a step on it.
        self._activity: dict[int, float] = {}

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def start(self, switch_interval_s: float = 0.0) -> None:
        """Start the thread. `switch_interval_s` (> 0): the interpreter's GIL switch interval is
        lowered to it (never raised): the MLX thread takes the GIL back after each evaluation, and
        at Python's 5 ms default it waits up to that long each time behind an event loop busy
        with a big request body, several times a step."""
        if 0 < switch_interval_s < sys.getswitchinterval():
            sys.setswitchinterval(switch_interval_s)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the MLX thread; cancelling the caller abandons the result."""
        job: Job[T] = Job()
        await self._put(job.entry(fn, args))
        return await job.result()

    def submit_nowait(self, fn: Callable[..., T], *args: Any) -> Job[T] | None:
        """Queue `fn(*args)` now, from the event loop's thread, without yielding to other tasks
        (the MLX thread may start it before the caller's task next waits); None if the queue is
        full. Await `Job.result()` for its result."""
        job: Job[T] = Job()
        try:
            self._jobs.put_nowait(job.entry(fn, args))
        except queue.Full:
            return None
        return job

    def note(self, user: int) -> None:
        """`user` (any id) has just run work on the thread."""
        self._activity[user] = time.monotonic()

    def busy_besides(self, user: int, within_s: float) -> bool:
        """Whether another user ran work on the thread in the last `within_s` seconds."""
        now = time.monotonic()
        return any(other != user and now - at <= within_s for other, at in self._activity.items())

    async def stop(self) -> None:
        """Finish queued jobs; the thread then parks for good (see `_loop`)."""
        if self._stopped.is_set() or not self._thread.is_alive():
            return
        await self._put(_STOP)
        await anyio.to_thread.run_sync(self._stopped.wait, abandon_on_cancel=True)

    async def _put(self, job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            await anyio.to_thread.run_sync(self._jobs.put, job, abandon_on_cancel=True)

    def _loop(self) -> None:
        self._serve_jobs()
        affinity = sys.modules.get("engine.affinity")  # (imported only by a thread that pinned a core)
        if affinity is not None:
            affinity.release()
        self._stopped.set()
        # Park instead of exiting: MLX keeps per-thread state (the compile cache of every
        # `mx.compile`d function this thread ran, mlx.nn's activations included) whose
        # destructors call into Python when the OS thread exits. An exit that overlaps the
        # interpreter's finalization aborts the process ("terminate called without an active
        # exception"); a parked daemon thread just ends with the process.
        threading.Event().wait()

    def _serve_jobs(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            call_soon, wake, outcome, fn, args = job
            try:
                outcome.append(fn(*args))
            except BaseException as exc:  # delivered to the awaiting task
                outcome.extend([None, exc])
            try:
                call_soon(wake)
            except RuntimeError:  # the event loop is gone; nobody is waiting
                pass
