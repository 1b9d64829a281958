"""Files only this user reads and writes: a private directory, atomic writes, guarded reads.

Shared by durable checkpoints (`runtime.checkpoints`) and the prefix cache's disk tier
(`runtime.kv_files`). Blocking I/O: call from a worker thread.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path


class PrivateDirError(OSError):
    """The directory is unusable: not ours, open to others, not a directory, or (for
    `prepare_directory(..., writable=True)`) not writable."""


class UnreadableFileError(OSError):
    """Not a regular file (a link, FIFO, device or directory), too large, or failing to read."""


def prepare_directory(directory: Path, *, writable: bool = True) -> bool:
    """Create the directory (0700) or check an existing one; returns whether it can be written.

    Raises `PrivateDirError` for a directory that is not ours, that others can write, that is
    not a directory, or (with `writable`) that cannot be written (read-only, full).
    """
    try:
        if not directory.exists():
            directory.mkdir(parents=True, mode=0o700)
        info = directory.stat()
    except OSError as exc:
        raise PrivateDirError(f"{directory}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise PrivateDirError(f"{directory} is not a directory")
    if info.st_uid != os.getuid():
        raise PrivateDirError(f"{directory} belongs to uid {info.st_uid}, not to this user")
    if stat.S_IMODE(info.st_mode) & 0o022:
        raise PrivateDirError(f"{directory} can be written by others (mode {stat.S_IMODE(info.st_mode):o}); use a private directory (0700)")
    probe = directory / f".probe-{os.getpid()}.tmp"
    try:
        write_file(probe, b"probe")
    except OSError as exc:
        if writable:
            raise PrivateDirError(f"{directory} is not writable: {exc.strerror or exc}") from None
        return False
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return True


def write_file(path: Path, data: bytes | Sequence[bytes], *, sync: bool = True) -> None:
    """Write a new 0600 file (never through a link) of `data` (or its pieces, in order), fsynced
    unless `sync` is off."""
    # O_NONBLOCK: a FIFO left at the name fails the open (ENXIO) instead of blocking it forever.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        for piece in [data] if isinstance(data, bytes) else data:
            view = memoryview(piece)
            while view:
                view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(final: Path, data: bytes | Sequence[bytes], *, sync: bool = True) -> Path:
    """Write a temporary 0600 file, rename it over `final` (and with `sync`, fsync both the file
    and the directory). On failure (a full disk, say) the temporary file is removed and any old
    file stays."""
    temporary = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        write_file(temporary, data, sync=sync)
        os.replace(temporary, final)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if sync:
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return final


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file at `path` (no links, FIFOs, devices or directories), at
    most `max_bytes` of them (a larger file is refused). Raises `FileNotFoundError` when there
    is none, `UnreadableFileError` otherwise."""
    return bytes(read_regular_buffer(path, max_bytes))


def read_regular_buffer(path: Path, max_bytes: int) -> bytearray:
    """As `read_regular`, read straight into one buffer (no copies of it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UnreadableFileError(f"{path.name} cannot be opened: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFileError(f"{path.name} is not a regular file")
        if info.st_size > max_bytes:
            raise UnreadableFileError(f"{path.name} has {info.st_size} bytes, more than {max_bytes}")
        buffer = bytearray(info.st_size)
        view, filled = memoryview(buffer), 0
        while filled < info.st_size:
            got = os.readv(fd, [view[filled:]])
            if not got:
                return buffer[:filled]  # it shrank meanwhile: the digest will tell
            filled += got
        return buffer
    except UnreadableFileError:
        raise
    except OSError as exc:
        raise UnreadableFileError(f"{path.name} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def remove_regular(path: Path) -> None:
    """Remove `path` if it is a regular file (anything else is left alone)."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            path.unlink()
    except OSError:
        pass
