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
    """Deliver a reply; the asker may have gone away (or be full), which is not an error."""
    try:
        reply.send_nowait(value)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
        pass


class CoalescingInbox(Generic[T]):
    """An inbox that never blocks its sender and stays small: a new message may
    merge into the last queued one (`merge` returns the merged message, or None
    to queue it separately). Used where a fast producer must not wait on a slow
    consumer and what piles up is bounded by its own nature (a request's tokens).
    """

    def __init__(self, merge: Callable[[T, T], T | None]):
        self._merge = merge
        self._items: deque[T] = deque()
        self._arrived = anyio.Event()
        self._closed = False

    def send_nowait(self, message: T) -> None:
        merged = self._merge(self._items[-1], message) if self._items else None
        if merged is not None:
            self._items[-1] = merged
        else:
            self._items.append(message)
        self._arrived.set()

    def close(self) -> None:
        """No more messages; `receive` raises `anyio.EndOfStream` once the queue is empty."""
        self._closed = True
        self._arrived.set()

    async def receive(self) -> T:
        while not self._items:
            if self._closed:
                raise anyio.EndOfStream
            self._arrived = anyio.Event()
            await self._arrived.wait()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


def merge_session_messages(last: SessionInbox, new: SessionInbox) -> SessionInbox | None:
    """Consecutive tokens concatenate; consecutive progress reports keep the latest."""
    if isinstance(last, TokensGenerated) and isinstance(new, TokensGenerated):
        return msgspec.structs.replace(last, token_ids=last.token_ids + new.token_ids, logprobs=join_optional(last.logprobs, new.logprobs))
    if isinstance(last, PrefillProgressed) and isinstance(new, PrefillProgressed):
        return new
    return None


class SessionMailbox(CoalescingInbox[SessionInbox]):
    """A session's inbox: the scheduler never blocks on it, and it holds at most a few messages."""

    def __init__(self) -> None:
        super().__init__(merge_session_messages)


def join_optional(a: list | None, b: list | None) -> list | None:
    """Concatenate two optional lists; None only when both are."""
    return (a or []) + (b or []) if a is not None or b is not None else None
