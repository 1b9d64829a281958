"""The scheduler's decisions, as a synchronous policy with no anyio or mlx.

Requests move WAITING -> PREFILLING -> DECODING and leave when the engine
reports a finish or a release the policy asked for. Each step gets one token
budget shared by decode rows (one token each) and prefill chunks, so a long
prompt delays running streams by at most one chunk. Prefill chunks go to the
request with the least prompt left (short prompts get their first token fast),
except that a request skipped `max_skips` times in a row goes first. An image
prompt's vision tower runs first, a unit per step costed as a chunk (the engine
sizes each unit to about a chunk's compute), so it too delays others by one chunk.
A request's chunk boundaries depend only on its own prompt, never on what
else is running, so its tokens do not depend on the load.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from policies.adapters import AdapterSlots
from protocols.api import CheckpointReport, FillStats
from protocols.model import AdmitRequest, DiskPrefix, PrefillWork, StepOutcome, StepPlan
from protocols.session import RequestTimeline, TraceSpan

# Spans kept per request for tracing (prefill chunks, fast-forwards, checkpoint writes);
# later ones are counted as dropped.
MAX_SPANS = 256


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    # A diffusion model's request whose prompt is prefilled: a denoising step a plan.
    DENOISING = "denoising"
    RELEASING = "releasing"


@dataclass
class Tracked:
    """The scheduler's view of one request."""

    admit: AdmitRequest
    submitted: float
    session: Any
    priority: int = 0
    report_progress: bool = False
    phase: Phase = Phase.WAITING
    num_prefilled: int = 0
    num_skips: int = 0
    release_reason: str | None = None
    cached_tokens: int = 0
    # The engine's latest fast-forwarding figures for it (reported in Finished).
    fill: Any = None
    spec: Any = None
    timeline: dict[str, float] = field(default_factory=dict)
    # The request as submitted (for checkpoints), and its checkpoint cadence.
    request: Any = None
    checkpoint_every: int = 0
    keep_checkpoint: bool = False
    num_generated: int = 0
    next_checkpoint: int = 0
    # The caller is not reading: decoding stops (KV kept) until it catches up. A parked
    # row holds no batch slot; once its caller reads again it rejoins when a slot is free.
    paused: bool = False
    parked: bool = False
    # Whether a plan has carried its admission to the engine.
    planned: bool = False
    # Steps completed since it was parked: after one, no token of it is in flight.
    parked_steps: int = 0
    # Checkpoint writes the KV store confirmed or reported failed.
    checkpoints_written: int = 0
    checkpoints_failed: int = 0
    checkpoint_error: str | None = None
    # Traced pieces of its work, the prefill chunk in flight (start, tokens, offset), and the
    # start times of checkpoint writes not yet confirmed.
    spans: list[TraceSpan] = field(default_factory=list)
    spans_dropped: int = 0
    open_chunk: tuple[float, int, int] | None = None
    # An image prompt whose vision tower has units left (they come before its chunks), and
    # the start of the unit in flight.
    encoding: bool = False
    open_encode: float | None = None
    # A denoising request's denoising steps planned so far.
    num_denoise_steps: int = 0
    checkpoint_writes: deque[float] = field(default_factory=deque)

    @property
    def is_idle(self) -> bool:
        """Parked with nothing left in flight: no step can do anything for it."""
        return self.paused and self.parked and self.parked_steps >= 1 and self.phase is not Phase.RELEASING

    def __post_init__(self) -> None:
        resume = self.admit.resume
        if resume is not None:
            self.num_generated = len(resume.generated)
            self.num_prefilled = resume.num_kv_tokens
            # What the prompt did not need prefilling for (the seeds' min: generated tokens' KV
            # came with the checkpoint but they are not prompt tokens).
            self.cached_tokens = min(resume.num_kv_tokens, len(self.admit.prompt_ids))
        if self.checkpoint_every:
            self.next_checkpoint = (self.num_generated // self.checkpoint_every + 1) * self.checkpoint_every

    @property
    def request_id(self) -> str:
        return self.admit.request_id

    @property
    def generating(self) -> Phase:
        """The phase after its prompt: decoding, or denoising (a diffusion model's request)."""
        return Phase.DENOISING if self.admit.denoise is not None else Phase.DECODING

    @property
    def prefill_left(self) -> int:
        # (Decoding feeds the last token; a denoising request's canvas attends to all of them.)
        return len(self.admit.context_ids) - (self.admit.denoise is None) - self.num_prefilled

    @property
    def kv_tokens_needed(self) -> int:
        return len(self.admit.prompt_ids) + self.admit.max_tokens

    def start_from_prefix(self, entry_id: str, num_tokens: int) -> None:
        """Seed the request with `num_tokens` of a saved prefix: they need no prefill."""
        self.admit = msgspec.structs.replace(self.admit, prefix_entry=entry_id, prefix_tokens=num_tokens)
        self.num_prefilled = self.cached_tokens = num_tokens

    def start_from_disk(self, prefix: DiskPrefix) -> None:
        """Seed the request with KV read from the disk tier: those tokens need no prefill."""
        self.admit = msgspec.structs.replace(self.admit, disk_prefix=prefix)
        self.num_prefilled = self.cached_tokens = prefix.num_tokens
        self.add_span("disk_read", prefix.started, prefix.ended, tokens=prefix.num_tokens, files=prefix.num_files, bytes=prefix.num_bytes)

    def record_checkpoint(self, ok: bool, error: str | None, now: float | None = None) -> None:
        if ok:
            self.checkpoints_written += 1
        else:
            self.checkpoints_failed += 1
            self.checkpoint_error = error
        if self.checkpoint_writes and now is not None:
            self.add_span("checkpoint_write", self.checkpoint_writes.popleft(), now, ok=ok)

    def add_span(self, name: str, start: float, end: float, **attributes: int | float | str | bool) -> None:
        if len(self.spans) >= MAX_SPANS:
            self.spans_dropped += 1
        else:
            self.spans.append(TraceSpan(name=name, start=start, end=end, attributes=attributes))

    def close_chunk(self, now: float) -> None:
        """The step that forwarded its prefill chunk has ended."""
        if self.open_chunk is not None:
            start, tokens, offset = self.open_chunk
            self.open_chunk = None
            self.add_span("prefill_chunk", start, now, tokens=tokens, offset=offset)
        if self.open_encode is not None:
            self.add_span("vision_encode", self.open_encode, now)
            self.open_encode = None

    def record_fill(self, fill: FillStats, start: float, now: float) -> None:
        """The engine's latest fast-forwarding figures; a step that forwarded or verified a span
        (`start`..`now`) is traced with what it injected and what verification kept."""
        before = self.fill if isinstance(self.fill, FillStats) else FillStats(mode=fill.mode)
        if fill.events > before.events or fill.verify_events > before.verify_events:
            self.add_span(
                "fast_forward",
                start,
                now,
                injected=fill.injected - before.injected,
                accepted=fill.verify_accepted - before.verify_accepted,
                rejected=fill.verify_rejected - before.verify_rejected,
            )
        self.fill = fill

    def checkpoint_report(self) -> CheckpointReport | None:
        if not (self.checkpoint_every or self.checkpoints_written or self.checkpoints_failed):
            return None
        return CheckpointReport(written=self.checkpoints_written, failed=self.checkpoints_failed, error=self.checkpoint_error)

    def stamp(self, name: str, now: float) -> None:
        self.timeline.setdefault(name, now)

    def make_timeline(self) -> RequestTimeline:
        return RequestTimeline(submitted=self.submitted, spans=list(self.spans), spans_dropped=self.spans_dropped, **self.timeline)


@dataclass(frozen=True)
class Ended:
    """A request the policy is done with, and how it ended."""

    tracked: Tracked
    reason: str
    stop_token_id: int | None = None
    # Why it failed, when the engine ended it with an error.
    error: str | None = None
    error_code: str | None = None


class SchedulePolicy:
    """Admission, batching and prefill/decode interleaving for one engine."""

    def __init__(
        self, *, max_batch_size: int, max_queued: int, chunk_size: int, token_budget: int, max_skips: int = 4, adapter_slots: AdapterSlots | None = None
    ):
        self.max_batch_size = max_batch_size
        # Distinct LoRA adapters live requests may hold at once (`lora.max_resident`).
        self.adapter_slots = adapter_slots or AdapterSlots(8)
        self.max_queued = max_queued
        self.chunk_size = chunk_size
        self.token_budget = token_budget
        self.max_skips = max_skips
        self._waiting: deque[Tracked] = deque()
        self._active: dict[str, Tracked] = {}
        self._to_admit: list[Tracked] = []
        self._forgotten: list[str] = []
        self.num_steps = 0
        self.num_finished = 0

    # -- queue ---------------------------------------------------------------

    def can_enqueue(self) -> bool:
        return len(self._waiting) < self.max_queued

    def enqueue(self, tracked: Tracked) -> None:
        if not self.can_enqueue():
            raise OverflowError("admission queue full")
        # Stable by priority: a higher priority goes before lower ones, FIFO within.
        index = len(self._waiting)
        while index > 0 and self._waiting[index - 1].priority < tracked.priority:
            index -= 1
        self._waiting.insert(index, tracked)

    def admission_candidate(self) -> Tracked | None:
        """The next waiting request, if the batch has room for it (parked rows that want to
        rejoin come first)."""
        rejoining = sum(t.parked and not t.paused for t in self._active.values())
        if not self._waiting or self._num_slots_used() + rejoining >= self.max_batch_size:
            return None
        head = self._waiting[0]
        live = [t.admit.adapter for t in (*self._active.values(), *self._to_admit)]
        return head if self.adapter_slots.allows(head.admit.adapter, live) else None

    def _num_slots_used(self) -> int:
        """Batch slots: every admitted request but the parked ones (they keep only their KV)."""
        return sum(not t.parked for t in self._active.values()) + len(self._to_admit)

    def admit(self, tracked: Tracked, now: float) -> None:
        assert self._waiting and self._waiting[0] is tracked
        self._waiting.popleft()
        tracked.stamp("admitted", now)
        self._to_admit.append(tracked)

    def reject_waiting(self, tracked: Tracked) -> None:
        self._waiting.remove(tracked)

    # -- early ends ----------------------------------------------------------

    def end_early(self, request_id: str, reason: str, *, keep_checkpoint: bool = False) -> Ended | None:
        """Cancel (or stop) a request. Waiting ones end now; admitted ones after a release step."""
        for queue in (self._waiting, self._to_admit):
            for tracked in queue:
                if tracked.request_id == request_id:
                    queue.remove(tracked)
                    tracked.keep_checkpoint = keep_checkpoint
                    self.num_finished += 1
                    return Ended(tracked, reason)
        active = self._active.get(request_id)
        if active is not None and active.release_reason is None:
            active.keep_checkpoint = keep_checkpoint
            active.release_reason = reason
            active.phase = Phase.RELEASING
        return None

    # -- stepping ------------------------------------------------------------

    def is_tracked(self, request_id: str) -> bool:
        """Waiting, about to be admitted, or running (possibly still releasing)."""
        return request_id in self._active or any(t.request_id == request_id for t in [*self._waiting, *self._to_admit])

    def set_paused(self, request_id: str, paused: bool) -> None:
        for tracked in [*self._waiting, *self._to_admit, *self._active.values()]:
            if tracked.request_id == request_id:
                tracked.paused = paused

    def has_work(self) -> bool:
        return bool(self._to_admit) or any(not t.is_idle for t in self._active.values())

    def plan(self, now: float) -> StepPlan:
        """The next step. Call only when `has_work()`."""
        release = [t.request_id for t in self._active.values() if t.phase is Phase.RELEASING]
        admit = []
        for tracked in self._to_admit:
            tracked.planned = True
            tracked.phase = Phase.PREFILLING if tracked.prefill_left > 0 else tracked.generating
            vision = tracked.admit.vision
            tracked.encoding = vision is not None and vision.needs_tower(tracked.admit.prompt_ids, tracked.num_prefilled)
            self._active[tracked.request_id] = tracked
            admit.append(tracked.admit)
        self._to_admit.clear()
        park, unpark = self._plan_parking()
        decoding = [t for t in self._active.values() if t.phase is Phase.DECODING]
        denoise = self._plan_denoise(self.token_budget - len(decoding))
        budget = self.token_budget - len(decoding) - sum(self._canvas_cost(self._active[rid]) for rid in denoise)
        prefill = self._plan_prefill(budget, now)
        # A parked row may still have a token in flight: decode runs until it is read.
        decode = any(t.phase is Phase.DECODING and not t.is_idle for t in self._active.values())
        self.num_steps += 1
        checkpoint = self._plan_checkpoints()
        forget, self._forgotten = self._forgotten, []
        return StepPlan(
            release=release,
            admit=admit,
            prefill=prefill,
            decode=decode,
            checkpoint=checkpoint,
            park=park,
            unpark=unpark,
            forget_checkpoints=forget,
            denoise=denoise,
        )

    def plans_ahead(self, plan: StepPlan) -> bool:
        """Whether the plan after `plan` can be made before `plan`'s outcome is applied: `plan`
        only decodes, and nothing but that outcome can change the next one (no request waits
        for admission or a batch slot, none is prefilling, paused, parked, releasing or taking
        checkpoints). The next plan is then a decode step; rows the outcome ends are the
        engine's to drop, and anything that arrives meanwhile goes in the plan after it."""
        if not plan.decode or plan.admit or plan.prefill or plan.release or plan.park or plan.unpark or plan.checkpoint or plan.denoise:
            return False
        if plan.forget_checkpoints or self._to_admit or self._forgotten or self.admission_candidate() is not None:
            return False
        active = self._active.values()
        return bool(active) and all(t.phase is Phase.DECODING and not (t.paused or t.parked or t.checkpoint_every) for t in active)

    def forget_checkpoint(self, request_id: str) -> None:
        """The request's checkpoint is deleted: the next plan says so (to follower ranks)."""
        self._forgotten.append(request_id)

    def _plan_parking(self) -> tuple[list[str], list[str]]:
        """Rows whose callers fell behind leave the batch; caught-up ones rejoin while there is room."""
        park = []
        for tracked in self._active.values():
            if tracked.paused and not tracked.parked and tracked.phase is not Phase.RELEASING:
                tracked.parked, tracked.parked_steps = True, 0
                park.append(tracked.request_id)
        unpark, slots = [], self._num_slots_used()
        for tracked in self._active.values():
            if slots >= self.max_batch_size:
                break
            if tracked.parked and not tracked.paused:
                tracked.parked, tracked.parked_steps = False, 0
                unpark.append(tracked.request_id)
                slots += 1
        return park, unpark

    def _plan_checkpoints(self) -> list[str]:
        due = []
        for tracked in self._active.values():
            # A parked row is out of the batch: its checkpoint waits until it decodes again.
            if tracked.phase is Phase.DECODING and not tracked.parked and tracked.checkpoint_every and tracked.num_generated >= tracked.next_checkpoint:
                due.append(tracked.request_id)
                while tracked.next_checkpoint <= tracked.num_generated:
                    tracked.next_checkpoint += tracked.checkpoint_every
        return due

    def _plan_prefill(self, budget: int, now: float) -> list[PrefillWork]:
        prefilling = [t for t in self._active.values() if t.phase is Phase.PREFILLING]
        # Requests skipped max_skips times go first, the longest-starved first.
        prefilling.sort(key=self._prefill_order)
        work: list[PrefillWork] = []
        for tracked in prefilling:
            if tracked.encoding:  # a unit of its vision tower, costed as a chunk
                if self.chunk_size > budget and work:
                    tracked.num_skips += 1
                    continue
                budget -= self.chunk_size
                tracked.num_skips = 0
                tracked.open_encode = now
                tracked.stamp("prefill_started", now)
                work.append(PrefillWork(request_id=tracked.request_id, num_tokens=self.chunk_size, encode=True))
                continue
            chunk = min(self.chunk_size, tracked.prefill_left)
            snapshot = tracked.admit.snapshot_at
            if snapshot is not None and tracked.num_prefilled < snapshot < tracked.num_prefilled + chunk:
                chunk = snapshot - tracked.num_prefilled  # the snapshot is taken at a chunk's end
            if chunk > budget and work:
                tracked.num_skips += 1
                continue
            budget -= chunk
            tracked.num_skips = 0
            tracked.open_chunk = (now, chunk, tracked.num_prefilled)
            tracked.num_prefilled += chunk
            tracked.stamp("prefill_started", now)
            work.append(PrefillWork(request_id=tracked.request_id, num_tokens=chunk))
            if tracked.prefill_left == 0:
                tracked.phase = tracked.generating
        return work

    def _plan_denoise(self, budget: int) -> list[str]:
        """Denoising requests (not parked) that take a denoising step this plan, each costed as
        its canvas's positions (a forward over them), the first always; the longest-waiting
        first, so that none starves while others step."""
        denoising = sorted((t for t in self._active.values() if t.phase is Phase.DENOISING and not t.parked), key=lambda t: -t.num_skips)
        chosen: list[str] = []
        for tracked in denoising:
            cost = self._canvas_cost(tracked)
            if cost > budget and chosen:
                tracked.num_skips += 1
                continue
            budget -= cost
            tracked.num_skips = 0
            tracked.num_denoise_steps += 1
            chosen.append(tracked.request_id)
        return chosen

    def _canvas_cost(self, tracked: Tracked) -> int:
        options = tracked.admit.denoise
        return (options.canvas_length or self.chunk_size) if options is not None else 0

    def _prefill_order(self, tracked: Tracked) -> tuple:
        aged = tracked.num_skips >= self.max_skips
        return (not aged, -tracked.num_skips if aged else 0, -tracked.priority, tracked.prefill_left)

    def apply(self, outcome: StepOutcome, now: float) -> list[Ended]:
        """Record what a step did; returns the requests that ended in it."""
        ended = []
        for tracked in self._active.values():
            tracked.parked_steps += tracked.parked
            tracked.close_chunk(now)
        for report in outcome.prefilled:
            if (encoded := self._active.get(report.request_id)) is not None:
                encoded.encoding = report.encoding
        for rid in outcome.released:
            tracked = self._active.pop(rid)
            ended.append(Ended(tracked, tracked.release_reason or "cancelled"))
        for row in outcome.outputs:
            running = self._active.get(row.request_id)
            if running is None:
                continue
            tracked = running
            tracked.num_generated += len(row.token_ids) + (row.stop_token_id is not None)
            if row.token_ids or row.finish_reason:
                tracked.stamp("first_token", now)
                tracked.timeline["last_token"] = now
            if row.finish_reason is not None:
                del self._active[row.request_id]
                code = row.error_code or ("internal" if row.error else None)
                ended.append(Ended(tracked, tracked.release_reason or row.finish_reason, row.stop_token_id, row.error, code))
        self.num_finished += len(ended)
        return ended

    def get(self, request_id: str) -> Tracked | None:
        return self._active.get(request_id)

    def counts(self) -> dict[str, int]:
        phases = [t.phase for t in self._active.values()]
        return {
            "waiting": len(self._waiting) + len(self._to_admit),
            "prefilling": phases.count(Phase.PREFILLING),
            "decoding": phases.count(Phase.DECODING) + phases.count(Phase.DENOISING) + phases.count(Phase.RELEASING),
            "paused": sum(t.parked for t in self._active.values()),
        }

    def fail_all(self, error: str, code: str = "internal") -> list[Ended]:
        """The engine dropped everything: every admitted request ends in error."""
        # Requests already ending keep their reason and have no error (a cancel stays a cancel,
        # and deletes its checkpoint as a cancel does).
        ended = [
            Ended(t, t.release_reason or "error", error=None if t.release_reason else error, error_code=None if t.release_reason else code)
            for t in self._active.values()
        ]
        self._active.clear()
        self.num_finished += len(ended)
        return ended
