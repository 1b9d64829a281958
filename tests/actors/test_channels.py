"""Tests for the channel plumbing in actors.mailbox: CoalescingInbox, EventChannel and LiveSet.

The session-specific coalescing (SessionMailbox) is covered by test_mailbox.py; here the
generic inbox, the merge function on its own, closing, and the other two primitives.
"""

from __future__ import annotations

import anyio
import pytest

from actors.mailbox import CoalescingInbox, EventChannel, LiveSet, merge_session_messages
from protocols.api import TokenLogprob
from protocols.session import PrefillProgressed, RequestRejected, TokensGenerated


def sum_evens(last: int, new: int) -> int | None:
    return last + new if last % 2 == 0 and new % 2 == 0 else None


class Flag:
    """Records that a background wait returned."""

    def __init__(self) -> None:
        self.done = False

    async def after(self, wait) -> None:
        await wait
        self.done = True


# -- CoalescingInbox ---------------------------------------------------------------------


async def test_coalescing_inbox_merges_only_into_the_last_queued_message():
    inbox = CoalescingInbox[int](sum_evens)
    for value in (2, 4, 1, 6, 8):
        inbox.send_nowait(value)
    assert len(inbox) == 3
    assert [await inbox.receive() for _ in range(3)] == [6, 1, 14]
    # What was already received is never merged into.
    inbox.send_nowait(10)
    assert await inbox.receive() == 10


def test_merge_session_messages_concatenates_tokens_and_keeps_the_latest_progress():
    lp = TokenLogprob(token_id=2, logprob=-0.5)
    merged = merge_session_messages(TokensGenerated(request_id="r", token_ids=[1]), TokensGenerated(request_id="r", token_ids=[2], logprobs=[lp]))
    assert merged == TokensGenerated(request_id="r", token_ids=[1, 2], logprobs=[lp])
    first, latest = (PrefillProgressed(request_id="r", processed_tokens=n, total_tokens=9) for n in (3, 6))
    assert merge_session_messages(first, latest) == latest
    # Scored prompt tokens are all kept, in order.
    a, b = (TokenLogprob(token_id=t, logprob=-1.0) for t in (5, 6))
    scored = [PrefillProgressed(request_id="r", processed_tokens=n, total_tokens=9, prompt_logprobs=s) for n, s in ((3, [a]), (6, [b]))]
    assert merge_session_messages(*scored) == scored[1].__class__(request_id="r", processed_tokens=6, total_tokens=9, prompt_logprobs=[a, b])
    assert merge_session_messages(TokensGenerated(request_id="r", token_ids=[1]), latest) is None
    assert merge_session_messages(latest, TokensGenerated(request_id="r", token_ids=[1])) is None
    rejected = RequestRejected(request_id="r", code="busy", message="full")
    assert merge_session_messages(rejected, rejected) is None


async def test_coalescing_inbox_after_close_drains_then_ends():
    inbox = CoalescingInbox[int](sum_evens)
    inbox.send_nowait(1)
    inbox.send_nowait(3)
    inbox.close()
    assert [await inbox.receive(), await inbox.receive()] == [1, 3]
    for _ in range(2):
        with pytest.raises(anyio.EndOfStream):
            await inbox.receive()


async def test_coalescing_inbox_close_wakes_a_waiting_receiver():
    inbox = CoalescingInbox[int](sum_evens)
    ended = []

    async def receiver():
        try:
            await inbox.receive()
        except anyio.EndOfStream:
            ended.append(True)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            await anyio.wait_all_tasks_blocked()
            inbox.close()
    assert ended == [True]


def test_coalescing_inbox_send_nowait_never_blocks_without_a_reader():
    inbox = CoalescingInbox[int](lambda last, new: None)
    for value in range(10_000):
        inbox.send_nowait(value)
    assert len(inbox) == 10_000


# -- EventChannel ------------------------------------------------------------------------


async def test_event_channel_send_nowait_raises_would_block_when_full():
    channel = EventChannel[int](2)
    channel.send_nowait(1)
    channel.send_nowait(2)
    with pytest.raises(anyio.WouldBlock):
        channel.send_nowait(3)
    assert await channel.receive() == 1
    channel.send_nowait(3)
    assert [await channel.receive(), await channel.receive()] == [2, 3]


