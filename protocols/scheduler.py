"""Inbox of the scheduler actor: requests arrive, are cancelled or finished early."""

from __future__ import annotations

import msgspec

from protocols.api import GenerateRequest, SpecTotals
from protocols.base import Message, Record, Reply
from protocols.model import AdmitRequest
from protocols.session import SessionInbox


class AddRequest(Message, frozen=True):
    """A validated, tokenized request and where its session listens."""

    admit: AdmitRequest
    submitted: float
    session: Reply[SessionInbox]
    # The request as submitted: checkpoints record it so a resume can rebuild it.
    request: GenerateRequest
    priority: int = 0
    report_progress: bool = False
    # Background work (`GenerateRequest.bulk`, or scoring): see `SchedulePolicy`.
    bulk: bool = False
    # Tokens between checkpoints; 0 = none.
    checkpoint_every: int = 0


class CancelRequest(Message, frozen=True):
    """Stop the request at the next step boundary; it ends `cancelled`."""

    request_id: str
    # Keep its checkpoint for a later resume (a shutdown, not the client, ended it).
    keep_checkpoint: bool = False


class SetPaused(Message, frozen=True):
    """The request's caller is (or is no longer) behind: stop (or restart) decoding it."""

    request_id: str
    paused: bool


class FinishRequest(Message, frozen=True):
    """The session saw a stop string: end the request as `stop`."""

    request_id: str


class CheckpointWritten(Message, frozen=True):
    """The KV store's answer to a `SaveCheckpoint`: written, or failed and why."""

    request_id: str
    ok: bool
    error: str | None = None


class PrefixLoaded(Message, frozen=True):
    """A disk read for this request's prefix ended (found or not): ask for its room again."""

    request_id: str


class SchedulerStats(Record, frozen=True):
    waiting: int
    prefilling: int
    decoding: int
    steps: int
    num_finished: int
    # Admitted requests whose callers are not reading (decoding stopped, KV kept).
    paused: int = 0
    # Bulk requests out of the batch (KV kept) while interactive ones are live (`scheduler.bulk_share`).
    held: int = 0
    # Speculative decoding of the requests that speculated and ended.
    spec: SpecTotals = msgspec.field(default_factory=SpecTotals)


class GetSchedulerStats(Message, frozen=True):
    reply: Reply[SchedulerStats]


SchedulerInbox = AddRequest | CancelRequest | FinishRequest | SetPaused | CheckpointWritten | PrefixLoaded | GetSchedulerStats
