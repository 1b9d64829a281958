"""Signed files: a magic with a format version, a sha256 digest, a framed header, a payload.

    magic (e.g. b"MLXRTCK" + version digit) | sha256 of what follows | header as a frame
    (`protocols.frames`: uint32 BE length, then the bytes) | payload

Checkpoints (`runtime.checkpoints`) and the disk tier's entry files (`runtime.kv_files`) are
written so. The digest covers the header too, so a damaged header is caught before it is
parsed. This module knows the layout only: each caller decodes its own header and turns the
errors below into its own exception types.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from protocols import frames

DIGEST_BYTES = 32


class SignedFileError(ValueError):
    """A file this format cannot read (the subclass says why)."""


class ForeignFileError(SignedFileError):
    """Too short for the layout, or another magic: not a file of this kind."""


class OtherVersionError(SignedFileError):
    """This kind of file, written by another format version (`found`)."""

    def __init__(self, found: str):
        super().__init__(f"format version {found!r}")
        self.found = found


class AlteredFileError(SignedFileError):
    """The digest does not match what follows it: truncated or altered."""


class TruncatedFileError(SignedFileError):
    """The file ends before its header does."""


@dataclass(frozen=True)
class SignedFormat:
    """One kind of signed file: its magic prefix and the format version this code writes."""

    prefix: bytes
    version: int

    @property
    def magic(self) -> bytes:
        return self.prefix + str(self.version).encode()

    @property
    def header_offset(self) -> int:
        """Where the header's frame starts."""
        return len(self.magic) + DIGEST_BYTES

    @property
    def min_bytes(self) -> int:
        """The shortest file: magic, digest and the header's length."""
        return self.header_offset + frames.HEADER.size

    def encode(self, header: bytes, payload: bytes) -> list[bytes]:
        """The file's pieces, in order: magic, digest and framed header, then the payload
        (written one after the other, so the payload is not copied)."""
        framed = frames.frame(header)
        digest = hashlib.sha256(framed)
        digest.update(payload)
        return [self.magic + digest.digest() + framed, payload]

    def check_magic(self, data: bytes | memoryview) -> None:
        """Raises `ForeignFileError` or `OtherVersionError` unless `data` starts as this format does."""
        if len(data) < self.min_bytes or bytes(data[: len(self.prefix)]) != self.prefix:
            raise ForeignFileError("not a file of this kind")
        if bytes(data[: len(self.magic)]) != self.magic:
            raise OtherVersionError(bytes(data[len(self.prefix) : len(self.magic)]).decode(errors="replace"))

    def check_digest(self, data: bytes | memoryview) -> None:
        """Raises `AlteredFileError` unless the digest covers what follows it."""
        start = self.header_offset
        if len(data) < self.min_bytes or hashlib.sha256(memoryview(data)[start:]).digest() != bytes(data[len(self.magic) : start]):
            raise AlteredFileError("truncated or altered (checksum mismatch)")

    def header_size(self, head: bytes | memoryview) -> int:
        """The header length that a file's first `min_bytes` announce (to read no more of it)."""
        return int(frames.HEADER.unpack_from(head, self.header_offset)[0])

    def split(self, data: bytes | memoryview) -> tuple[bytes, int]:
        """The header bytes and the payload's offset; `TruncatedFileError` when `data` ends first."""
        found = frames.split_frame(data, self.header_offset)
        if found is None:
            raise TruncatedFileError("truncated")
        return found

    def open(self, data: bytes | memoryview) -> tuple[bytes, int]:
        """Magic, digest, then the header: the header bytes and the payload's offset."""
        self.check_magic(data)
        self.check_digest(data)
        return self.split(data)
