"""Waiting for a condition, with a deadline, instead of sleeping and hoping.

`wait_until(predicate)` calls `predicate` until it returns something truthy and returns that, or
fails the test once `timeout` seconds have passed; `wait_until_async` does the same in an event
loop, where `predicate` may be a coroutine function. The deadline only guards against hangs: no
test's outcome depends on how fast the condition comes true.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")

TIMEOUT_S = 10.0
INTERVAL_S = 0.01


def _failure(predicate: Callable, timeout: float, message: str | Callable[[], str] | None) -> AssertionError:
    what = (message() if callable(message) else message) or getattr(predicate, "__name__", repr(predicate))
    return AssertionError(f"not true within {timeout} s: {what}")


def wait_until(predicate: Callable[[], T], timeout: float = TIMEOUT_S, *, interval: float = INTERVAL_S, message: str | Callable[[], str] | None = None) -> T:
    """The first truthy value `predicate()` returns, polled every `interval` seconds for up to
    `timeout` (then an `AssertionError` naming `message`, or the predicate)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failure(predicate, timeout, message)
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], T | Awaitable[T]], timeout: float = TIMEOUT_S, *, interval: float = INTERVAL_S, message: str | Callable[[], str] | None = None
) -> T:
    """`wait_until` in an event loop: other tasks run between polls; `predicate` may be async."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failure(predicate, timeout, message)
        await anyio.sleep(interval)
