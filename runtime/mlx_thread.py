"""The dedicated OS thread that runs all MLX work.

MLX streams are thread-local, so every `mx` call for a model must come from one
thread. `MlxThread.run(fn, *args)` queues `fn` on that thread (bounded queue)
and awaits its result without blocking the event loop.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")

_STOP = object()


class MlxThread:
    """One worker thread, started by `start()` and ended by `stop()`."""

    def __init__(self, name: str = "mlx", max_pending: int = 8):
        self._jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def start(self) -> None:
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the MLX thread; cancelling the caller abandons the result."""
        future: Future[T] = Future()
        await self._put((future, fn, args))
        return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)

    async def stop(self) -> None:
        """Finish queued jobs, then end the thread."""
        if not self._thread.is_alive():
            return
        await self._put((None, _STOP, ()))
        await anyio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)

    async def _put(self, job: tuple) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            await anyio.to_thread.run_sync(self._jobs.put, job, abandon_on_cancel=True)

    def _loop(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if fn is _STOP:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # delivered to the awaiting task
                future.set_exception(exc)
