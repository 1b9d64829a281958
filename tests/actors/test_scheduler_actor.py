"""Tests for actors.scheduler: one SchedulerActor between a fake model (the test answers each
RunStep it plans) and a fake KV store (a task with scripted answers); no model, no MLX."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import anyio

from actors.mailbox import Mailbox, SessionMailbox, answer, ask
from actors.mlx_thread import Job
from actors.scheduler import SchedulerActor
from policies.scheduling import SchedulePolicy
from protocols.api import CheckpointReport, GenerateRequest, SamplingParams
from protocols.kv import KvReservation, PrefixesSaved, ReleaseKv, ReserveKv, SaveCheckpoint
from protocols.model import AdmitRequest, CheckpointData, PrefillReport, PrefillWork, RowOutput, RunStep, SavedPrefix, StepFailed, StepOutcome, StepPlan
from protocols.scheduler import AddRequest, CancelRequest, CheckpointWritten, GetSchedulerStats, SchedulerStats, SetPaused
from protocols.session import PrefillProgressed, RequestFinished, RequestRejected, TokensGenerated


class FakeKv:
    """Grants every reservation but those `refuse` gives a reason for; answers checkpoint
    writes with `checkpoint_error` (None: written); records everything it receives."""

    def __init__(self, refuse: dict[str, str] | None = None, checkpoint_error: str | None = None):
        self.inbox: Mailbox = Mailbox(64)
        self.received: list = []
        self._refuse = refuse or {}
        self._checkpoint_error = checkpoint_error

    async def run(self) -> None:
        while True:
            message = await self.inbox.receive()
            self.received.append(message)
            if isinstance(message, ReserveKv):
                reason = self._refuse.get(message.request_id)
                answer(message.reply, KvReservation(request_id=message.request_id, granted=reason is None, reason=reason))
            elif isinstance(message, SaveCheckpoint) and message.report is not None:
                error = self._checkpoint_error
                message.report.send_nowait(CheckpointWritten(request_id=message.data.request_id, ok=error is None, error=error))

    def of_type(self, kind: type) -> list:
        return [m for m in self.received if isinstance(m, kind)]


class FakeModel:
    """The model actor's inbox; the test plays the engine one step at a time."""

    def __init__(self) -> None:
        self.inbox: Mailbox[RunStep] = Mailbox(1)
        self.scheduler: SchedulerActor | None = None

    async def step(self, reply: StepOutcome | StepFailed, *, then: tuple = ()) -> StepPlan:
        """Take the next plan and answer it once every other task is idle (so what the KV store
        sent meanwhile is in the scheduler's inbox); `then` is queued for the scheduler before the
        answer, so it reads those messages right after applying this step."""
        run = await self.inbox.receive()
        await anyio.wait_all_tasks_blocked()
        if then:
            assert self.scheduler is not None
            submit(self.scheduler, *then)
        answer(run.reply, reply)
        return run.plan


def outcome(*rows: RowOutput, **fields) -> StepOutcome:
    return StepOutcome(
        outputs=list(rows),
        prefilled=fields.pop("prefilled", []),
        released=fields.pop("released", []),
        num_decode_rows=len(rows),
        kv_tokens={},
        kv_bytes=0,
        step_s=fields.pop("step_s", 0.0),
        **fields,
    )


def add(rid: str, session, *, prompt_len: int = 2, max_tokens: int = 8, **fields) -> AddRequest:
    prompt = list(range(1, prompt_len + 1))
    admit = AdmitRequest(request_id=rid, prompt_ids=prompt, max_tokens=max_tokens, sampling=SamplingParams(), seed=0, stop_token_ids=[0])
    return AddRequest(admit=admit, submitted=time.monotonic(), session=session, request=GenerateRequest(prompt_ids=prompt, request_id=rid), **fields)


def policy(**options) -> SchedulePolicy:
    return SchedulePolicy(**{"max_batch_size": 4, "max_queued": 8, "chunk_size": 4, "token_budget": 8, **options})


