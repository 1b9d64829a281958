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
from typing import Protocol, assert_never

import anyio
import anyio.to_thread
import structlog

from actors.mailbox import Mailbox, answer
from policies.ledger import KvLedger
from protocols.base import Reply
from protocols.kv import (
    DrainFiles,
    GetKvStats,
    KvInbox,
    KvStats,
    PrefixesSaved,
    ReleaseKv,
    ReportKvUsage,
    ReserveKv,
    SaveCheckpoint,
    UnpinPrefix,
)
from protocols.model import DropPrefixes
from protocols.scheduler import CheckpointWritten

log = structlog.get_logger(actor="kv_store")

CHECKPOINT_QUEUE = 64
EXPIRE_EVERY_S = 3600.0


class CheckpointFiles(Protocol):
    """Where checkpoints live (`runtime.checkpoints.CheckpointStore`); blocking calls."""

    def write(self, request, prompt_ids: list[int], seed: int, max_tokens: int, stop_token_ids: list[int], data) -> None: ...

    def delete(self, request_id: str) -> None: ...

    def expire(self, max_age_s: float) -> list[str]: ...


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
        self,
        ledger: KvLedger,
        *,
        model: Mailbox | None = None,
        checkpoints: CheckpointFiles | None = None,
        max_age_s: float = 86400.0,
        capacity: int = 256,
    ):
        self.ledger = ledger
        self.inbox: Mailbox[KvInbox] = Mailbox(capacity)
        self._model = model
        # None: checkpoints are unavailable (the directory is unusable).
        self._checkpoints = checkpoints
        self._max_age_s = max_age_s
        # File work runs in order on one writer task. A write names a request; the latest
        # pending checkpoint of that request is what gets written (older ones are dropped).
        self._pending: dict[str, SaveCheckpoint] = {}
        self._jobs_send, self._jobs_receive = anyio.create_memory_object_stream[_FileJob](CHECKPOINT_QUEUE)
        self._num_written = 0
        self._num_failed = 0
        # The figures as of the last message handled, read without a message (`/metrics`).
        self.latest = self._stats()

    async def run(self, *, task_status) -> None:
        with self.inbox, self._jobs_send:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._file_writer)
                task_status.started()
                while True:
                    await self.handle(await self.inbox.receive())
                    self.latest = self._stats()

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
                    self.latest = self._stats()

    async def _run_job(self, job: _FileJob) -> None:
        if isinstance(job, _Sync):
            answer(job.reply, True)
            return
        files = self._checkpoints
        assert files is not None  # writes and deletes are queued only when checkpoints are available
        match job:
            case _Write(request_id=rid):
                message = self._pending.pop(rid, None)
                if message is not None:
                    await self._write(files, message)
            case _Delete(request_id=rid):
                try:
                    await anyio.to_thread.run_sync(files.delete, rid)
                except OSError as exc:
                    log.error("checkpoint_delete_failed", request_id=rid, error=str(exc))
            case _:
                assert_never(job)

    async def _write(self, files: CheckpointFiles, message: SaveCheckpoint) -> None:
        rid = message.data.request_id
        m = message
        try:
            await anyio.to_thread.run_sync(files.write, m.request, m.prompt_ids, m.seed, m.max_tokens, m.stop_token_ids, m.data)
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
            removed = await anyio.to_thread.run_sync(self._checkpoints.expire, self._max_age_s)
        except OSError as exc:
            log.error("checkpoint_expiry_failed", error=str(exc))
            return
        if removed:
            log.info("checkpoints_expired", count=len(removed))

    async def handle(self, message: KvInbox) -> None:
        match message:
            case ReserveKv(request_id=rid, num_tokens=n, reply=reply, prompt_ids=prompt, max_prefix_tokens=max_prefix, namespace=namespace):
                reservation, evicted = self.ledger.reserve(rid, n, prompt, max_prefix, namespace)
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
            case ReportKvUsage(live_tokens=live, physical_bytes=physical, adapter_bytes=adapters, device=device, quantized_bytes=quantized):
                dropped = self.ledger.record_usage(live, physical, adapters, device, quantized, pool=message.pool, peak_bytes=message.peak_physical_bytes)
                await self._drop(dropped)
            case GetKvStats(reply=reply):
                answer(reply, self._stats())
            case _:
                assert_never(message)

    def _stats(self) -> KvStats:
        figures = {"checkpoints_written": self._num_written, "checkpoints_failed": self._num_failed}
        return self.ledger.stats(checkpoints_available=self._checkpoints is not None, **figures)

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
