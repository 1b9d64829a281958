"""The prefix cache's disk tier on disk: entry files, the directory lock, the start-up scan.

`kv.disk_cache_dir` holds one subdirectory per model, tokenizer and KV format (their digests
hashed: a server of another model, or with other `kv.bits`, uses another one), and in it one
file per entry (`policies.disk_index`: a chunk of a full-attention prefix, or a whole entry),
named by its key:

    b"MLXRTKV" + format version digit | sha256 of what follows | the header (JSON) as a frame
    (`protocols.frames`) | KV tensors (safetensors, as checkpoints store them)

(a signed file, `runtime.signed_files`, as checkpoints are). The header names the model, tokenizer and KV format, the adapter namespace, the entry's key,
its parent chunk, its positions and its tokens. At start the directory is locked (one server
per subdirectory: another gets `DiskCacheLockedError`) and scanned: headers are read (not
whole files), and a file whose header is damaged, foreign, or for another key is removed, as
is a link, FIFO or device in an entry's place (never followed, never opened blocking); a
directory there is left alone and logged. A directory that cannot be created or opened
leaves the runtime RAM-only (`disk_cache_unavailable`), one that cannot be written serves
what it holds (`disk_cache_read_only`). A read checks the whole file's digest and its header
against what was looked up, so a damaged, truncated or swapped file is never served (the
caller removes it). Files are 0600 in 0700 directories and written to a temporary name,
then renamed, without fsync: a kill leaves a temporary file (removed by the next scan), a
power loss at worst a torn file its digest catches, and the tier is a cache. Blocking I/O:
call from worker threads.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
import anyio.to_thread
import msgspec
import numpy as np
import safetensors.numpy
import structlog

from actors.disk_tier import DiskTier
from policies.disk_index import DiskEntry, DiskIndex
from policies.layout import is_trimmable, kv_format
from protocols.base import Record
from protocols.config import KvConfig
from protocols.errors import DiskCacheError, DiskCacheLockedError
from protocols.model import ModelInfo
from runtime import checkpoints, private_files
from runtime.signed_files import SignedFileError, SignedFormat

log = structlog.get_logger(actor="kv_store", tier="disk")

FORMAT_VERSION = 1
FORMAT = SignedFormat(b"MLXRTKV", FORMAT_VERSION)
MAGIC = FORMAT.magic
_PREFIX = FORMAT.min_bytes
SUFFIX = ".kv"
# A header holds at most a whole entry's tokens: this bounds what a scan reads of a file.
MAX_HEADER_BYTES = 64 * 1024 * 1024
# The dtypes KV tensors are stored in (`engine.kv.caches.tensor_arrays`: float32, packed words).
_SAFETENSORS_DTYPES = {"F32": np.float32, "U32": np.uint32, "F16": np.float16, "I32": np.int32, "U8": np.uint8}


class EntryHeader(Record, frozen=True):
    kind: Literal["chunk", "whole"]
    key: str
    model_id: str
    tokenizer_id: str
    kv_format: str
    namespace: str | None
    # Positions start:end of the sequence (a whole entry: 0:len(tokens)); a chunk's parent key.
    start: int
    end: int
    parent: str | None
    # The tokens at those positions.
    tokens: list[int]
    created_at: float


class DamagedEntryError(ValueError):
    """A file that must not be served: truncated, altered, foreign, or not the entry asked for."""


class DiskCacheUnavailableError(OSError):
    """The directory cannot be created or opened (a path through a file, no permission, a
    read-only or full file system): the runtime serves from RAM only."""


@dataclass(frozen=True)
class Identity:
    """What an entry's KV belongs to."""

    model_id: str
    tokenizer_id: str
    kv_format: str

    def subdirectory(self) -> str:
        digest = hashlib.sha256(f"{self.model_id}\0{self.tokenizer_id}\0{self.kv_format}".encode()).hexdigest()
        return digest[:24]


def encode(header: EntryHeader, tensors: bytes) -> list[bytes]:
    """The file's pieces, in order (written one after the other: the tensors are not copied)."""
    return FORMAT.encode(msgspec.json.encode(header), tensors)


