"""Inbox of a request's session actor: what the scheduler reports about it."""

from __future__ import annotations

import msgspec

from protocols.api import CheckpointReport, FillStats, FinishReason, SpecStats, TokenLogprob
from protocols.base import Message, Record
from protocols.errors import ErrorCode


class TraceSpan(Record, frozen=True):
    """One timed piece of a request's work, between two monotonic timestamps (seconds):
    "prefill_chunk" (attributes: tokens, offset), "fast_forward" (injected, accepted,
    rejected) or "checkpoint_write" (ok)."""

    name: str
    start: float
    end: float
    attributes: dict[str, int | float | str | bool] = msgspec.field(default_factory=dict)


class RequestTimeline(Record, frozen=True):
    """Monotonic timestamps (seconds) the scheduler took for one request, and its spans."""

    submitted: float
    admitted: float | None = None
    prefill_started: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    spans: list[TraceSpan] = msgspec.field(default_factory=list)
    # Spans not kept beyond the per-request cap.
    spans_dropped: int = 0


class TokensGenerated(Message, frozen=True):
    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class PrefillProgressed(Message, frozen=True):
    request_id: str
    processed_tokens: int
    total_tokens: int
    # The prompt tokens scored since the last report (`GenerateRequest.prompt_logprobs`).
    prompt_logprobs: list[TokenLogprob] | None = None


class DenoiseProgressed(Message, frozen=True):
    request_id: str
    canvas: int
    step: int
    revealed: int
    positions: int


class RequestFinished(Message, frozen=True):
    """The scheduler is done with the request; no message follows this one."""

    request_id: str
    finish_reason: FinishReason
    timeline: RequestTimeline
    stop_token_id: int | None = None
    cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None
    fill: FillStats | None = None
    checkpoint: CheckpointReport | None = None
    spec: SpecStats | None = None
    denoising_steps: int | None = None


class RequestRejected(Message, frozen=True):
    """The request was never admitted (queue full, can never fit)."""

    request_id: str
    code: ErrorCode
    message: str
    field: str | None = None


SessionInbox = TokensGenerated | PrefillProgressed | DenoiseProgressed | RequestFinished | RequestRejected