@asynccontextmanager
async def running(schedule: SchedulePolicy | None = None, *, thread: FakeThread | None = None, run_ahead_below_s: float = 0.0, **kv_options):
    """A scheduler between a fake KV store and a fake model; with `thread`, steps are queued on
    it (`start_step`) and only those that find it full go through the model's inbox."""
    kv, model = FakeKv(**kv_options), FakeModel()
    start_step = thread.start_step if thread is not None else None
    scheduler = SchedulerActor(schedule or policy(), model=model.inbox, kv=kv.inbox, capacity=32, start_step=start_step, run_ahead_below_s=run_ahead_below_s)
    model.scheduler = scheduler
    if thread is not None:
        thread.scheduler = scheduler
    with kv.inbox, model.inbox, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(kv.run)
            await tg.start(scheduler.run)
            yield scheduler, model, kv
            tg.cancel_scope.cancel()


def submit(scheduler: SchedulerActor, *messages) -> None:
    """Queue messages without yielding, so the scheduler sees them all before it plans."""
    for message in messages:
        scheduler.inbox.send_nowait(message)


async def received(session: SessionMailbox) -> list:
    return [await session.receive() for _ in range(len(session))]


async def stats_after_step(model: FakeModel, reply: StepOutcome) -> SchedulerStats:
    """Answer the next step and get the stats the scheduler gives right after applying it."""
    send, receive = anyio.create_memory_object_stream[SchedulerStats](1)
    with send, receive:
        await model.step(reply, then=(GetSchedulerStats(reply=send),))
        return await receive.receive()


async def test_a_request_is_reserved_admitted_prefilled_in_chunks_decoded_and_released():
    async with running() as (scheduler, model, kv):
        session = SessionMailbox()
        request = add("a", session, prompt_len=9, max_tokens=3, report_progress=True)
        submit(scheduler, request)
        report = PrefillReport(request_id="a", processed_tokens=4, total_tokens=8)
        assert await model.step(outcome(prefilled=[report])) == StepPlan(admit=[request.admit], prefill=[PrefillWork(request_id="a", num_tokens=4)])
        assert await model.step(outcome(RowOutput(request_id="a", token_ids=[7]))) == StepPlan(prefill=[PrefillWork(request_id="a", num_tokens=4)], decode=True)
        assert await model.step(outcome(RowOutput(request_id="a", token_ids=[8]))) == StepPlan(decode=True)
        assert await model.step(outcome(RowOutput(request_id="a", token_ids=[], finish_reason="stop", stop_token_id=0))) == StepPlan(decode=True)
        await anyio.wait_all_tasks_blocked()
        progress, tokens, end = await received(session)
    assert progress == PrefillProgressed(request_id="a", processed_tokens=4, total_tokens=8)
    assert tokens == TokensGenerated(request_id="a", token_ids=[7, 8])
    assert (end.finish_reason, end.stop_token_id, end.error, end.checkpoint) == ("stop", 0, None, None)
    t = end.timeline
    assert t.submitted <= t.admitted <= t.prefill_started <= t.first_token <= t.last_token
    reserve, release = kv.received
    assert (reserve.request_id, reserve.num_tokens, reserve.prompt_ids, reserve.max_prefix_tokens) == ("a", 12, request.admit.prompt_ids, 8)
    assert release == ReleaseKv(request_id="a", delete_checkpoint=False)


async def test_a_request_that_can_never_fit_is_rejected_as_too_large_and_the_queue_moves_on():
    async with running(refuse={"big": "never_fits"}) as (scheduler, model, kv):
        big, small = SessionMailbox(), SessionMailbox()
        submit(scheduler, add("big", big, prompt_len=100), add("small", small))
        plan = await model.step(outcome())
        [rejected] = await received(big)
    assert [a.request_id for a in plan.admit] == ["small"]
    assert (rejected.request_id, rejected.code, rejected.field) == ("big", "too_large", "max_tokens")
    assert kv.of_type(ReleaseKv) == []


async def test_a_request_beyond_a_full_admission_queue_is_rejected_as_busy():
    async with running(policy(max_queued=1), refuse={"a": "no_room"}) as (scheduler, _, _kv):
        a, b = SessionMailbox(), SessionMailbox()
        submit(scheduler, add("a", a), add("b", b))
        stats = await ask(scheduler.inbox, GetSchedulerStats)
        assert await received(b) == [RequestRejected(request_id="b", code="busy", message="admission queue is full")]
        assert await received(a) == []
    assert (stats.waiting, stats.steps) == (1, 0)


