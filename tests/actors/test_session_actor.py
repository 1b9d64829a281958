"""Tests for actors.session: one SessionActor driven through its inbox, with a fake scheduler
(a mailbox the test reads) and a fake detokenizer (no model, no MLX)."""

from __future__ import annotations

import time

import anyio
import pytest

from actors.mailbox import EventChannel, Mailbox
from actors.session import SessionActor
from policies.output_parser import OutputParser
from protocols.api import CheckpointReport, FillStats, Finished, PrefillProgress, TokenDelta, ToolCall, Usage
from protocols.scheduler import CancelRequest, FinishRequest, SetPaused
from protocols.session import PrefillProgressed, RequestFinished, RequestRejected, RequestTimeline, TokensGenerated


class Spelling:
    """A detokenizer: token i reads as `pieces[i]`, else as the letter chr(97 + i % 26)."""

    def __init__(self, pieces: dict[int, str] | None = None):
        self.pieces = pieces or {}

    def add(self, token: int) -> str:
        return self.pieces.get(token, chr(97 + token % 26))

    def flush(self) -> str:
        return ""


class Harness:
    """One session with request id "r" and a 10-token prompt, its fake scheduler and its events."""

    def __init__(self, *, stop=(), capacity=64, max_pause_s=300.0, pieces=None, parser=None):
        self.scheduler: Mailbox = Mailbox(16)
        self.events: EventChannel = EventChannel(capacity)
        self.session = SessionActor(
            request_id="r",
            num_prompt_tokens=10,
            detokenizer=Spelling(pieces),
            stop=list(stop),
            scheduler=self.scheduler,
            events=self.events,
            parser=parser,
            max_pause_s=max_pause_s,
        )
        self.ended = anyio.Event()

    async def run(self) -> None:
        await self.session.run()
        self.ended.set()

    async def feed(self, *messages) -> None:
        """Deliver messages one at a time, each handled before the next arrives (so none coalesce)."""
        for message in messages:
            self.session.inbox.send_nowait(message)
            await anyio.wait_all_tasks_blocked()

    def sent(self) -> list:
        """What the session has sent the scheduler so far."""
        messages = []
        while True:
            try:
                messages.append(self.scheduler.receive_nowait())
            except anyio.WouldBlock:
                return messages

    async def read_all(self) -> list:
        return [event async for event in self.events]


@pytest.fixture
def make_harness():
    """Harnesses whose scheduler mailboxes are closed after the test."""
    made: list[Harness] = []

    def make(**options) -> Harness:
        made.append(Harness(**options))
        return made[-1]

    yield make
    for harness in made:
        harness.scheduler.close()


def tokens(*ids: int) -> TokensGenerated:
    return TokensGenerated(request_id="r", token_ids=list(ids))


def finished(reason: str = "length", **fields) -> RequestFinished:
    return RequestFinished(request_id="r", finish_reason=reason, timeline=fields.pop("timeline", RequestTimeline(submitted=time.monotonic())), **fields)


def text_of(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenDelta))


def ids_of(events: list) -> list[int]:
    return [i for e in events if isinstance(e, TokenDelta) for i in e.token_ids]


async def run_session(harness: Harness, *messages) -> list:
    """Run the session over `messages` with a reader that keeps up; every event, in order."""
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(harness.run)
            await harness.feed(*messages)
            return await harness.read_all()


async def test_tokens_become_deltas_whose_text_is_the_detokenized_ids(make_harness):
    # "e" might start the stop string "ex": it is held back, then delivered at the end.
    harness = make_harness(stop=["ex"])
    events = await run_session(harness, tokens(0, 1, 2), PrefillProgressed(request_id="r", processed_tokens=3, total_tokens=9), tokens(3, 4), finished())
    assert PrefillProgress(request_id="r", processed_tokens=3, total_tokens=9) in events
    assert text_of(events) == "abcde"
    assert ids_of(events) == [0, 1, 2, 3, 4]
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "length" and events[-1].stop_sequence is None
    assert harness.sent() == []


async def test_a_stop_string_split_across_two_messages_is_cut_and_finishes_the_request_once(make_harness):
    harness = make_harness(stop=["cd"])
    # The third message spells the stop string again: it must not be finished twice.
    events = await run_session(harness, tokens(0, 1, 2), tokens(3, 4), tokens(2, 3), finished("stop"))
    assert harness.sent() == [FinishRequest(request_id="r")]
    assert text_of(events) == "ab"
    # The tokens after the stop string, in its message and later ones, are dropped.
    assert ids_of(events) == [0, 1, 2, 3]
    assert (events[-1].finish_reason, events[-1].stop_sequence, events[-1].usage.completion_tokens) == ("stop", "cd", 4)


async def test_finished_is_the_one_last_event_with_usage_and_timings_from_the_timeline(make_harness):
    t0 = time.monotonic() - 10.0
    timeline = RequestTimeline(submitted=t0, admitted=t0 + 1, prefill_started=t0 + 2, first_token=t0 + 4, last_token=t0 + 7)
    events = await run_session(make_harness(), tokens(0, 1, 2), finished("stop", timeline=timeline, stop_token_id=9, cached_tokens=4))
    assert [type(e) for e in events].count(Finished) == 1
    end = events[-1]
    assert isinstance(end, Finished) and end.finish_reason == "stop" and end.stop_sequence is None
    # The stop token is not in the text but counts as a completion token.
    assert end.usage == Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=4)
    timings = end.timings
    assert (timings.queue_s, timings.ttft_s) == (pytest.approx(1.0), pytest.approx(4.0))
    assert (timings.prefill_s, timings.decode_s) == (pytest.approx(2.0), pytest.approx(3.0))
    # Only the 10 - 4 uncached prompt tokens were prefilled, in 2 s.
    assert timings.prefill_tokens_per_s == pytest.approx(3.0)
    assert timings.decode_tokens_per_s == pytest.approx(1.0)
    assert timings.total_s >= 10.0


