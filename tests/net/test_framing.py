"""Length-prefixed frames: round trips, size limits, truncation."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from net.framing import HEADER, FrameReader, FrameTooLarge, encode_frame
from protocols.api import GenerateRequest, TokenDelta
from protocols.wire import ClientMessage, Generate, Hello, ServerMessage


async def _reader_over(data: bytes, message_type, max_bytes: int = 1 << 20, chunk: int = 3) -> FrameReader:
    return FrameReader(_Bytes(data, chunk), message_type, max_bytes)


class _Bytes:
    """A ByteReceiveStream yielding `data` in small chunks, then end of stream."""

    def __init__(self, data: bytes, chunk: int):
        self._chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if not self._chunks:
            raise anyio.EndOfStream
        return self._chunks.pop(0)


async def test_frames_round_trip_across_arbitrary_chunking():
    messages = [Hello(protocol_version=1), Generate(request=GenerateRequest(prompt="héllo", request_id="a", max_tokens=3))]
    reader = await _reader_over(b"".join(encode_frame(m) for m in messages), ClientMessage)
    decoded = [reader.decode(await reader.read_frame()) for _ in messages]
    assert decoded == messages
    assert await reader.read_frame() is None


async def test_oversize_frame_is_refused_before_reading_it():
    reader = await _reader_over(HEADER.pack(2**31) + b"x", ClientMessage, max_bytes=1024)
    with pytest.raises(FrameTooLarge) as info:
        await reader.read_frame()
    assert info.value.size == 2**31 and info.value.limit == 1024


async def test_truncated_frame_is_an_incomplete_read():
    frame = encode_frame(Hello(protocol_version=1))
    reader = await _reader_over(frame[:-2], ClientMessage)
    with pytest.raises(anyio.IncompleteRead):
        await reader.read_frame()


async def test_bad_bodies_raise_msgspec_errors():
    reader = await _reader_over(b"", ServerMessage)
    with pytest.raises(msgspec.DecodeError):
        reader.decode(b"\xc1\xc1")
    with pytest.raises(msgspec.ValidationError):
        reader.decode(msgspec.msgpack.encode({"type": "TokenDelta", "request_id": 1, "token_ids": [], "text": ""}))
    with pytest.raises(msgspec.ValidationError):
        reader.decode(msgspec.msgpack.encode({"type": "Launch"}))
    ok = reader.decode(msgspec.msgpack.encode({"type": "TokenDelta", "request_id": "r", "token_ids": [1], "text": "a"}))
    assert ok == TokenDelta(request_id="r", token_ids=[1], text="a")