async def test_cancelling_a_waiting_request_ends_it_at_once():
    async with running(refuse={"a": "no_room"}) as (scheduler, _, kv):
        session = SessionMailbox()
        submit(scheduler, add("a", session), CancelRequest(request_id="a"))
        stats = await ask(scheduler.inbox, GetSchedulerStats)
        [end] = await received(session)
        await anyio.wait_all_tasks_blocked()
    assert isinstance(end, RequestFinished) and end.finish_reason == "cancelled"
    assert (stats.waiting, stats.steps) == (0, 0)
    assert kv.of_type(ReleaseKv) == [ReleaseKv(request_id="a", delete_checkpoint=False)]


async def test_cancelling_a_running_request_releases_it_in_the_next_plan():
    async with running() as (scheduler, model, kv):
        session = SessionMailbox()
        submit(scheduler, add("a", session))
        await model.step(outcome(RowOutput(request_id="a", token_ids=[5])))
        await model.step(outcome(RowOutput(request_id="a", token_ids=[6])), then=(CancelRequest(request_id="a"),))
        assert await model.step(outcome(released=["a"])) == StepPlan(release=["a"])
        await anyio.wait_all_tasks_blocked()
        tokens, end = await received(session)
    assert tokens == TokensGenerated(request_id="a", token_ids=[5, 6])
    assert end.finish_reason == "cancelled"
    assert kv.of_type(ReleaseKv) == [ReleaseKv(request_id="a", delete_checkpoint=False)]


async def test_a_failed_step_ends_every_admitted_request_in_error_and_the_queue_moves_on():
    async with running(policy(max_batch_size=2)) as (scheduler, model, kv):
        sessions = {rid: SessionMailbox() for rid in "abc"}
        submit(scheduler, *(add(rid, box) for rid, box in sessions.items()))
        failed = await model.step(StepFailed(error="gpu on fire"))
        retry = await model.step(outcome())
        ends = {rid: await received(box) for rid, box in sessions.items()}
    assert [a.request_id for a in failed.admit] == ["a", "b"]
    assert [a.request_id for a in retry.admit] == ["c"]
    for rid in "ab":
        [end] = ends[rid]
        assert (end.finish_reason, end.error) == ("error", "gpu on fire")
    assert ends["c"] == []
    assert sorted(r.request_id for r in kv.of_type(ReleaseKv)) == ["a", "b"]


async def test_a_row_that_fails_on_its_own_ends_only_its_request():
    async with running() as (scheduler, model, kv):
        a, b = SessionMailbox(), SessionMailbox()
        submit(scheduler, add("a", a), add("b", b))
        await model.step(outcome(RowOutput(request_id="a", token_ids=[3]), RowOutput(request_id="b", token_ids=[4])))
        await model.step(
            outcome(RowOutput(request_id="a", token_ids=[], finish_reason="error", error="grammar rejected"), RowOutput(request_id="b", token_ids=[5]))
        )
        assert await model.step(outcome()) == StepPlan(decode=True)
        a_tokens, a_end = await received(a)
        assert await received(b) == [TokensGenerated(request_id="b", token_ids=[4, 5])]
    assert a_tokens == TokensGenerated(request_id="a", token_ids=[3])
    assert (a_end.finish_reason, a_end.error) == ("error", "grammar rejected")
    assert [r.request_id for r in kv.of_type(ReleaseKv)] == ["a"]


async def test_a_failed_checkpoint_write_is_reported_when_the_request_finishes():
    async with running(checkpoint_error="disk full") as (scheduler, model, kv):
        session = SessionMailbox()
        request = add("a", session, checkpoint_every=2)
        submit(scheduler, request)
        await model.step(outcome(RowOutput(request_id="a", token_ids=[3])))
        await model.step(outcome(RowOutput(request_id="a", token_ids=[4])))
        data = CheckpointData(request_id="a", generated=[3, 4], num_kv_tokens=3, kv_tensors=b"")
        plan = await model.step(outcome(RowOutput(request_id="a", token_ids=[5]), checkpoints=[data]))
        # The store's answer goes to the scheduler's inbox; the step after next has read it.
        await model.step(outcome(RowOutput(request_id="a", token_ids=[6])))
        await model.step(outcome(RowOutput(request_id="a", token_ids=[], finish_reason="length")))
        await anyio.wait_all_tasks_blocked()
        *_, end = await received(session)
    assert plan.checkpoint == ["a"]
    [save] = kv.of_type(SaveCheckpoint)
    assert (save.data, save.request, save.report) == (data, request.request, scheduler.inbox)
    assert end.finish_reason == "length"
    assert end.checkpoint == CheckpointReport(written=0, failed=1, error="disk full")
    # A normal end deletes the checkpoint.
    assert kv.of_type(ReleaseKv) == [ReleaseKv(request_id="a", delete_checkpoint=True)]


