"""Inbox of a request's session actor: what the scheduler reports about it."""

from __future__ import annotations

from protocols.api import CheckpointReport, FillStats, FinishReason, SpecStats, TokenLogprob
from protocols.base import Message, Record
from protocols.errors import ErrorCode


class RequestTimeline(Record, frozen=True):
    """Monotonic timestamps (seconds) the scheduler took for one request."""

    submitted: float
    admitted: float | None = None
    prefill_started: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class TokensGenerated(Message, frozen=True):
    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class PrefillProgressed(Message, frozen=True):
    request_id: str
    processed_tokens: int
    total_tokens: int


class RequestFinished(Message, frozen=True):
    """The scheduler is done with the request; no message follows this one."""

    request_id: str
    finish_reason: FinishReason
    timeline: RequestTimeline
    stop_token_id: int | None = None
    cached_tokens: int = 0
    error: str | None = None
    fill: FillStats | None = None
    checkpoint: CheckpointReport | None = None
    spec: SpecStats | None = None


class RequestRejected(Message, frozen=True):
    """The request was never admitted (queue full, can never fit)."""

    request_id: str
    code: ErrorCode
    message: str
    field: str | None = None


SessionInbox = TokensGenerated | PrefillProgressed | RequestFinished | RequestRejected
