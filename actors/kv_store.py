"""The KV cache store actor: the authority on KV memory, the prefix cache and checkpoints.

Receives `protocols.kv` messages. The arrays live on the MLX thread (the engine
allocates and frees them as plans say, and keeps saved prefixes under their
entry ids); this actor decides whether a request's prompt plus generation fits
the budget before it is admitted, finds the longest saved prefix it can start
from, indexes the prefixes the engine saves, and evicts least recently used
ones (telling the model actor to drop them) when the budget needs the room.
Checkpoints the engine captured are written atomically, in order, by one
writer task off the event loop, deleted when their request ends for good, and
expired when old. With `kv.disk_cache_dir` it also runs the prefix cache's disk
tier (`actors.disk_tier`): saved prefixes are written through to it, and a
reservation whose prompt the disk holds more of than RAM is answered "loading"
while the files are read, then granted with the KV read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, assert_never

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import structlog

from actors.disk_tier import DiskTier
from actors.mailbox import Mailbox, answer
from policies.ledger import KvLedger
from protocols.base import Reply
from protocols.kv import (
    DrainFiles,
    GetKvStats,
    KvInbox,
    KvReservation,
    KvStats,
    PrefixesSaved,
    ReleaseKv,
    ReportKvUsage,
    ReserveKv,
    SaveCheckpoint,
    UnpinPrefix,
)
from protocols.model import DiskPrefix, DropPrefixes
from protocols.scheduler import CheckpointWritten, PrefixLoaded

log = structlog.get_logger(actor="kv_store")

CHECKPOINT_QUEUE = 64
EXPIRE_EVERY_S = 3600.0
# Disk reads in flight at once (each holds its files' bytes until its request is admitted).
MAX_DISK_LOADS = 2


class CheckpointFiles(Protocol):
    """Where checkpoints live (`runtime.checkpoints.CheckpointStore`); blocking calls."""

    def write(self, request, prompt_ids: list[int], seed: int, max_tokens: int, stop_token_ids: list[int], data, vision=None) -> None: ...

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
        disk: DiskTier | None = None,
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
        # The disk tier: reads in flight (a token per request, so a read outliving its request
        # is not handed to another of the same id), and reads done, waiting for the request's
        # next reservation (None: nothing usable was read).
        self._disk = disk
        self._loading: dict[str, object] = {}
        self._loaded: dict[str, DiskPrefix | None] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        # The figures as of the last message handled, read without a message (`/metrics`).
        self.latest = self._stats()

    async def run(self, *, task_status) -> None:
        try:
            await self._run(task_status)
        finally:
            if self._disk is not None:
                self._disk.close()

    async def _run(self, task_status) -> None:
        with self.inbox, self._jobs_send:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._file_writer)
                if self._disk is not None:
                    tg.start_soon(self._disk.run_writer)
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
            if self._disk is not None:
                await self._disk.drained()
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
            await anyio.to_thread.run_sync(files.write, m.request, m.prompt_ids, m.seed, m.max_tokens, m.stop_token_ids, m.data, m.vision)
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
            case ReserveKv():
                await self._reserve(message)
            case ReleaseKv(request_id=rid, delete_checkpoint=delete):
                self.ledger.release(rid)
                self._loading.pop(rid, None)
                self._loaded.pop(rid, None)
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
                if self._disk is not None and self._model is not None:
                    # Copied out before anything below can drop them.
                    for entry in entries:
                        export = self._disk.plan_export(entry)
                        if export is not None:
                            await self._model.send(export)
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
        disk = self._disk.stats() if self._disk is not None else None
        return self.ledger.stats(checkpoints_available=self._checkpoints is not None, disk=disk, **figures)

    async def _reserve(self, message: ReserveKv) -> None:
        """A reservation; with the disk tier, first a read of a longer prefix than RAM holds
        (answered "loading" until it ends), then a grant with the KV read."""
        rid, prompt, max_prefix, namespace = message.request_id, message.prompt_ids, message.max_prefix_tokens, message.namespace
        disk = self._disk
        if rid in self._loading:
            answer(message.reply, KvReservation(request_id=rid, granted=False, reason="loading"))
            return
        # A request asked again (no room last time) is not looked up again: its read, or
        # None for a lookup that found nothing worth reading, is kept in `_loaded`.
        tried = rid in self._loaded
        loaded = self._loaded.pop(rid, None)
        ram_tokens = self.ledger.match_length(prompt, max_prefix, namespace) if disk is not None else 0
        looked = False
        if disk is not None and max_prefix > 0 and not tried and len(self._loading) < MAX_DISK_LOADS:
            looked = True
            match = disk.lookup(prompt, max_prefix, namespace, ram_tokens)
            if match is not None and self._tg is not None:
                token = self._loading[rid] = object()
                self._tg.start_soon(self._load, rid, token, match, prompt, message.notify)
                answer(message.reply, KvReservation(request_id=rid, granted=False, reason="loading"))
                return
        use_disk = loaded is not None and loaded.num_tokens > ram_tokens
        reservation, evicted = self.ledger.reserve(rid, message.num_tokens, prompt, max_prefix, namespace, use_prefixes=not use_disk)
        if use_disk and loaded is not None and reservation.granted:
            assert disk is not None
            disk.count_hit(loaded)
            reservation = msgspec.structs.replace(reservation, disk_prefix=loaded)
        elif (tried or looked) and reservation.reason == "no_room":
            self._loaded[rid] = loaded  # kept for the next try (not read or looked up again)
        answer(message.reply, reservation)
        await self._drop(evicted)

    async def _load(self, rid: str, token: object, match, prompt: list[int], notify) -> None:
        assert self._disk is not None
        try:
            prefix = await self._disk.load(match, prompt)
        except Exception:
            log.exception("disk_read_failed", request_id=rid)
            prefix = None
        if self._loading.get(rid) is token:
            del self._loading[rid]
            self._loaded[rid] = prefix
            if notify is not None:
                answer(notify, PrefixLoaded(request_id=rid))

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
