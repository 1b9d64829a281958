"""Tokenizer work too big to share the server's process, in a worker process at low CPU priority.

Rendering a chat template, tokenizing a megabyte or decoding 200k token ids takes the CPU for
a second or more: in a thread of the server's process it competes with the MLX thread for the
cores (and, in its Python parts, for the GIL), so every stream slows while it runs. A job
bigger than `scheduler.bulk_tokenize_bytes` runs instead in one worker process per tokenizer,
started on the first such job, niced (+19) and, on Linux, under SCHED_IDLE (a waking engine
thread preempts it at once): it gets the cores the engine leaves idle. It
holds a copy of the runtime's tokenizer (pickled: the same object, special tokens, chat template
and tool parser included), so its answers are the ones the thread would give. Smaller jobs stay
in a worker thread (a process round trip would cost them more than it saves), and so do all jobs
of a tokenizer that does not pickle.

The worker is `python -m runtime.offload` on pipes (never `multiprocessing`, whose spawn would
run the embedding application's own `__main__` again); it ends when its stdin closes, so with
the server's process, however that ends. Jobs are top-level functions `fn(tokenizer, *args)`,
one at a time; their errors come back as raised (the project's errors pickle whole,
`protocols.errors.reduce_error`). A cancelled caller abandons its job (the worker finishes it).
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import anyio.to_thread
import structlog

T = TypeVar("T")

log = structlog.get_logger(actor="offload")

# The worker's niceness (the lowest): it runs when the engine's threads leave a core idle. At +10
# it still took ~10% of a core beside them, which cost a stream beside it a third of its rate
# (a BLAS product waits for its slowest thread).
NICE = 19
_LENGTH = struct.Struct(">Q")


class WorkerDiedError(RuntimeError):
    """The worker process ended mid-job (killed, out of memory); the next job starts another."""


def _send(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> bytes:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    size = _LENGTH.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return data


def _receive(stream: IO[bytes]) -> Any:
    return pickle.loads(_read_frame(stream))


class _Worker:
    """One worker process holding a tokenizer; one job at a time."""

    def __init__(self, pickled_tokenizer: bytes):
        # The server's import path (as multiprocessing's spawn passes it), so jobs' modules import there too.
        path = [str(Path(__file__).resolve().parents[1]), *(p for p in sys.path if p and os.path.isdir(p))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self._process = subprocess.Popen([sys.executable, "-m", "runtime.offload"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._lock = threading.Lock()
        assert self._process.stdin is not None
        self._process.stdin.write(_LENGTH.pack(len(pickled_tokenizer)) + pickled_tokenizer)
        self._process.stdin.flush()

    def call(self, fn: Callable[..., T], args: tuple) -> T:
        """(A worker thread) run one job; raises what it raised."""
        with self._lock:
            stdin, stdout = self._process.stdin, self._process.stdout
            assert stdin is not None and stdout is not None
            try:
                _send(stdin, (fn, args))
                ok, value = _receive(stdout)
            except (EOFError, BrokenPipeError, OSError) as exc:
                raise WorkerDiedError(f"the tokenizer worker ended ({type(exc).__name__})") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self._process.stdin is not None:
            try:
                self._process.stdin.close()
            except OSError:
                pass
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()


_lock = threading.Lock()
# A tokenizer that does not pickle (a remote-code class, a patched one) maps to None: threads only.
_workers: weakref.WeakKeyDictionary[Any, _Worker | None] = weakref.WeakKeyDictionary()


def _worker(tokenizer: Any) -> _Worker | None:
    with _lock:
        if tokenizer in _workers:
            return _workers[tokenizer]
        try:
            pickled = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # (whatever its class raises): its jobs stay in threads
            log.warning("tokenizer_not_offloaded", reason=f"{type(exc).__name__}: {exc}"[:300])
            _workers[tokenizer] = None
            return None
        worker = _Worker(pickled)
        _workers[tokenizer] = worker
        weakref.finalize(tokenizer, worker.close)
        return worker


async def run(tokenizer: Any, fn: Callable[..., T], *args: Any, size: int, min_size: int) -> T:
    """`fn(tokenizer, *args)` off the event loop: in the tokenizer's low-priority worker process
    when `size` (bytes of text, or 4 per token id) is at least `min_size` (0: never), else in
    a worker thread."""
    worker = _worker(tokenizer) if min_size and size >= min_size else None
    if worker is None:
        return await anyio.to_thread.run_sync(fn, tokenizer, *args)
    try:
        return await anyio.to_thread.run_sync(worker.call, fn, args, abandon_on_cancel=True)
    except WorkerDiedError:
        with _lock:
            if _workers.get(tokenizer) is worker:
                del _workers[tokenizer]
        worker.close()
        raise


def shutdown(tokenizer: Any) -> None:
    """End the tokenizer's worker process, if it has one (it is also ended with the tokenizer)."""
    with _lock:
        worker = _workers.pop(tokenizer, None)
    if worker is not None:
        worker.close()


def text_size(*texts: Any) -> int:
    """The bytes a job's texts come to, roughly (a message list by its repr; no encoding)."""
    total = 0
    for text in texts:
        if isinstance(text, str):
            total += len(text)
        elif isinstance(text, list | dict):
            total += len(repr(text))
    return total


def _serve() -> None:
    """(The worker process) read the tokenizer, then answer jobs until stdin closes."""
    try:
        os.nice(NICE)
    except OSError:  # (not permitted: it runs at the server's priority)
        pass
    try:  # Linux: below every normal thread, preempted at once when one wakes
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # (a job's prints must not corrupt the replies)
    try:
        tokenizer = _receive(stdin)
        while True:
            job = _read_frame(stdin)
            try:
                fn, args = pickle.loads(job)  # (a job naming what this process cannot import fails alone)
                reply: tuple[bool, Any] = (True, fn(tokenizer, *args))
            except Exception as exc:
                reply = (False, exc)
            try:
                _send(stdout, reply)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                _send(stdout, (False, RuntimeError(f"the job's answer does not pickle: {type(exc).__name__}: {exc}")))
    except (EOFError, BrokenPipeError):
        return


if __name__ == "__main__":
    _serve()
