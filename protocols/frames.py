"""Length-prefixed frames, the one codec for every framed byte stream in the project: a 4-byte
big-endian length, then that many bytes.

The socket's msgpack messages (`net.framing`), a distributed world's control commands
(`engine.model.world`) and a checkpoint file's header (`runtime.checkpoints`) are framed so.
A reader checks the announced size against its limit before it reads (or allocates) the body.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct(">I")
# The most a 4-byte length can announce.
MAX_FRAME_BYTES = 2**32 - 1


class FrameTooLarge(Exception):
    """The peer announced a frame above the limit; the stream cannot be resynchronised."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit}")
        self.size = size
        self.limit = limit


def frame(body: bytes) -> bytes:
    """`body` with its length in front."""
    if len(body) > MAX_FRAME_BYTES:
        raise FrameTooLarge(len(body), MAX_FRAME_BYTES)
    return HEADER.pack(len(body)) + body


def frame_size(header: bytes, max_bytes: int = MAX_FRAME_BYTES) -> int:
    """The body size a frame's `HEADER.size` first bytes announce; `FrameTooLarge` above `max_bytes`."""
    (size,) = HEADER.unpack(header)
    if size > max_bytes:
        raise FrameTooLarge(size, max_bytes)
    return size


def split_frame(data: bytes | memoryview, offset: int = 0, max_bytes: int = MAX_FRAME_BYTES) -> tuple[bytes, int] | None:
    """The body of the frame at `data[offset:]` and the offset after it; None when `data` ends
    before the frame does (a truncated buffer), `FrameTooLarge` above `max_bytes`."""
    if len(data) - offset < HEADER.size:
        return None
    size = frame_size(bytes(data[offset : offset + HEADER.size]), max_bytes)
    start = offset + HEADER.size
    if len(data) - start < size:
        return None
    return bytes(data[start : start + size]), start + size
