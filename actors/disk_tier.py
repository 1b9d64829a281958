"""The prefix cache's disk tier, run inside the KV store actor (`kv.disk_cache_dir`).

Write-through: when the engine saves a prefix entry of at least `kv.disk_min_tokens` tokens,
the KV store asks the model actor to copy out what the disk lacks of it (`ExportPrefix`: the
chunks not on disk yet, or the whole entry), before any eviction can drop it; the copies
(numpy arrays) come back to this tier's writer task, which writes the files in worker
threads, indexes them and evicts the least recently used files beyond `kv.disk_cache_bytes`.
Entries leaving RAM therefore need no write of their own, and entries still in RAM when the
process ends are on disk for the next one. The MLX thread only copies arrays; hashing,
serialising and writing happen in worker threads. Exports in flight are bounded (count and
bytes); beyond that an entry is not written (`writes_skipped`), never waited for.

Reads: a prompt whose longest disk match beats the RAM tier's by a chunk or more is read
(every file checked whole) in a worker thread while the scheduler keeps stepping other
requests, then admitted with the KV (`DiskPrefix`). A damaged file is removed (with the
chunks after it) and the read keeps what came before it. A write that fails (a full disk,
a read-only directory) pauses writes for `RETRY_WRITES_S` with the error in the stats and
one warning; reads and requests go on. An entry whose name cannot be written (a directory
in its place) is skipped alone.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio
import anyio.to_thread
import numpy as np
import structlog

from policies.disk_index import DiskEntry, DiskIndex, DiskMatch
from policies.layout import tensor_shapes
from protocols.kv import DiskStats
from protocols.model import DiskPrefix, ExportPrefix, LayerLayout, PrefixExport, SavedPrefix

log = structlog.get_logger(actor="kv_store", tier="disk")

# Exports asked for and not yet written, at most (count, and bytes of their arrays).
MAX_EXPORTS = 16
MAX_EXPORT_BYTES = 1 << 30
# After a failed write, writes pause this long (a full disk is not retried every step).
RETRY_WRITES_S = 60.0


def assemble(files: list[dict], layers: list[LayerLayout], num_tokens: int, whole: bool) -> dict[str, np.ndarray]:
    """The arrays a checkpoint of `num_tokens` positions holds (`tensor_shapes`), from one whole
    entry's arrays, or from chunks' in position order (each tensor's positions concatenated
    and cut to `num_tokens`; a float head below `kv.quantized_start` likewise). Raises
    `ValueError` for files that do not hold them."""
    shapes = tensor_shapes(layers, num_tokens)
    if whole:
        (arrays,) = files
        wrong = [name for name, shape in shapes.items() if name not in arrays or arrays[name].shape != shape]
        if wrong:
            raise ValueError(f"a stored entry does not fit this model ({', '.join(wrong[:3])})")
        return {name: arrays[name] for name in shapes}
    out = {}
    for name, shape in shapes.items():
        parts, left = [], shape[2]
        for arrays in files:
            if left <= 0:
                break
            array = arrays.get(name)
            if array is None or array.ndim != 4 or array.shape[:2] + array.shape[3:] != shape[:2] + shape[3:]:
                raise ValueError(f"a stored tensor {name} does not fit this model ({None if array is None else array.shape} for {shape})")
            parts.append(array[:, :, :left])
            left -= parts[-1].shape[2]
        if left:
            raise ValueError(f"the stored positions of {name} end before {num_tokens}")
        out[name] = np.concatenate(parts, axis=2) if len(parts) > 1 else np.ascontiguousarray(parts[0])
    return out


class DiskFiles(Protocol):
    """The files of one model's disk tier (`runtime.kv_files.DiskFiles`); blocking calls."""

    directory: Path

    def read(self, entry: DiskEntry, tokens: list[int]) -> dict:
        """An entry's arrays by tensor name (numpy), checked whole; `FileNotFoundError` when
        gone, `ValueError` when damaged, foreign or another entry (the tier removes it)."""
        ...

    def write(self, entry: DiskEntry, tokens: list[int], arrays: dict) -> int:
        """Write an entry whose positions hold `tokens`; returns the file's bytes. Raises
        `ValueError` when this entry's name cannot be written (a directory in its place),
        `OSError` when the directory cannot (a full disk: writes pause)."""
        ...

    def delete(self, keys: list[str]) -> None: ...

    def touch(self, keys: list[str]) -> None: ...

    def close(self) -> None:
        """Let go of the directory (its lock)."""
        ...


