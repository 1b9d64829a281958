"""The KV cache store actor: the authority on who may hold how much KV.

Receives `protocols.kv` messages. The arrays live on the MLX thread (the engine
allocates and frees them as plans say); this actor decides whether a request's
prompt plus generation fits the budget before it is admitted, and keeps the
accounting the engine reports after each step. The prefix cache and
checkpoints extend it.
"""

from __future__ import annotations

from typing import assert_never

import structlog

from protocols.kv import GetKvStats, KvInbox, KvReservation, KvStats, ReleaseKv, ReportKvUsage, ReserveKv
from runtime.mailbox import Mailbox, answer

log = structlog.get_logger(actor="kv_store")


class KvLedger:
    """Reservations against a byte budget (0 = unlimited) and reported usage."""

    def __init__(self, *, bytes_per_token: int, budget_bytes: int = 0):
        self.bytes_per_token = bytes_per_token
        self.budget_bytes = budget_bytes
        self._reserved: dict[str, int] = {}
        self._live_tokens: dict[str, int] = {}
        self._physical_bytes = 0

    def reserve(self, request_id: str, num_tokens: int) -> KvReservation:
        need = num_tokens * self.bytes_per_token
        if self.budget_bytes and need > self.budget_bytes:
            return KvReservation(request_id=request_id, granted=False, reason="never_fits")
        reserved = sum(self._reserved.values()) * self.bytes_per_token
        if self.budget_bytes and reserved + need > self.budget_bytes:
            return KvReservation(request_id=request_id, granted=False, reason="no_room")
        self._reserved[request_id] = num_tokens
        return KvReservation(request_id=request_id, granted=True)

    def release(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)
        self._live_tokens.pop(request_id, None)

    def record_usage(self, live_tokens: dict[str, int], physical_bytes: int) -> None:
        self._live_tokens = dict(live_tokens)
        self._physical_bytes = physical_bytes

    def stats(self) -> KvStats:
        live = sum(self._live_tokens.values())
        return KvStats(
            live_requests=len(self._live_tokens),
            live_tokens=live,
            live_bytes=live * self.bytes_per_token,
            reserved_tokens=sum(self._reserved.values()),
            physical_bytes=self._physical_bytes,
            bytes_per_token=self.bytes_per_token,
            budget_bytes=self.budget_bytes or None,
        )


class KvStoreActor:
    def __init__(self, ledger: KvLedger, *, capacity: int = 256):
        self.ledger = ledger
        self.inbox: Mailbox[KvInbox] = Mailbox(capacity)

    async def run(self, *, task_status) -> None:
        with self.inbox:
            task_status.started()
            while True:
                self.handle(await self.inbox.receive())

    def handle(self, message: KvInbox) -> None:
        match message:
            case ReserveKv(request_id=rid, num_tokens=n, reply=reply):
                answer(reply, self.ledger.reserve(rid, n))
            case ReleaseKv(request_id=rid):
                self.ledger.release(rid)
            case ReportKvUsage(live_tokens=live, physical_bytes=physical):
                self.ledger.record_usage(live, physical)
            case GetKvStats(reply=reply):
                answer(reply, self.ledger.stats())
            case _:
                assert_never(message)
