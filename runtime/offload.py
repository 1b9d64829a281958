"""Tokenizer work too big to share the server's process, in a worker process at low CPU priority.

Rendering a chat template, tokenizing a megabyte or decoding 200k token ids takes the CPU for
a second or more: in a thread of the server's process it competes with the MLX thread for the
cores (and, in its Python parts, for the GIL), so every stream slows while it runs. A job
bigger than `scheduler.bulk_tokenize_bytes` runs instead in one worker process per tokenizer,
started on the first such job and niced (+10): it gets the cores the engine leaves idle. It
holds a copy of the runtime's tokenizer (pickled: the same object, special tokens, chat template
and tool parser included), so its answers are the ones the thread would give. Smaller jobs stay
in a worker thread (a process round trip would cost them more than it saves).

Jobs are top-level functions `fn(tokenizer, *args)`; their errors come back as raised (the
project's errors pickle whole, `protocols.errors.reduce_error`). A caller that is cancelled
abandons its job; the process is ended with its tokenizer (or the interpreter).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.to_thread
import structlog

T = TypeVar("T")

log = structlog.get_logger(actor="offload")

# The worker's niceness: it runs when the engine's threads leave a core idle.
NICE = 10

# (In a worker process) the tokenizer its jobs run with.
_tokenizer: Any = None

_lock = threading.Lock()
# A tokenizer that does not pickle (a remote-code class, a patched one) maps to None: threads only.
_workers: weakref.WeakKeyDictionary[Any, concurrent.futures.ProcessPoolExecutor | None] = weakref.WeakKeyDictionary()


def _start(tokenizer_bytes: bytes) -> None:
    global _tokenizer
    try:
        os.nice(NICE)
    except OSError:  # (not permitted: it runs at the server's priority)
        pass
    _tokenizer = pickle.loads(tokenizer_bytes)


def _job(fn: Callable[..., T], args: tuple) -> T:
    return fn(_tokenizer, *args)


def _executor(tokenizer: Any) -> concurrent.futures.ProcessPoolExecutor | None:
    with _lock:
        if tokenizer in _workers:
            return _workers[tokenizer]
        try:
            pickled = pickle.dumps(tokenizer)
        except Exception as exc:  # (whatever its class raises): its jobs stay in threads
            log.warning("tokenizer_not_offloaded", reason=f"{type(exc).__name__}: {exc}"[:300])
            _workers[tokenizer] = None
            return None
        # spawn: the server's process has threads (MLX's among them) that fork would copy mid-state.
        context = multiprocessing.get_context("spawn")
        executor = concurrent.futures.ProcessPoolExecutor(1, mp_context=context, initializer=_start, initargs=(pickled,))
        _workers[tokenizer] = executor
        weakref.finalize(tokenizer, executor.shutdown, wait=False, cancel_futures=True)
        return executor


async def run(tokenizer: Any, fn: Callable[..., T], *args: Any, size: int, min_size: int) -> T:
    """`fn(tokenizer, *args)` off the event loop: in the tokenizer's low-priority worker process
    when `size` (bytes of text, or 4 per token id) is at least `min_size` (0: never), else in
    a worker thread."""
    executor = _executor(tokenizer) if min_size and size >= min_size else None
    if executor is None:
        return await anyio.to_thread.run_sync(fn, tokenizer, *args)
    future = executor.submit(_job, fn, args)
    try:
        return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)
    except concurrent.futures.process.BrokenProcessPool:
        # The worker died (killed, out of memory): the next job starts another.
        with _lock:
            _workers.pop(tokenizer, None)
        raise
    finally:
        future.cancel()


def shutdown(tokenizer: Any) -> None:
    """End the tokenizer's worker process, if it has one (it is also ended with the tokenizer)."""
    with _lock:
        executor = _workers.pop(tokenizer, None)
    if executor is not None:
        executor.shutdown(wait=False, cancel_futures=True)


def text_size(*texts: Any) -> int:
    """The bytes a job's texts come to, roughly (a message list by its JSON; no encoding)."""
    total = 0
    for text in texts:
        if isinstance(text, str):
            total += len(text)
        elif isinstance(text, list | dict):
            total += len(repr(text))
    return total
