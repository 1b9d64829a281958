"""The scheduler's view of one request (`Tracked`): its phase, progress, pause and bulk state,
and its trace; and how a request ended (`Ended`). Pure data with the bookkeeping `SchedulePolicy`
does on it."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocols.api import CheckpointReport, FillStats
from protocols.model import AdmitRequest, DiskPrefix
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
    bulk: bool = False
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
    # Parked to keep bulk work within its batch slots (not for its caller): rejoins when room is.
    held: bool = False
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
        return (self.paused or self.held) and self.parked and self.parked_steps >= 1 and self.phase is not Phase.RELEASING

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