async def test_event_channel_refuses_items_once_the_reader_left():
    channel = EventChannel[int](2)
    channel.send_nowait(1)
    channel.close_reader()
    assert len(channel) == 0
    with pytest.raises(anyio.BrokenResourceError):
        channel.send_nowait(2)
    with pytest.raises(anyio.EndOfStream):
        await channel.receive()


async def test_event_channel_receive_ends_after_close_once_drained():
    with EventChannel[int](3) as channel:
        channel.send_nowait(1)
        channel.send_nowait(2)
    assert [await channel.receive(), await channel.receive()] == [1, 2]
    with pytest.raises(anyio.EndOfStream):
        await channel.receive()


async def test_wait_room_returns_only_once_the_reader_drained_to_the_level():
    channel = EventChannel[int](4)
    for value in range(4):
        channel.send_nowait(value)
    flag = Flag()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(flag.after, channel.wait_room(1))
            for left in (3, 2):
                await channel.receive()
                await anyio.wait_all_tasks_blocked()
                assert (flag.done, len(channel)) == (False, left)
            await channel.receive()
    assert flag.done and len(channel) == 1


async def test_wait_room_is_immediate_when_at_or_below_the_level():
    channel = EventChannel[int](3)
    channel.send_nowait(1)
    channel.send_nowait(2)
    with anyio.fail_after(5):
        await channel.wait_room()  # default level: one below capacity
        await channel.wait_room(2)
    assert len(channel) == 2


async def test_wait_room_returns_when_the_reader_leaves():
    channel = EventChannel[int](1)
    channel.send_nowait(1)
    flag = Flag()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(flag.after, channel.wait_room(0))
            await anyio.wait_all_tasks_blocked()
            assert not flag.done
            channel.close_reader()
    assert flag.done


async def test_async_iteration_gets_every_item_in_order_then_stops():
    channel = EventChannel[int](2)
    received = []

    async def producer():
        with channel:
            for value in range(20):
                await channel.send(value)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            async with channel:
                async for value in channel:
                    received.append(value)
    assert received == list(range(20))


async def test_a_reader_leaving_its_async_with_breaks_the_producer():
    channel = EventChannel[int](2)
    async with channel:
        channel.send_nowait(1)
        assert await channel.__anext__() == 1
    with pytest.raises(anyio.BrokenResourceError):
        channel.send_nowait(2)


async def test_a_wait_room_cancelled_by_its_deadline_never_loses_or_duplicates_an_item():
    # The session's pattern: try to send, else wait (with a deadline) for half the buffer
    # to drain, then wait for any room. The reader starts only after some deadlines passed.
    channel = EventChannel[int](4)
    timeouts = 0
    reader_may_start = anyio.Event()
    received = []

    async def producer():
        nonlocal timeouts
        with channel:
            for value in range(40):
                try:
                    channel.send_nowait(value)
                    continue
                except anyio.WouldBlock:
                    pass
                with anyio.move_on_after(0.001) as scope:
                    await channel.wait_room(channel.capacity // 2)
                timeouts += scope.cancelled_caught
                reader_may_start.set()
                await channel.wait_room()
                channel.send_nowait(value)

    async def reader():
        await reader_may_start.wait()
        async for value in channel:
            received.append(value)
            await anyio.sleep(0)  # a reader slower than the producer (it yields after each value)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            tg.start_soon(reader)
    assert timeouts >= 1
    assert received == list(range(40))


# -- LiveSet -----------------------------------------------------------------------------


async def test_wait_empty_returns_at_once_when_nothing_is_live():
    live = LiveSet[str]()
    with anyio.fail_after(5):
        await live.wait_empty()
    assert len(live) == 0


async def test_wait_empty_blocks_until_the_last_member_is_discarded():
    live = LiveSet[str]()
    live.add("a")
    live.add("b")
    flag = Flag()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(flag.after, live.wait_empty())
            await anyio.wait_all_tasks_blocked()
            live.discard("a")
            live.discard("nobody")
            await anyio.wait_all_tasks_blocked()
            assert not flag.done and "b" in live and "a" not in live
            live.discard("b")
    assert flag.done


async def test_wait_empty_blocks_again_after_a_new_member_is_added():
    live = LiveSet[str]()
    live.add("a")
    live.discard("a")
    live.add("c")
    flag = Flag()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(flag.after, live.wait_empty())
            await anyio.wait_all_tasks_blocked()
            assert not flag.done
            # Iteration is over a snapshot, so members may leave while it runs.
            for member in live:
                live.discard(member)
    assert flag.done and len(live) == 0
