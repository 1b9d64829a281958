"""The scheduler actor: admission, continuous batching, cancellation.

Receives `protocols.scheduler` messages; asks the KV store for room before
admitting; hands the model one step plan at a time, and handles its outcome before
planning the next; reports tokens, progress and endings to each request's session
(never blocking on one: session inboxes coalesce). Decisions are `SchedulePolicy`'s;
this class moves messages.

The exception: while only decode rows run and steps are short
(`scheduler.run_ahead_below_s`), the next decode step is queued on the MLX thread before
the last one's outcome is handled, so two are queued at once and the device does not
wait on this task between them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, assert_never

import anyio
import msgspec
import structlog

from actors.mailbox import Mailbox, answer, ask
from policies.adapters import prefix_namespace
from policies.scheduling import SchedulePolicy
from policies.tracked import Ended, Tracked
from protocols.api import SpecTotals
from protocols.kv import PrefixesSaved, ReleaseKv, ReportKvUsage, ReserveKv, SaveCheckpoint, UnpinPrefix
from protocols.model import RunStep, StepFailed, StepOutcome, StepPlan
from protocols.scheduler import (
    AddRequest,
    CancelRequest,
    CheckpointWritten,
    FinishRequest,
    GetSchedulerStats,
    PrefixLoaded,
    SchedulerInbox,
    SchedulerStats,
    SetPaused,
)
from protocols.session import DenoiseProgressed, PrefillProgressed, RequestFinished, RequestRejected, TokensGenerated

if TYPE_CHECKING:
    from actors.mlx_thread import Job

log = structlog.get_logger(actor="scheduler")

REPORT_EVERY_STEPS = 32


# Queues a step on the MLX thread from the scheduler's own task (`ModelActor.start_step`), or
# None: then it goes to the model's inbox.
StartStep = Callable[[StepPlan], "Job[StepOutcome | StepFailed] | None"]


class SchedulerActor:
    def __init__(
        self,
        policy: SchedulePolicy,
        *,
        model: Mailbox,
        kv: Mailbox,
        capacity: int,
        start_step: StartStep | None = None,
        run_ahead_below_s: float = 0.0,
    ):
        self.policy = policy
        self.inbox: Mailbox[SchedulerInbox] = Mailbox(capacity)
        self._model = model
        self._start_step = start_step
        self._kv = kv
        self._reported_keys: set[str] = set()
        self._steps_since_report = 0
        self._spec_totals = SpecTotals()
        self._run_ahead_below_s = run_ahead_below_s
        # The last step's time on the MLX thread, and the step queued ahead (its start, plan
        # and job: None where it goes through the model's inbox).
        self._last_step_s = math.inf
        self._ahead: tuple[float, StepPlan, Job[StepOutcome | StepFailed] | None] | None = None
        # The figures as of the last loop turn, read without a message (`/metrics` must not wait
        # behind a step): at most one step old.
        self.latest = self._stats()

    async def run(self, *, task_status) -> None:
        with self.inbox:
            task_status.started()
            while True:
                await self._drain_inbox()
                await self._admit()
                self.latest = self._stats()
                if self._ahead is not None or self.policy.has_work():
                    await self._step()
                else:
                    await self.handle(await self.inbox.receive())

    def _stats(self) -> SchedulerStats:
        counts = self.policy.counts()
        return SchedulerStats(steps=self.policy.num_steps, num_finished=self.policy.num_finished, spec=self._spec_totals, **counts)

    async def _drain_inbox(self) -> None:
        while True:
            try:
                message = self.inbox.receive_nowait()
            except anyio.WouldBlock:
                return
            await self.handle(message)

    async def handle(self, message: SchedulerInbox) -> None:
        match message:
            case AddRequest():
                self._enqueue(message)
            case CancelRequest(request_id=rid, keep_checkpoint=keep):
                await self._end_early(rid, "cancelled", keep_checkpoint=keep)
            case FinishRequest(request_id=rid):
                await self._end_early(rid, "stop")
            case SetPaused(request_id=rid, paused=paused):
                self.policy.set_paused(rid, paused)
            case CheckpointWritten(request_id=rid, ok=ok, error=error):
                tracked = self.policy.get(rid)
                if tracked is not None:
                    tracked.record_checkpoint(ok, error, time.monotonic())
            case PrefixLoaded():
                pass  # the loop asks for the request's room again
            case GetSchedulerStats(reply=reply):
                answer(reply, self._stats())
            case _:
                assert_never(message)

    def _enqueue(self, message: AddRequest) -> None:
        rid = message.admit.request_id
        # Ids are unique among live requests: the runtime claims them (`runtime.streams`).
        assert not self.policy.is_tracked(rid), f"request {rid!r} submitted twice"
        if not self.policy.can_enqueue():
            message.session.send_nowait(RequestRejected(request_id=rid, code="busy", message="admission queue is full"))
            return
        tracked = Tracked(
            admit=message.admit,
            submitted=message.submitted,
            session=message.session,
            priority=message.priority,
            report_progress=message.report_progress,
            bulk=message.bulk,
            request=message.request,
            checkpoint_every=message.checkpoint_every,
        )
        self.policy.enqueue(tracked)

    async def _end_early(self, request_id: str, reason: str, *, keep_checkpoint: bool = False) -> None:
        ended = self.policy.end_early(request_id, reason, keep_checkpoint=keep_checkpoint)
        if ended is not None:
            await self._finish(ended)

    async def _admit(self) -> None:
        while (tracked := self.policy.admission_candidate()) is not None:
            rid, need, prompt = tracked.request_id, tracked.kv_tokens_needed, tracked.admit.cache_ids
            # A resumed request brings its own cache; others may start from a saved prefix.
            # A request scoring its prompt forwards every position of it; a denoising request
            # (a diffusion model's encoder cache) keeps no prefix entries.
            admit = tracked.admit
            max_prefix = 0 if admit.resume is not None or admit.prompt_logprobs is not None or admit.denoise is not None else len(prompt) - 1
            namespace = prefix_namespace(tracked.admit.adapter, tracked.admit.adapter_digest)
            reservation = await ask(
                self._kv, ReserveKv, request_id=rid, num_tokens=need, prompt_ids=prompt, max_prefix_tokens=max_prefix, namespace=namespace, notify=self.inbox
            )
            if reservation.granted:
                if reservation.prefix_entry is not None:
                    tracked.start_from_prefix(reservation.prefix_entry, reservation.prefix_tokens)
                elif reservation.disk_prefix is not None:
                    tracked.start_from_disk(reservation.disk_prefix)
                self.policy.admit(tracked, time.monotonic())
                if tracked.admit.resume is not None:
                    # A resumed stream first re-delivers what was generated before its checkpoint.
                    tracked.session.send_nowait(TokensGenerated(request_id=rid, token_ids=tracked.admit.resume.generated))
            elif reservation.reason == "never_fits":
                self.policy.reject_waiting(tracked)
                message = f"prompt + max_tokens ({need} tokens) can never fit the KV budget"
                tracked.session.send_nowait(RequestRejected(request_id=rid, code="too_large", message=message, field="max_tokens"))
            else:  # no room yet, or its prefix is being read from disk (`PrefixLoaded` follows)
                return

    async def _step(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            started, plan, job = ahead
        else:
            started = time.monotonic()
            plan = self.policy.plan(started)
            # From here to the step's start no other task runs: the sessions take the last step's
            # tokens while this one computes.
            job = self._start_step(plan) if self._start_step is not None else None
        if job is not None:
            self._run_ahead(plan)
        result = await job.result() if job is not None else await ask(self._model, RunStep, plan=plan)
        # The plan has run: the prefixes its admissions started from may be evicted now.
        for admit in plan.admit:
            if admit.prefix_entry is not None:
                await self._kv.post(UnpinPrefix(entry_id=admit.prefix_entry))
            tracked = self.policy.get(admit.request_id)
            if admit.disk_prefix is not None and tracked is not None:
                tracked.admit = msgspec.structs.replace(tracked.admit, disk_prefix=None)  # the engine holds that KV now
        match result:
            case StepOutcome():
                self._last_step_s = result.step_s
                await self._deliver(result, started)
            case StepFailed(error=error, code=code):
                log.error("step_failed", error=error, code=code)
                for ended in self.policy.fail_all(error, code):
                    await self._finish(ended)

    def _run_ahead(self, plan: StepPlan) -> None:
        """Queue the decode step that follows `plan`'s (queued, not yet handled) where the
        policy can plan it already (`SchedulePolicy.plans_ahead`), nothing waits in the inbox
        and steps are short (`scheduler.run_ahead_below_s`): the MLX thread then goes from one
        step to the next without waiting on this task's round trip."""
        if self._last_step_s >= self._run_ahead_below_s or len(self.inbox) or not self.policy.plans_ahead(plan):
            return
        assert self._start_step is not None
        started = time.monotonic()
        following = self.policy.plan(started)
        self._ahead = (started, following, self._start_step(following))

    async def _deliver(self, outcome: StepOutcome, started: float) -> None:
        now = time.monotonic()
        for report in outcome.prefilled:
            tracked = self.policy.get(report.request_id)
            if tracked is not None and (tracked.report_progress or report.prompt_logprobs):
                progress = PrefillProgressed(
                    request_id=report.request_id,
                    processed_tokens=report.processed_tokens,
                    total_tokens=report.total_tokens,
                    prompt_logprobs=report.prompt_logprobs,
                )
                tracked.session.send_nowait(progress)
        for step in outcome.denoised:
            tracked = self.policy.get(step.request_id)
            if tracked is not None and tracked.report_progress and tracked.release_reason is None:
                tracked.session.send_nowait(
                    DenoiseProgressed(request_id=step.request_id, canvas=step.canvas, step=step.step, revealed=step.revealed, positions=step.positions)
                )
        for row in outcome.outputs:
            tracked = self.policy.get(row.request_id)
            if row.fill is not None and tracked is not None:
                tracked.record_fill(row.fill, started, now)
            if row.spec is not None and tracked is not None:
                tracked.spec = row.spec
            if row.token_ids and tracked is not None and tracked.release_reason is None:
                tracked.session.send_nowait(TokensGenerated(request_id=row.request_id, token_ids=row.token_ids, logprobs=row.logprobs))
        for data in outcome.checkpoints:
            await self._save_checkpoint(data)
        for ended in self.policy.apply(outcome, now):
            await self._finish(ended)
        if outcome.saved_prefixes:
            await self._kv.post(PrefixesSaved(entries=outcome.saved_prefixes))
        await self._report_usage(outcome)

    async def _report_usage(self, outcome: StepOutcome) -> None:
        # Every step would wake the KV store for figures only stats read; report when the
        # set of live requests changes, and now and then.
        keys = outcome.kv_tokens.keys()
        self._steps_since_report += 1
        if keys != self._reported_keys or self._steps_since_report >= REPORT_EVERY_STEPS:
            self._reported_keys, self._steps_since_report = set(keys), 0
            await self._kv.post(
                ReportKvUsage(
                    live_tokens=outcome.kv_tokens,
                    physical_bytes=outcome.kv_bytes,
                    adapter_bytes=outcome.adapter_bytes,
                    device=outcome.device,
                    quantized_bytes=outcome.kv_quantized_bytes,
                    pool=outcome.kv_pool,
                    peak_physical_bytes=outcome.kv_peak_bytes,
                )
            )

    async def _save_checkpoint(self, data) -> None:
        tracked = self.policy.get(data.request_id)
        if tracked is None or tracked.request is None:
            return
        admit = tracked.admit
        tracked.checkpoint_writes.append(time.monotonic())
        await self._kv.post(
            SaveCheckpoint(
                request=tracked.request,
                prompt_ids=admit.prompt_ids,
                seed=admit.seed,
                max_tokens=admit.max_tokens,
                stop_token_ids=admit.stop_token_ids,
                data=data,
                vision=admit.vision,
                report=self.inbox,
            )
        )

    async def _finish(self, ended: Ended) -> None:
        tracked = ended.tracked
        self._notify_end(ended)
        if not tracked.planned and tracked.admit.prefix_entry is not None:
            await self._kv.post(UnpinPrefix(entry_id=tracked.admit.prefix_entry))
        # A checkpoint survives shutdowns and failed steps (that is what it is for), not a normal end.
        has_checkpoint = tracked.checkpoint_every or tracked.admit.resume is not None
        delete = bool(has_checkpoint) and not tracked.keep_checkpoint and ended.error is None
        if delete:
            self.policy.forget_checkpoint(tracked.request_id)
        await self._kv.post(ReleaseKv(request_id=tracked.request_id, delete_checkpoint=delete))

    def _notify_end(self, ended: Ended) -> None:
        tracked = ended.tracked
        if tracked.spec is not None:
            self._spec_totals = self._spec_totals.add(tracked.spec)
        tracked.session.send_nowait(
            RequestFinished(
                request_id=tracked.request_id,
                finish_reason="error" if ended.error and tracked.release_reason is None else ended.reason,  # type: ignore[arg-type]
                timeline=tracked.make_timeline(),
                stop_token_id=ended.stop_token_id,
                cached_tokens=tracked.cached_tokens,
                error=ended.error,
                error_code=ended.error_code,
                fill=tracked.fill,
                spec=tracked.spec,
                checkpoint=tracked.checkpoint_report(),
                denoising_steps=tracked.num_denoise_steps if tracked.admit.denoise is not None else None,
            )
        )
