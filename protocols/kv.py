"""Inbox of the KV cache store actor: reservations, usage reports, statistics.

The store decides whether a request's KV fits and keeps the byte accounting;
the arrays themselves live on the MLX thread, addressed by request id.
"""

from __future__ import annotations

from protocols.base import Message, Record, Reply


class KvReservation(Record):
    request_id: str
    granted: bool
    # Why not, when not granted: "never_fits" or "no_room".
    reason: str | None = None


class KvStats(Record):
    live_requests: int
    live_tokens: int
    live_bytes: int
    reserved_tokens: int
    physical_bytes: int
    bytes_per_token: int
    budget_bytes: int | None


class ReserveKv(Message):
    """Reserve room for a request's prompt plus its whole generation."""

    request_id: str
    num_tokens: int
    reply: Reply[KvReservation]


class ReleaseKv(Message):
    """The request's caches are gone; forget its reservation and usage."""

    request_id: str


class ReportKvUsage(Message):
    """The engine's latest figures: KV tokens per live request, bytes overall."""

    live_tokens: dict[str, int]
    physical_bytes: int


class GetKvStats(Message):
    reply: Reply[KvStats]


KvInbox = ReserveKv | ReleaseKv | ReportKvUsage | GetKvStats
