"""Tests for actors.mailbox: bounded inboxes, ask/answer, the coalescing session inbox."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from contextlib import closing

import anyio
import pytest

from actors.mailbox import Mailbox, SessionMailbox, answer, ask
from protocols.api import TokenLogprob
from protocols.base import Message, Reply
from protocols.session import PrefillProgressed, RequestFinished, RequestRejected, RequestTimeline, TokensGenerated


class Ping(Message):
    value: int
    reply: Reply[int]


def tokens(*ids: int, logprobs: bool = False) -> TokensGenerated:
    lps = [TokenLogprob(token_id=i, logprob=-float(i)) for i in ids] if logprobs else None
    return TokensGenerated(request_id="r", token_ids=list(ids), logprobs=lps)


def progress(done: int, total: int = 100) -> PrefillProgressed:
    return PrefillProgressed(request_id="r", processed_tokens=done, total_tokens=total)


def finished(reason: str = "length") -> RequestFinished:
    return RequestFinished(request_id="r", finish_reason=reason, timeline=RequestTimeline(submitted=0.0))


@pytest.fixture
def session_box() -> Iterator[SessionMailbox]:
    box = SessionMailbox()
    yield box
    close = getattr(box, "close", None)
    if close is not None:
        close()


def drain(box: SessionMailbox) -> list:
    """Everything queued, without waiting (the queue is a deque behind receive())."""
    items = []
    while len(box):
        items.append(box._items.popleft())
    return items


# -- SessionMailbox coalescing --------------------------------------------------------


async def test_consecutive_tokens_merge(session_box):
    session_box.send_nowait(tokens(1, 2))
    session_box.send_nowait(tokens(3))
    session_box.send_nowait(tokens(4, 5))
    assert len(session_box) == 1
    merged = await session_box.receive()
    assert merged == TokensGenerated(request_id="r", token_ids=[1, 2, 3, 4, 5], logprobs=None)
    assert len(session_box) == 0


async def test_merged_logprobs_are_concatenated(session_box):
    session_box.send_nowait(tokens(1, 2, logprobs=True))
    session_box.send_nowait(tokens(3, logprobs=True))
    merged = await session_box.receive()
    assert merged.token_ids == [1, 2, 3]
    assert merged.logprobs == [TokenLogprob(token_id=i, logprob=-float(i)) for i in (1, 2, 3)]


async def test_merge_does_not_mutate_the_sent_messages(session_box):
    first, second = tokens(1), tokens(2)
    session_box.send_nowait(first)
    session_box.send_nowait(second)
    await session_box.receive()
    assert first.token_ids == [1] and second.token_ids == [2]


async def test_consecutive_progress_keeps_the_latest(session_box):
    for done in (10, 20, 30):
        session_box.send_nowait(progress(done))
    assert len(session_box) == 1
    assert await session_box.receive() == progress(30)


async def test_finished_after_tokens_is_kept_separate_and_ordered(session_box):
    session_box.send_nowait(tokens(1))
    session_box.send_nowait(tokens(2))
    session_box.send_nowait(finished("stop"))
    assert len(session_box) == 2
    assert await session_box.receive() == tokens(1, 2)
    assert await session_box.receive() == finished("stop")


def test_only_adjacent_messages_of_the_same_kind_merge(session_box):
    sequence = [progress(5), tokens(1), tokens(2), progress(10), progress(15), tokens(3), finished()]
    for message in sequence:
        session_box.send_nowait(message)
    assert drain(session_box) == [progress(5), tokens(1, 2), progress(15), tokens(3), finished()]


def test_rejections_are_never_merged(session_box):
    rejected = RequestRejected(request_id="r", code="busy", message="full")
    session_box.send_nowait(rejected)
    session_box.send_nowait(rejected)
    assert drain(session_box) == [rejected, rejected]


# -- SessionMailbox waiting ------------------------------------------------------------


async def test_receive_waits_until_something_is_sent(session_box):
    received = []

    async def receiver():
        received.append(await session_box.receive())

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            await anyio.wait_all_tasks_blocked()
            assert received == []
            session_box.send_nowait(tokens(7))
    assert received == [tokens(7)]


async def test_receive_waits_again_after_a_stale_wake_up(session_box):
    # Two items are queued and both read without waiting; whatever wake-up the
    # sends left behind must not end the next wait early.
    session_box.send_nowait(tokens(1))
    session_box.send_nowait(finished())
    assert await session_box.receive() == tokens(1)
    assert await session_box.receive() == finished()
    received = []

    async def receiver():
        received.append(await session_box.receive())

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            await anyio.wait_all_tasks_blocked()
            assert received == []
            session_box.send_nowait(progress(1))
    assert received == [progress(1)]


async def test_many_sends_without_a_reader_never_block(session_box):
    for i in range(1000):
        session_box.send_nowait(tokens(i))
        session_box.send_nowait(progress(i))
    assert len(session_box) == 2000
    session_box.send_nowait(finished())
    with anyio.fail_after(2):
        assert await session_box.receive() == tokens(0)


async def test_session_mailbox_does_not_leak_its_streams():
    # Regression: its wake-up bell used to be an anyio memory stream pair that
    # nothing closed, so every session warned ResourceWarning when collected.
    gc.collect()  # earlier garbage must not be blamed on this mailbox
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        box = SessionMailbox()
        box.send_nowait(tokens(1))
        assert await box.receive() == tokens(1)
        close = getattr(box, "close", None)
        if close is not None:
            close()
        del box
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


# -- Mailbox -------------------------------------------------------------------------


async def test_mailbox_send_nowait_raises_would_block_when_full():
    with closing(Mailbox[int](2)) as box:
        box.send_nowait(1)
        box.send_nowait(2)
        with pytest.raises(anyio.WouldBlock):
            box.send_nowait(3)
        assert box.statistics().current_buffer_used == 2
        assert box.receive_nowait() == 1
        box.send_nowait(3)
        assert [await box.receive(), await box.receive()] == [2, 3]


def test_mailbox_receive_nowait_raises_would_block_when_empty():
    with closing(Mailbox[int](1)) as box, pytest.raises(anyio.WouldBlock):
        box.receive_nowait()


async def test_mailbox_send_waits_for_room():
    with closing(Mailbox[int](1)) as box:
        sent = []

        async def sender():
            await box.send(2)
            sent.append(2)

        box.send_nowait(1)
        with anyio.fail_after(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender)
                await anyio.wait_all_tasks_blocked()
                assert sent == []
                assert box.receive_nowait() == 1
        assert sent == [2]
        assert box.receive_nowait() == 2


async def test_mailbox_close_ends_senders():
    box = Mailbox[int](1)
    box.close()
    with pytest.raises(anyio.ClosedResourceError):
        box.send_nowait(1)


# -- ask / answer -------------------------------------------------------------------


async def test_ask_answer_round_trip():
    with closing(Mailbox[Ping](4)) as box:

        async def responder():
            while True:
                message = await box.receive()
                answer(message.reply, message.value * 2)

        with anyio.fail_after(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(responder)
                results = [await ask(box, Ping, value=v) for v in (1, 2, 21)]
                tg.cancel_scope.cancel()
    assert results == [2, 4, 42]


async def test_late_answer_after_ask_returned_does_not_raise():
    replies = []
    with closing(Mailbox[Ping](4)) as box:

        async def responder():
            message = await box.receive()
            replies.append(message.reply)
            answer(message.reply, 1)

        with anyio.fail_after(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(responder)
                assert await ask(box, Ping, value=0) == 1
    # ask closed its reply stream on return; a second answer is dropped quietly.
    answer(replies[0], 2)
    with pytest.raises(anyio.ClosedResourceError):
        replies[0].send_nowait(3)


def test_answer_to_a_reply_whose_asker_went_away_does_not_raise():
    send, receive = anyio.create_memory_object_stream[int](1)
    receive.close()
    with send:
        answer(send, 1)
        with pytest.raises(anyio.BrokenResourceError):
            send.send_nowait(1)


def test_answer_to_a_closed_reply_does_not_raise():
    send, receive = anyio.create_memory_object_stream[int](1)
    send.close()
    with receive:
        answer(send, 1)
        with pytest.raises(anyio.EndOfStream):
            receive.receive_nowait()


def test_answer_delivers():
    send, receive = anyio.create_memory_object_stream[str](1)
    with send, receive:
        answer(send, "yes")
        assert receive.receive_nowait() == "yes"