@dataclass(frozen=True)
class _Planned:
    start: int
    end: int
    parent: str | None
    namespace: str | None
    tokens: list[int]


class DiskTier:
    def __init__(self, files: DiskFiles, index: DiskIndex, layers: list[LayerLayout], *, capacity_bytes: int, min_tokens: int, writable: bool):
        self.files = files
        self.index = index
        self.capacity_bytes = capacity_bytes
        self.min_tokens = min_tokens
        self._layers = layers
        self._writable = writable
        self._paused_until = 0.0
        self._error: str | None = None if writable else "the directory is read-only: entries are read, not written"
        self._exports_send, self._exports_receive = anyio.create_memory_object_stream[PrefixExport](MAX_EXPORTS)
        self._pending: dict[str, _Planned] = {}
        self._in_flight: list[int] = []  # estimated bytes per export asked for
        self._drained = anyio.Event()
        self._drained.set()
        self._hits = self._tokens_loaded = self._misses = 0
        self._load_s = self._export_s = self._write_s = 0.0
        self._writes = self._bytes_written = self._write_failures = self._skipped = self._evicted = 0
        self.removed_damaged = 0

    # -- reads -----------------------------------------------------------------------------

    def lookup(self, tokens: list[int], max_tokens: int, namespace: str | None, ram_tokens: int) -> DiskMatch | None:
        """The disk match worth reading instead of the RAM tier's `ram_tokens` (a chunk more)."""
        match = self.index.lookup(tokens, max_tokens, namespace)
        if match is None or match.num_tokens < ram_tokens + (1 if match.whole else self.index.chunk):
            self._misses += 1
            return None
        return match

    async def load(self, match: DiskMatch, tokens: list[int]) -> DiskPrefix | None:
        """Read a match's files (checked whole) and assemble the KV of its positions, in a worker
        thread; None when nothing usable was left (evicted meanwhile, or damaged: removed)."""
        started = time.monotonic()
        entries = [self.index.get(key) for key in match.keys]
        chunk = self.index.chunk

        def read() -> tuple[list[dict], int, tuple[str, str] | None]:
            out: list[dict] = []
            for entry in entries:
                if entry is None:
                    break
                expected = tokens[: entry.end] if match.whole else tokens[entry.end - chunk : entry.end]
                try:
                    out.append(self.files.read(entry, expected))
                except FileNotFoundError:
                    return out, 0, (entry.key, "")
                except ValueError as exc:
                    return out, 0, (entry.key, str(exc))
            return out, sum(entry.num_bytes for entry in entries[: len(out)] if entry is not None), None

        files, num_bytes, lost = await anyio.to_thread.run_sync(read)
        if lost is not None:
            # Gone (removed by hand) or damaged: never looked up again, nor what follows it.
            key, why = lost
            removed = self.index.remove(key)
            if why:
                log.warning("disk_entry_damaged", key=key[:16], error=why)
                self.removed_damaged += len(removed)
            await anyio.to_thread.run_sync(self.files.delete, removed)
        num_tokens = match.num_tokens if match.whole else min(len(files) * chunk, match.num_tokens)
        arrays = None
        if files:
            try:
                arrays = await anyio.to_thread.run_sync(assemble, files, self._layers, num_tokens, match.whole)
            except ValueError as exc:  # files that passed their checks but do not fit the model
                log.warning("disk_entry_damaged", key=match.keys[0][:16], error=str(exc))
                removed = self.index.remove(match.keys[0])
                self.removed_damaged += len(removed)
                await anyio.to_thread.run_sync(self.files.delete, removed)
        ended = time.monotonic()
        self._load_s += ended - started
        if arrays is None:
            return None
        used = match.keys[: len(files)]
        self.index.touch(used)
        await anyio.to_thread.run_sync(self.files.touch, used)
        log.debug("disk_prefix_read", tokens=num_tokens, files=len(files), bytes=num_bytes, seconds=round(ended - started, 4))
        return DiskPrefix(num_tokens=num_tokens, arrays=arrays, num_files=len(files), num_bytes=num_bytes, started=started, ended=ended)

    def count_hit(self, prefix: DiskPrefix) -> None:
        self._hits += 1
        self._tokens_loaded += prefix.num_tokens

    # -- writes ----------------------------------------------------------------------------

    def writable(self) -> bool:
        return self._writable and time.monotonic() >= self._paused_until

    def plan_export(self, saved: SavedPrefix) -> ExportPrefix | None:
        """What to ask the model actor to copy out of a just-saved entry (None: nothing the
        disk lacks, too short, writes paused, or too much in flight)."""
        if len(saved.tokens) < self.min_tokens or not self.writable():
            return None
        wanted = [w for w in self.index.wanted(saved.tokens, saved.adapter) if w[0] not in self._pending]
        if not wanted:
            return None
        cost = sum(self._array_bytes(end - start) for _, start, end, _ in wanted)
        if len(self._in_flight) >= MAX_EXPORTS or sum(self._in_flight) + cost > MAX_EXPORT_BYTES:
            self._skipped += 1
            return None
        for key, start, end, parent in wanted:
            self._pending[key] = _Planned(start, end, parent, saved.adapter, list(saved.tokens[start:end]))
        self._in_flight.append(cost)
        self._drained = anyio.Event()
        keys = [w[0] for w in wanted]
        return ExportPrefix(entry_id=saved.entry_id, keys=keys, spans=[(s, e) for _, s, e, _ in wanted], whole=self.index.whole, reply=self._exports_send)

    def _array_bytes(self, num_tokens: int) -> int:
        return sum(4 * math.prod(shape) for shape in tensor_shapes(self._layers, num_tokens).values())

    async def run_writer(self) -> None:
        """Write exported entries as they come (the KV store runs this task)."""
        async with self._exports_receive:
            async for export in self._exports_receive:
                try:
                    await self._write(export)
                finally:
                    self._in_flight.pop(0)
                    if not self._in_flight:
                        self._drained.set()

    async def drained(self) -> None:
        """Until every export asked for so far is written (or given up)."""
        await self._drained.wait()

    async def _write(self, export: PrefixExport) -> None:
        planned = [self._pending.pop(key, None) for key in export.keys]
        self._export_s += export.export_s
        if export.error is not None:
            log.warning("disk_export_failed", error=export.error)
            return
        started, written = time.monotonic(), 0
        for key, plan, arrays in zip(export.keys, planned, export.arrays):
            if plan is None or not self.writable() or (plan.parent is not None and plan.parent not in self.index):
                self._skipped += 1
                continue
            entry = DiskEntry(
                key=key, num_bytes=0, end=plan.end, namespace=plan.namespace, parent=plan.parent, tokens=tuple(plan.tokens) if self.index.whole else ()
            )
            try:
                num_bytes, seconds = await anyio.to_thread.run_sync(self._timed_write, entry, plan.tokens, arrays)
            except ValueError as exc:  # this entry only (the chunks after it are skipped: no parent)
                self._skipped += 1
                log.warning("disk_entry_unwritable", key=key[:16], error=str(exc))
                continue
            except OSError as exc:
                self._write_failures += 1
                self._paused_until = time.monotonic() + RETRY_WRITES_S
                self._error = f"{type(exc).__name__}: {exc.strerror or exc}"
                log.warning("disk_write_failed", error=self._error, retry_in_s=RETRY_WRITES_S, serving="ram_only")
                return
            self.index.add(dataclasses.replace(entry, num_bytes=num_bytes))
            self._writes += 1
            self._write_s += seconds
            self._bytes_written += num_bytes
            written += num_bytes
        evicted = self.index.evict_to(self.capacity_bytes)
        if evicted:
            self._evicted += len(evicted)
            await anyio.to_thread.run_sync(self.files.delete, evicted)
        if written:
            log.debug("disk_prefix_written", bytes=written, files=len(export.keys), seconds=round(time.monotonic() - started, 4))

    def _timed_write(self, entry: DiskEntry, tokens: list[int], arrays: dict) -> tuple[int, float]:
        started = time.perf_counter()
        num_bytes = self.files.write(entry, tokens, arrays)
        return num_bytes, time.perf_counter() - started

    def close(self) -> None:
        """No more exports; let go of the directory."""
        self._exports_send.close()
        self._exports_receive.close()
        self.files.close()

    # -- figures ---------------------------------------------------------------------------

    def stats(self) -> DiskStats:
        return DiskStats(
            directory=str(self.files.directory),
            entries=len(self.index),
            bytes=self.index.num_bytes,
            capacity_bytes=self.capacity_bytes,
            writable=self.writable(),
            hits=self._hits,
            tokens_loaded=self._tokens_loaded,
            misses=self._misses,
            load_s=round(self._load_s, 6),
            writes=self._writes,
            bytes_written=self._bytes_written,
            write_failures=self._write_failures,
            writes_skipped=self._skipped,
            evicted=self._evicted,
            removed_damaged=self.removed_damaged,
            export_s=round(self._export_s, 6),
            write_s=round(self._write_s, 6),
            error=self._error,
        )