async def test_a_paused_request_is_parked_until_its_caller_catches_up():
    async with running() as (scheduler, model, _kv):
        submit(scheduler, add("a", SessionMailbox()))
        await model.step(outcome(RowOutput(request_id="a", token_ids=[3])), then=(SetPaused(request_id="a", paused=True),))
        # Its token in flight is still decoded; after that nothing is planned for it.
        assert await model.step(outcome(RowOutput(request_id="a", token_ids=[4]))) == StepPlan(park=["a"], decode=True)
        stats = await ask(scheduler.inbox, GetSchedulerStats)
        assert (stats.paused, stats.steps) == (1, 2)
        submit(scheduler, SetPaused(request_id="a", paused=False))
        assert await model.step(outcome()) == StepPlan(unpark=["a"], decode=True)


async def test_stats_count_requests_by_phase_steps_and_finished_requests():
    async with running(policy(max_batch_size=2)) as (scheduler, model, _kv):
        submit(scheduler, add("a", SessionMailbox()), add("b", SessionMailbox(), prompt_len=13), add("c", SessionMailbox()))
        first = await stats_after_step(model, outcome(RowOutput(request_id="a", token_ids=[3])))
        second = await stats_after_step(model, outcome(RowOutput(request_id="a", token_ids=[], finish_reason="length")))
    assert first == SchedulerStats(waiting=1, prefilling=1, decoding=1, steps=1, num_finished=0, paused=0)
    assert second == SchedulerStats(waiting=1, prefilling=1, decoding=0, steps=2, num_finished=1, paused=0)


# -- running ahead: the next decode step queued before the last one's outcome is handled -----


class FakeThread:
    """The MLX thread's queue as `start_step` fills it: the test completes each job in order;
    `room` jobs may be queued at once (more are refused, as a full queue refuses them)."""

    def __init__(self, room: int = 8) -> None:
        self.queued: list[tuple[StepPlan, Job]] = []
        self.room = room
        self.scheduler: SchedulerActor | None = None

    def start_step(self, plan: StepPlan) -> Job | None:
        if len(self.queued) >= self.room:
            return None
        job: Job = Job()
        self.queued.append((plan, job))
        return job

    async def complete(self, reply: StepOutcome | StepFailed, *, then: tuple = ()) -> StepPlan:
        """Finish the oldest queued job once every task is idle; `then` goes to the scheduler's
        inbox first (as `FakeModel.step`)."""
        await anyio.wait_all_tasks_blocked()
        if then:
            assert self.scheduler is not None
            submit(self.scheduler, *then)
        plan, job = self.queued.pop(0)
        job._outcome.append(reply)
        job._done.set()
        return plan

    def plans(self) -> list[StepPlan]:
        return [plan for plan, _ in self.queued]


@asynccontextmanager
async def running_ahead(run_ahead_below_s: float = 0.02, room: int = 8, **kv_options):
    thread = FakeThread(room)
    async with running(thread=thread, run_ahead_below_s=run_ahead_below_s, **kv_options) as (scheduler, model, kv):
        yield scheduler, thread, kv, model


def tokens(rid: str, *ids: int, step_s: float = 0.001, **fields) -> StepOutcome:
    return outcome(RowOutput(request_id=rid, token_ids=list(ids)), step_s=step_s, **fields)


DECODE = StepPlan(decode=True)


async def test_steady_short_decode_steps_are_queued_two_deep_and_every_token_is_delivered_in_order():
    async with running_ahead() as (scheduler, thread, _kv, _model):
        session = SessionMailbox()
        submit(scheduler, add("a", session))
        first = await thread.complete(tokens("a", 5))
        await anyio.wait_all_tasks_blocked()
        # Only decode left: the step after the next is queued before the next's outcome is handled.
        assert thread.plans() == [DECODE, DECODE]
        await thread.complete(tokens("a", 6))
        await anyio.wait_all_tasks_blocked()
        assert thread.plans() == [DECODE, DECODE]
        await thread.complete(tokens("a", 7))
        await thread.complete(outcome(RowOutput(request_id="a", token_ids=[], finish_reason="stop", stop_token_id=0), step_s=0.001))
        # The step queued behind the last one is still run and handled: nothing is left queued after it.
        await thread.complete(outcome(step_s=0.001))
        await anyio.wait_all_tasks_blocked()
        assert thread.plans() == []
        stats = await ask(scheduler.inbox, GetSchedulerStats)
        got, end = await received(session)
    assert first.admit and first.decode
    assert got == TokensGenerated(request_id="a", token_ids=[5, 6, 7])
    assert (end.finish_reason, stats.steps, stats.decoding) == ("stop", 5, 0)


