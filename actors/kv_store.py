"""The KV cache store actor: the authority on KV memory, the prefix cache and checkpoints.

Receives `protocols.kv` messages. The arrays live on the MLX thread (the engine
allocates and frees them as plans say, and keeps saved prefixes under their
entry ids); this actor decides whether a request's prompt plus generation fits
the budget before it is admitted, finds the longest saved prefix it can start
from, indexes the prefixes the engine saves, and evicts least recently used
ones (telling the model actor to drop them) when the budget needs the room.
Checkpoints the engine captured are written atomically, in order, by one
writer task off the event loop, deleted when their request ends for good, and
expired when old.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

import anyio
import anyio.to_thread
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
    DrainFiles,
    ReserveKv,
    SaveCheckpoint,
    UnpinPrefix,
)
from protocols.base import Reply
from protocols.model import DropPrefixes, SavedPrefix
from protocols.scheduler import CheckpointWritten
from runtime import checkpoints
from runtime.mailbox import Mailbox, answer

log = structlog.get_logger(actor="kv_store")

CHECKPOINT_QUEUE = 64
EXPIRE_EVERY_S = 3600.0


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
        """A reservation, and the prefix entries evicted to make room for it.

        The request's own prefix match is pinned before anything is evicted, and
        entries are evicted only when that makes the request fit.
        """
        need = num_tokens * self.bytes_per_token
        if self.budget_bytes and need > self.budget_bytes:
            return KvReservation(request_id=request_id, granted=False, reason="never_fits"), []
        match = self.prefixes.lookup(prompt_ids, max_prefix_tokens) if max_prefix_tokens > 0 else None
        if match is not None:
            self.prefixes.pin(match.entry_id)
        evicted = []
        if self.budget_bytes:
            over = self.reserved_bytes + self.prefixes.num_bytes + need - self.budget_bytes
            if over > 0 and self.reserved_bytes + need <= self.budget_bytes:
                evicted = self.prefixes.evict(over)
            if self.reserved_bytes + self.prefixes.num_bytes + need > self.budget_bytes:
                if match is not None:
                    self.prefixes.unpin(match.entry_id)
                return KvReservation(request_id=request_id, granted=False, reason="no_room"), evicted
        self._reserved[request_id] = num_tokens
        if match is None:
            return KvReservation(request_id=request_id, granted=True), evicted
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

    def stats(self, **checkpoint_figures) -> KvStats:
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
            **checkpoint_figures,
        )

    def _make_room(self, need: int) -> list[str]:
        if not self.budget_bytes:
            return []
        over = self.reserved_bytes + self.prefixes.num_bytes + need - self.budget_bytes
        return self.prefixes.evict(over) if over > 0 else []


@dataclass(frozen=True)
class CheckpointSettings:
    directory: Path
    model_id: str
    tokenizer_id: str
    max_age_s: float


@dataclass(frozen=True)
class _Write:
    request_id: str


@dataclass(frozen=True)
class _Delete:
    request_id: str


@dataclass(frozen=True)
class _Sync:
    reply: Reply[bool]


_FileJob = _Write | _Delete | _Sync


class KvStoreActor:
    def __init__(
        self, ledger: KvLedger, *, model: Mailbox | None = None, checkpoints: CheckpointSettings | None = None, capacity: int = 256
    ):
        self.ledger = ledger
        self.inbox: Mailbox[KvInbox] = Mailbox(capacity)
        self._model = model
        self._checkpoints = checkpoints
        # File work runs in order on one writer task. A write names a request; the latest
        # pending checkpoint of that request is what gets written (older ones are dropped).
        self._pending: dict[str, SaveCheckpoint] = {}
        self._jobs_send, self._jobs_receive = anyio.create_memory_object_stream[_FileJob](CHECKPOINT_QUEUE)
        self._num_written = 0
        self._num_failed = 0

    async def run(self, *, task_status) -> None:
        with self.inbox, self._jobs_send:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._file_writer)
                task_status.started()
                while True:
                    await self.handle(await self.inbox.receive())

    async def _file_writer(self) -> None:
        last_expiry = -EXPIRE_EVERY_S
        async with self._jobs_receive:
            while True:
                if time.monotonic() - last_expiry >= EXPIRE_EVERY_S:
                    last_expiry = time.monotonic()
                    await self._expire()
                with anyio.move_on_after(EXPIRE_EVERY_S):
                    try:
                        job = await self._jobs_receive.receive()
                    except anyio.EndOfStream:
                        return
                    await self._run_job(job)

    async def _run_job(self, job: _FileJob) -> None:
        settings = self._checkpoints
        match job:
            case _Write(request_id=rid):
                message = self._pending.pop(rid, None)
                if message is not None:
                    await self._write(settings, message)
            case _Delete(request_id=rid):
                try:
                    await anyio.to_thread.run_sync(checkpoints.delete, settings.directory, rid)
                except OSError as exc:
                    log.error("checkpoint_delete_failed", request_id=rid, error=str(exc))
            case _Sync(reply=reply):
                answer(reply, True)
            case _:
                assert_never(job)

    async def _write(self, settings: CheckpointSettings, message: SaveCheckpoint) -> None:
        rid = message.data.request_id
        try:
            await anyio.to_thread.run_sync(_write_checkpoint, settings, message, time.time())
        except Exception as exc:  # a full or read-only disk: that request's checkpoint, nobody else's
            self._num_failed += 1
            error = f"{type(exc).__name__}: {exc.strerror}" if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            log.error("checkpoint_write_failed", request_id=rid, error=error)
            if message.report is not None:
                answer(message.report, CheckpointWritten(request_id=rid, ok=False, error=error))
            return
        self._num_written += 1
        if message.report is not None:
            answer(message.report, CheckpointWritten(request_id=rid, ok=True))

    async def _expire(self) -> None:
        if self._checkpoints is None:
            return
        try:
            removed = await anyio.to_thread.run_sync(checkpoints.expire, self._checkpoints.directory, self._checkpoints.max_age_s)
        except OSError as exc:
            log.error("checkpoint_expiry_failed", error=str(exc))
            return
        if removed:
            log.info("checkpoints_expired", count=len(removed))

    async def handle(self, message: KvInbox) -> None:
        match message:
            case ReserveKv(request_id=rid, num_tokens=n, reply=reply, prompt_ids=prompt, max_prefix_tokens=max_prefix):
                reservation, evicted = self.ledger.reserve(rid, n, prompt, max_prefix)
                answer(reply, reservation)
                await self._drop(evicted)
            case ReleaseKv(request_id=rid, delete_checkpoint=delete):
                self.ledger.release(rid)
                if delete and self._checkpoints is not None:
                    self._pending.pop(rid, None)
                    await self._jobs_send.send(_Delete(rid))
            case SaveCheckpoint():
                await self._save_checkpoint(message)
            case DrainFiles(reply=reply):
                await self._jobs_send.send(_Sync(reply))
            case UnpinPrefix(entry_id=entry_id):
                self.ledger.unpin(entry_id)
            case PrefixesSaved(entries=entries):
                await self._drop(self.ledger.save_prefixes(entries))
            case ReportKvUsage(live_tokens=live, physical_bytes=physical):
                self.ledger.record_usage(live, physical)
            case GetKvStats(reply=reply):
                figures = {"checkpoints_written": self._num_written, "checkpoints_failed": self._num_failed}
                answer(reply, self.ledger.stats(checkpoints_available=self._checkpoints is not None, **figures))
            case _:
                assert_never(message)

    async def _save_checkpoint(self, message: SaveCheckpoint) -> None:
        rid = message.data.request_id
        if self._checkpoints is None:
            if message.report is not None:
                answer(message.report, CheckpointWritten(request_id=rid, ok=False, error="checkpoints are unavailable"))
            return
        queued = rid in self._pending
        self._pending[rid] = message
        if not queued:
            await self._jobs_send.send(_Write(rid))

    async def _drop(self, entry_ids: list[str]) -> None:
        if entry_ids and self._model is not None:
            log.debug("prefixes_dropped", count=len(entry_ids))
            await self._model.send(DropPrefixes(entry_ids=entry_ids))


def _write_checkpoint(settings: CheckpointSettings, message: SaveCheckpoint, created_at: float) -> None:
    data = message.data
    header = checkpoints.CheckpointHeader(
        model_id=settings.model_id,
        tokenizer_id=settings.tokenizer_id,
        request=message.request,
        prompt_ids=message.prompt_ids,
        seed=message.seed,
        max_tokens=message.max_tokens,
        stop_token_ids=message.stop_token_ids,
        generated=data.generated,
        num_kv_tokens=data.num_kv_tokens,
        created_at=created_at,
    )
    checkpoints.write_atomic(settings.directory, data.request_id, checkpoints.encode(header, data.kv_tensors))