def tensor_views(data: memoryview, name: str) -> dict[str, np.ndarray]:
    """The tensors of safetensors bytes as numpy views of them (no copies)."""
    try:
        (size,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(bytes(data[8 : 8 + size]))
        base, arrays = 8 + size, {}
        for tensor, spec in header.items():
            if tensor == "__metadata__":
                continue
            dtype, shape = np.dtype(_SAFETENSORS_DTYPES[spec["dtype"]]), tuple(spec["shape"])
            begin, end = spec["data_offsets"]
            count = math.prod(shape)
            if end - begin != count * dtype.itemsize or base + end > len(data):
                raise ValueError(f"tensor {tensor} overruns the file")
            arrays[tensor] = np.frombuffer(data, dtype=dtype, count=count, offset=base + begin).reshape(shape)
        return arrays
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise DamagedEntryError(f"{name} has unreadable tensors: {exc}") from None


def parse_header(data: bytes | memoryview, name: str) -> tuple[EntryHeader, int]:
    """The header (its digest not checked: `DiskFiles.read` does) and the tensors' offset."""
    try:
        FORMAT.check_magic(data)
    except SignedFileError:
        raise DamagedEntryError(f"{name} is not an mlxrt KV file of format {FORMAT_VERSION}") from None
    try:
        body, end = FORMAT.split(data)
    except SignedFileError:
        raise DamagedEntryError(f"{name} is truncated") from None
    try:
        return msgspec.json.decode(body, type=EntryHeader), end
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise DamagedEntryError(f"{name} has an invalid header: {exc}") from None


class DiskFiles:
    """One model's subdirectory of `kv.disk_cache_dir`: locked while open."""

    def __init__(self, root: Path, identity: Identity, *, max_file_bytes: int):
        self.root = root
        self.identity = identity
        self.directory = root / identity.subdirectory()
        self.max_file_bytes = max_file_bytes
        self._lock_fd: int | None = None

    def open(self) -> bool:
        """Create or check the directories and lock ours; returns whether files can be written
        (a read-only directory still serves what it holds). Raises `DiskCacheLockedError` when
        another server holds it, `DiskCacheError` when it is not ours or open to others, and
        `DiskCacheUnavailableError` when it cannot be created or opened."""
        writable = False
        for directory in (self.root, self.directory):
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except FileExistsError:
                pass  # (not a directory: the check below says so)
            except OSError as exc:
                raise DiskCacheUnavailableError(f"{directory} cannot be created: {exc.strerror or exc}") from None
            try:
                writable = private_files.prepare_directory(directory, writable=False)
            except private_files.PrivateDirError as exc:
                raise DiskCacheError(f"kv.disk_cache_dir: {exc}") from None
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise DiskCacheUnavailableError(f"{self.directory} cannot be opened: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskCacheLockedError(
                f"kv.disk_cache_dir {self.root} is in use by another server of this model (pid lock on {self.directory}); give each server its own directory"
            ) from None
        self._lock_fd = fd
        return writable

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (closing the descriptor releases the lock)
            self._lock_fd = None

    def path(self, key: str) -> Path:
        if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
            raise DamagedEntryError(f"{key!r} is not an entry key")
        return self.directory / f"{key}{SUFFIX}"

    def write(self, entry: DiskEntry, tokens: list[int], arrays: dict) -> int:
        """Write an entry file (its positions hold `tokens`) atomically; returns its bytes."""
        header = EntryHeader(
            kind="whole" if entry.tokens else "chunk",
            key=entry.key,
            model_id=self.identity.model_id,
            tokenizer_id=self.identity.tokenizer_id,
            kv_format=self.identity.kv_format,
            namespace=entry.namespace,
            start=entry.end - len(tokens),
            end=entry.end,
            parent=entry.parent,
            tokens=list(tokens),
            created_at=time.time(),
        )
        pieces = encode(header, safetensors.numpy.save(arrays))
        try:
            private_files.write_atomic(self.path(header.key), pieces, sync=False)
        except IsADirectoryError:  # this entry's name only: the others can still be written
            raise DamagedEntryError(f"{header.key}{SUFFIX}: a directory is in its place") from None
        return sum(map(len, pieces))

    def read(self, entry: DiskEntry, tokens: list[int]) -> dict[str, np.ndarray]:
        """The tensors of `entry`, whose positions hold `tokens`, checked whole: numpy views of
        one buffer the file was read into. Raises `FileNotFoundError` (evicted meanwhile) or
        `DamagedEntryError` (remove it)."""
        path = self.path(entry.key)
        try:
            data = memoryview(private_files.read_regular_buffer(path, self.max_file_bytes))
        except private_files.UnreadableFileError as exc:
            raise DamagedEntryError(str(exc)) from None
        try:
            FORMAT.check_digest(data)
        except SignedFileError:
            raise DamagedEntryError(f"{path.name} is truncated or altered (checksum mismatch)") from None
        header, end = parse_header(data, path.name)
        self._check(header, path.name)
        if header.key != entry.key or header.tokens != tokens or header.parent != entry.parent or header.namespace != entry.namespace:
            raise DamagedEntryError(f"{path.name} holds another entry than its name says")
        return tensor_views(data[end:], path.name)

    def _check(self, header: EntryHeader, name: str) -> None:
        i = self.identity
        if (header.model_id, header.tokenizer_id, header.kv_format) != (i.model_id, i.tokenizer_id, i.kv_format):
            raise DamagedEntryError(f"{name} was written for another model, tokenizer or KV format")
        if f"{header.key}{SUFFIX}" != name or header.end - header.start != len(header.tokens) or header.start < 0:
            raise DamagedEntryError(f"{name} has a header that does not match it")

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                _discard(self.path(key))
            except DamagedEntryError:
                pass

    def touch(self, keys: list[str]) -> None:
        """Mark files used now (their order after a restart is by modification time)."""
        now = time.time()
        for key in keys:
            try:
                os.utime(self.path(key), (now, now), follow_symlinks=False)
            except (OSError, DamagedEntryError):
                pass

    def scan(self, *, whole: bool) -> tuple[list[DiskEntry], int, int]:
        """The entries on disk, least recently used first, how many files were removed (damaged
        or foreign headers, leftover temporary files, links, FIFOs or devices in an entry's
        place, the wrong kind of entry) and how many were left alone (directories in an entry's
        place, files that fail to read)."""
        found: list[tuple[float, DiskEntry]] = []
        removed = ignored = 0
        try:
            names = os.listdir(self.directory)
        except OSError:
            return [], 0, 0
        for name in names:
            path = self.directory / name
            if not name.endswith((SUFFIX, ".tmp")):
                continue
            try:
                if name.endswith(".tmp"):
                    raise DamagedEntryError(f"{name} is a leftover temporary file")
                entry, mtime = self._scan_one(path, name, whole)
            except DamagedEntryError:
                removed, ignored = (removed + 1, ignored) if _discard(path) else (removed, ignored + 1)
                continue
            except OSError:
                ignored += 1
                continue
            found.append((mtime, entry))
        found.sort(key=lambda item: (item[0], -item[1].end))  # a chain touched at once: its deepest chunks first
        return [entry for _, entry in found], removed, ignored

    def _scan_one(self, path: Path, name: str, whole: bool) -> tuple[DiskEntry, float]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise DamagedEntryError(f"{name} is a link") from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > self.max_file_bytes:
                raise DamagedEntryError(f"{name} is not a regular file of a plausible size")
            head = os.pread(fd, _PREFIX, 0)
            if len(head) < _PREFIX:
                raise DamagedEntryError(f"{name} is truncated")
            length = FORMAT.header_size(head)
            if length > MAX_HEADER_BYTES or _PREFIX + length > info.st_size:
                raise DamagedEntryError(f"{name} is truncated")
            data = head + os.pread(fd, length, _PREFIX)
        finally:
            os.close(fd)
        header, end = parse_header(data, name)
        self._check(header, name)
        if (header.kind == "whole") != whole or end >= info.st_size:
            raise DamagedEntryError(f"{name} is a {header.kind} entry with no tensors, or the wrong kind for this model")
        tokens = tuple(header.tokens) if whole else ()
        entry = DiskEntry(key=header.key, num_bytes=info.st_size, end=header.end, namespace=header.namespace, parent=header.parent, tokens=tokens)
        return entry, info.st_mtime


def _discard(path: Path) -> bool:
    """Remove what is at `path` unless it is a directory (a link goes, never what it points to);
    returns whether anything was removed."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        path.unlink()
        return True
    except OSError:
        return False


async def open_tier(kv: KvConfig, info: ModelInfo) -> DiskTier | None:
    """The disk tier `kv.disk_cache_dir` asks for, its directory locked and its index rebuilt
    from the files there (None when it is off). Raises `DiskCacheLockedError` or
    `DiskCacheError` (see `DiskFiles.open`)."""
    if not kv.disk_cache_dir:
        return None
    layers = info.layers
    whole = not is_trimmable(layers)
    identity = Identity(info.model_id, info.tokenizer_id, kv_format(layers))
    files = DiskFiles(Path(kv.disk_cache_dir).expanduser(), identity, max_file_bytes=checkpoints.max_file_bytes(info.max_context, layers))
    started = time.monotonic()

    def open_and_scan() -> tuple[bool, list[DiskEntry], int, int]:
        writable = files.open()
        try:
            return (writable, *files.scan(whole=whole))
        except BaseException:
            files.close()
            raise

    try:
        writable, entries, removed, ignored = await anyio.to_thread.run_sync(open_and_scan)
    except DiskCacheUnavailableError as exc:
        log.warning("disk_cache_unavailable", directory=str(files.directory), error=str(exc), serving="ram_only")
        return None
    if not writable:
        log.warning("disk_cache_read_only", directory=str(files.directory), error="the directory cannot be written: entries are read, not written")
    if ignored:
        log.warning("disk_files_ignored", directory=str(files.directory), count=ignored, why="directories in entries' places, or files that fail to read")
    index = DiskIndex(chunk=kv.disk_chunk_tokens, whole=whole)
    dropped = index.restore(entries) + index.evict_to(kv.disk_cache_bytes)
    if dropped and writable:
        await anyio.to_thread.run_sync(files.delete, dropped)
    tier = DiskTier(files, index, layers, capacity_bytes=kv.disk_cache_bytes, min_tokens=kv.disk_min_tokens, writable=writable)
    tier.removed_damaged = removed
    log.info(
        "disk_cache_opened",
        directory=str(files.directory),
        entries=len(index),
        bytes=index.num_bytes,
        removed=removed + len(dropped),
        writable=writable,
        seconds=round(time.monotonic() - started, 3),
    )
    return tier