async def test_finished_passes_the_error_checkpoint_and_fill_through(make_harness):
    report = CheckpointReport(written=2, failed=1, error="disk full")
    fill = FillStats(mode="strict", events=1)
    events = await run_session(make_harness(), tokens(0), finished("error", error="grammar rejected", checkpoint=report, fill=fill))
    assert [type(e) for e in events] == [TokenDelta, Finished]
    assert (events[-1].finish_reason, events[-1].error, events[-1].checkpoint, events[-1].fill) == ("error", "grammar rejected", report, fill)


async def test_a_rejection_is_delivered_as_is_and_ends_the_session(make_harness):
    rejected = RequestRejected(request_id="r", code="busy", message="admission queue is full")
    harness = make_harness()
    assert await run_session(harness, rejected) == [rejected]
    assert harness.ended.is_set()


async def test_tool_calls_are_parsed_out_of_the_text(make_harness):
    pieces = {100: "<tool_call>", 101: '{"name": "f", "arguments": {"x": 1}}', 102: "</tool_call>"}
    parser = OutputParser(tool_markers=("<tool_call>", "</tool_call>"))
    events = await run_session(make_harness(pieces=pieces, parser=parser), tokens(0, 100, 101, 102), finished("stop"))
    assert events[0] == TokenDelta(request_id="r", token_ids=[0, 100, 101, 102], text="a")
    assert events[1] == ToolCall(request_id="r", index=0, id="call-r-0", name="f", arguments='{"x": 1}')
    assert isinstance(events[2], Finished) and len(events) == 3


async def test_a_reader_that_falls_behind_pauses_the_request_until_it_drains_below_half(make_harness):
    harness = make_harness(capacity=4)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(harness.run)
            await harness.feed(*(tokens(i) for i in range(5)))
            assert harness.sent() == [SetPaused(request_id="r", paused=True)]
            await harness.events.receive()
            await anyio.wait_all_tasks_blocked()
            assert harness.sent() == []  # 3 of 4 still queued: more than half
            await harness.events.receive()
            assert await harness.scheduler.receive() == SetPaused(request_id="r", paused=False)
            await harness.feed(finished())
            rest = await harness.read_all()
    assert text_of(rest) == "cde" and rest[-1].finish_reason == "length"
    assert harness.sent() == []


async def test_a_reader_that_reads_nothing_for_max_pause_s_gets_its_request_cancelled(make_harness):
    harness = make_harness(capacity=2, max_pause_s=0.2)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(harness.run)
            await harness.feed(*(tokens(i) for i in range(3)))
            assert await harness.scheduler.receive() == SetPaused(request_id="r", paused=True)
            assert await harness.scheduler.receive() == CancelRequest(request_id="r")
            await harness.feed(finished("cancelled"))
            events = await harness.read_all()
    assert text_of(events) == "abc"
    assert events[-1].finish_reason == "cancelled" and "max_pause_s" in events[-1].error
    assert harness.sent() == []  # never resumed


@pytest.mark.slow
async def test_a_slow_reader_that_keeps_reading_is_not_cancelled(make_harness):
    """Each event taken re-arms `max_pause_s`: draining 8 events takes ~4x the limit here, but no
    single wait between reads comes near it."""
    harness = make_harness(capacity=16, max_pause_s=1.0)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(harness.run)
            await harness.feed(*(tokens(i) for i in range(17)))
            assert await harness.scheduler.receive() == SetPaused(request_id="r", paused=True)
            for _ in range(9):
                await anyio.sleep(0.45)  # a slow reader: the wait between reads is the point
                await harness.events.receive()
            assert await harness.scheduler.receive() == SetPaused(request_id="r", paused=False)
            await harness.feed(finished())
            rest = await harness.read_all()
    assert rest[-1].finish_reason == "length" and rest[-1].error is None
    assert harness.sent() == []  # no CancelRequest


async def test_a_reader_that_leaves_cancels_the_request_and_the_session_waits_for_its_end(make_harness):
    harness = make_harness()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(harness.run)
            harness.events.close_reader()
            await harness.feed(tokens(0))
            assert harness.sent() == [CancelRequest(request_id="r")]
            # Tokens still in flight are no reason to end: the scheduler has not let go of the id.
            await harness.feed(tokens(1), PrefillProgressed(request_id="r", processed_tokens=1, total_tokens=2))
            assert not harness.ended.is_set()
            await harness.feed(finished("cancelled"))
            await harness.ended.wait()
    assert harness.sent() == []


async def test_abandon_ends_a_paused_session_and_the_reader_gets_what_was_queued_without_finished(make_harness):
    harness = make_harness(capacity=1)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(harness.run)
            await harness.feed(tokens(0), tokens(1))
            assert harness.sent() == [SetPaused(request_id="r", paused=True)]
            harness.session.abandon()
            await harness.ended.wait()
    assert await harness.read_all() == [TokenDelta(request_id="r", token_ids=[0], text="a")]


async def test_abandon_ends_a_session_waiting_for_the_end_of_a_request_its_reader_left(make_harness):
    harness = make_harness()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(harness.run)
            harness.events.close_reader()
            await harness.feed(tokens(0))
            assert harness.sent() == [CancelRequest(request_id="r")]
            harness.session.abandon()
            await harness.ended.wait()
    assert harness.sent() == []