async def test_a_request_arriving_during_run_ahead_is_admitted_in_the_plan_after_the_queued_one():
    async with running_ahead() as (scheduler, thread, _kv, _model):
        submit(scheduler, add("a", SessionMailbox()))
        await thread.complete(tokens("a", 5))
        # "b" arrives while two decode steps are queued: the first of them runs as planned, and
        # nothing more is queued ahead until "b" is in.
        await thread.complete(tokens("a", 6), then=(add("b", SessionMailbox()),))
        await anyio.wait_all_tasks_blocked()
        assert thread.plans() == [DECODE]
        await thread.complete(tokens("a", 7))
        await anyio.wait_all_tasks_blocked()
        [admitting] = thread.plans()
    assert [a.request_id for a in admitting.admit] == ["b"] and admitting.decode


async def test_a_request_cancelled_during_run_ahead_gets_no_token_after_the_cancel_and_is_released_next():
    async with running_ahead() as (scheduler, thread, kv, _model):
        session = SessionMailbox()
        submit(scheduler, add("a", session))
        await thread.complete(tokens("a", 5))
        await thread.complete(tokens("a", 6), then=(CancelRequest(request_id="a"),))
        # The step queued before the cancel arrived still decodes the row; its token is dropped.
        await thread.complete(tokens("a", 7))
        await anyio.wait_all_tasks_blocked()
        assert thread.plans() == [StepPlan(release=["a"])]
        await thread.complete(outcome(released=["a"], step_s=0.001))
        await anyio.wait_all_tasks_blocked()
        got, end = await received(session)
    assert got == TokensGenerated(request_id="a", token_ids=[5, 6])
    assert end.finish_reason == "cancelled"
    assert kv.of_type(ReleaseKv) == [ReleaseKv(request_id="a", delete_checkpoint=False)]


async def test_the_outcome_of_a_step_queued_ahead_is_handled_even_when_every_request_has_ended():
    saved = SavedPrefix(entry_id="e1", tokens=[1, 2, 5], num_bytes=64)
    async with running_ahead() as (scheduler, thread, kv, _model):
        submit(scheduler, add("a", SessionMailbox()))
        await thread.complete(tokens("a", 5))
        await thread.complete(outcome(RowOutput(request_id="a", token_ids=[6], finish_reason="length"), step_s=0.001))
        # The engine kept the ended row's KV as a prefix entry; the queued step's outcome says so.
        await thread.complete(outcome(step_s=0.001, saved_prefixes=[saved]))
        await anyio.wait_all_tasks_blocked()
    assert kv.of_type(PrefixesSaved) == [PrefixesSaved(entries=[saved])]
    assert thread.plans() == []


async def test_no_step_is_queued_ahead_when_steps_are_long_or_run_ahead_is_off():
    for threshold, step_s in ((0.02, 0.5), (0.0, 0.001)):
        async with running_ahead(threshold) as (scheduler, thread, _kv, _model):
            submit(scheduler, add("a", SessionMailbox()))
            for token in (5, 6, 7):
                await thread.complete(tokens("a", token, step_s=step_s))
                await anyio.wait_all_tasks_blocked()
                assert thread.plans() == [DECODE]


async def test_a_step_queued_ahead_that_finds_the_thread_queue_full_goes_through_the_model_inbox():
    async with running_ahead(room=1) as (scheduler, thread, _kv, model):
        session = SessionMailbox()
        submit(scheduler, add("a", session))
        await thread.complete(tokens("a", 5))
        await thread.complete(tokens("a", 6))
        # The next plan was made ahead but the queue had no room: the model actor runs it.
        assert await model.step(tokens("a", 7)) == DECODE
        await anyio.wait_all_tasks_blocked()
        [got] = await received(session)
    assert got == TokensGenerated(request_id="a", token_ids=[5, 6, 7])
