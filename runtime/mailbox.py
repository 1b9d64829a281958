"""Actor plumbing: bounded inboxes, request/reply, and the session's coalescing inbox."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from protocols.base import Message, Reply
from protocols.session import PrefillProgressed, SessionInbox, TokensGenerated

T = TypeVar("T")
R = TypeVar("R")


class Mailbox(Generic[T]):
    """A bounded inbox: any number of senders, one receiving actor."""

    def __init__(self, capacity: int):
        self._send: MemoryObjectSendStream[T]
        self._receive: MemoryObjectReceiveStream[T]
        self._send, self._receive = anyio.create_memory_object_stream[T](capacity)

    async def send(self, message: T) -> None:
        await self._send.send(message)

    def send_nowait(self, message: T) -> None:
        """Raises `anyio.WouldBlock` when full."""
        self._send.send_nowait(message)

    async def receive(self) -> T:
        return await self._receive.receive()

    def receive_nowait(self) -> T:
        """Raises `anyio.WouldBlock` when empty."""
        return self._receive.receive_nowait()

    def close(self) -> None:
        self._send.close()
        self._receive.close()

    def __enter__(self) -> Mailbox[T]:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def statistics(self):
        return self._send.statistics()


async def ask(mailbox: Mailbox, make: Callable[[Reply[R]], Message]) -> R:
    """Send `make(reply)` and wait for the single answer sent to `reply`."""
    send, receive = anyio.create_memory_object_stream[R](1)
    with send, receive:
        await mailbox.send(make(send))
        return await receive.receive()


def answer(reply: Reply[R], value: R) -> None:
    """Deliver a reply; the asker may have gone away, which is not an error."""
    try:
        reply.send_nowait(value)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass


class SessionMailbox:
    """A session's inbox; never blocks the scheduler and stays bounded.

    Consecutive `TokensGenerated` merge into one, consecutive progress reports
    keep the latest, so the queue holds at most a few messages whatever the
    consumer's pace, and tokens are bounded by the request's `max_tokens`.
    """

    def __init__(self) -> None:
        self._items: deque[SessionInbox] = deque()
        self._arrived = anyio.Event()

    def send_nowait(self, message: SessionInbox) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(message, TokensGenerated) and isinstance(last, TokensGenerated):
            self._items[-1] = _merge(last, message)
        elif isinstance(message, PrefillProgressed) and isinstance(last, PrefillProgressed):
            self._items[-1] = message
        else:
            self._items.append(message)
        self._arrived.set()

    async def receive(self) -> SessionInbox:
        while not self._items:
            self._arrived = anyio.Event()
            await self._arrived.wait()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


def _merge(a: TokensGenerated, b: TokensGenerated) -> TokensGenerated:
    logprobs = (a.logprobs or []) + (b.logprobs or []) if a.logprobs is not None or b.logprobs is not None else None
    return msgspec.structs.replace(a, token_ids=a.token_ids + b.token_ids, logprobs=logprobs)
