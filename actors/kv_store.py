"""The KV cache store actor: the authority on KV memory and the prefix cache.

Receives `protocols.kv` messages. The arrays live on the MLX thread (the engine
allocates and frees them as plans say, and keeps saved prefixes under their
entry ids); this actor decides whether a request's prompt plus generation fits
the budget before it is admitted, finds the longest saved prefix it can start
from, indexes the prefixes the engine saves, and evicts least recently used
ones (telling the model actor to drop them) when the budget needs the room.
"""

from __future__ import annotations

from typing import assert_never

import structlog

from actors.prefix_index import PrefixIndex
from protocols.kv import (
    GetKvStats,
    KvInbox,
    KvReservation,
    KvStats,
    PrefixesSaved,
    ReleaseKv,
    ReportKvUsage,
    ReserveKv,
    UnpinPrefix,
)
from protocols.model import DropPrefixes, SavedPrefix
from runtime.mailbox import Mailbox, answer

log = structlog.get_logger(actor="kv_store")


class KvLedger:
    """Reservations and prefix entries against one byte budget (0 = unlimited)."""

    def __init__(self, *, bytes_per_token: int, budget_bytes: int = 0, prefix_cache_bytes: int = 0, prefix_min_tokens: int = 1):
        self.bytes_per_token = bytes_per_token
        self.budget_bytes = budget_bytes
        self.prefix_cache_bytes = prefix_cache_bytes
        self.prefix_min_tokens = prefix_min_tokens
        self.prefixes = PrefixIndex()
        self._reserved: dict[str, int] = {}
        self._live_tokens: dict[str, int] = {}
        self._physical_bytes = 0
        self._hits = 0
        self._tokens_reused = 0

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values()) * self.bytes_per_token

    def reserve(
        self, request_id: str, num_tokens: int, prompt_ids: list[int] = (), max_prefix_tokens: int = 0
    ) -> tuple[KvReservation, list[str]]:
        """A reservation, and the prefix entries evicted to make room for it."""
        need = num_tokens * self.bytes_per_token
        if self.budget_bytes and need > self.budget_bytes:
            return KvReservation(request_id=request_id, granted=False, reason="never_fits"), []
        evicted = self._make_room(need)
        if self.budget_bytes and self.reserved_bytes + self.prefixes.num_bytes + need > self.budget_bytes:
            return KvReservation(request_id=request_id, granted=False, reason="no_room"), evicted
        self._reserved[request_id] = num_tokens
        match = self.prefixes.lookup(prompt_ids, max_prefix_tokens) if max_prefix_tokens > 0 else None
        if match is None:
            return KvReservation(request_id=request_id, granted=True), evicted
        self.prefixes.pin(match.entry_id)
        self._hits += 1
        self._tokens_reused += match.num_tokens
        return KvReservation(request_id=request_id, granted=True, prefix_entry=match.entry_id, prefix_tokens=match.num_tokens), evicted

    def release(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)
        self._live_tokens.pop(request_id, None)

    def unpin(self, entry_id: str) -> None:
        self.prefixes.unpin(entry_id)

    def save_prefixes(self, entries: list[SavedPrefix]) -> list[str]:
        """Index what is worth keeping; returns the entry ids the engine should drop."""
        dropped = []
        for entry in entries:
            keep = self.prefix_cache_bytes > 0 and len(entry.tokens) >= self.prefix_min_tokens
            if not (keep and self.prefixes.insert(entry.entry_id, entry.tokens, entry.num_bytes)):
                dropped.append(entry.entry_id)
        over_cap = self.prefixes.num_bytes - self.prefix_cache_bytes
        if over_cap > 0:
            dropped += self.prefixes.evict(over_cap)
        return dropped + self._make_room(0)

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
            prefix_entries=len(self.prefixes),
            prefix_bytes=self.prefixes.num_bytes,
            prefix_hits=self._hits,
            prefix_tokens_reused=self._tokens_reused,
        )

    def _make_room(self, need: int) -> list[str]:
        if not self.budget_bytes:
            return []
        over = self.reserved_bytes + self.prefixes.num_bytes + need - self.budget_bytes
        return self.prefixes.evict(over) if over > 0 else []


class KvStoreActor:
    def __init__(self, ledger: KvLedger, *, model: Mailbox | None = None, capacity: int = 256):
        self.ledger = ledger
        self.inbox: Mailbox[KvInbox] = Mailbox(capacity)
        self._model = model

    async def run(self, *, task_status) -> None:
        with self.inbox:
            task_status.started()
            while True:
                await self.handle(await self.inbox.receive())

    async def handle(self, message: KvInbox) -> None:
        match message:
            case ReserveKv(request_id=rid, num_tokens=n, reply=reply, prompt_ids=prompt, max_prefix_tokens=max_prefix):
                reservation, evicted = self.ledger.reserve(rid, n, prompt, max_prefix)
                answer(reply, reservation)
                await self._drop(evicted)
            case ReleaseKv(request_id=rid):
                self.ledger.release(rid)
            case UnpinPrefix(entry_id=entry_id):
                self.ledger.unpin(entry_id)
            case PrefixesSaved(entries=entries):
                await self._drop(self.ledger.save_prefixes(entries))
            case ReportKvUsage(live_tokens=live, physical_bytes=physical):
                self.ledger.record_usage(live, physical)
            case GetKvStats(reply=reply):
                answer(reply, self.ledger.stats())
            case _:
                assert_never(message)

    async def _drop(self, entry_ids: list[str]) -> None:
        if entry_ids and self._model is not None:
            log.debug("prefixes_dropped", count=len(entry_ids))
            await self._model.send(DropPrefixes(entry_ids=entry_ids))
