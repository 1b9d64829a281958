"""Length-prefixed msgpack frames over a byte stream (the wire format of `protocols.wire`), read
asynchronously; the frame codec itself is `protocols.frames`."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import anyio
import msgspec
from anyio.abc import ByteReceiveStream

from protocols.frames import HEADER, FrameTooLarge, frame, frame_size

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()

__all__ = ["HEADER", "FrameReader", "FrameTooLarge", "encode_frame"]


def encode_frame(message: msgspec.Struct | dict[str, Any]) -> bytes:
    return frame(_ENCODER.encode(message))


class FrameReader(Generic[T]):
    """Reads whole frames; checks the announced size before reading the body."""

    def __init__(self, stream: ByteReceiveStream, message_type: type[T], max_bytes: int):
        self._stream = stream
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._max_bytes = max_bytes
        self._buffer = bytearray()

    async def wait_frame(self) -> bool:
        """Wait until a frame has begun to arrive (False: the stream ended cleanly first)."""
        if self._buffer:
            return True
        try:
            self._buffer += await self._stream.receive(65536)
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
            return False
        return True

    async def read_frame(self) -> bytes | None:
        """The next frame's body, or None at a clean end of stream (between frames).

        Raises `FrameTooLarge`, or `anyio.IncompleteRead` when the stream ends mid-frame.
        """
        header = await self._read_exactly(HEADER.size, allow_eof=True)
        if header is None:
            return None
        size = frame_size(header, self._max_bytes)
        return await self._read_exactly(size, allow_eof=False)

    def decode(self, body: bytes) -> T:
        """Raises `msgspec.DecodeError` (bad msgpack) or `msgspec.ValidationError` (bad shape)."""
        try:
            return self._decoder.decode(body)
        except RecursionError:
            raise msgspec.DecodeError("message nested too deeply") from None

    async def _read_exactly(self, n: int, *, allow_eof: bool) -> bytes | None:
        while len(self._buffer) < n:
            try:
                chunk = await self._stream.receive(max(65536, n - len(self._buffer)))
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                if allow_eof and not self._buffer:
                    return None
                raise anyio.IncompleteRead from None
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data
