"""`Client.connect`'s handshake against fake servers: a Welcome of another version, a version refusal."""

from __future__ import annotations

import anyio
import pytest

from net.client import Client
from net.framing import FrameReader, encode_frame
from protocols.errors import ServerError
from protocols.wire import PROTOCOL_VERSION, ClientMessage, Error, Hello, Limits, ModelSummary, Welcome


def _welcome(version: int) -> Welcome:
    return Welcome(
        protocol_version=version,
        model=ModelSummary(path="fake", model_type="fake", vocab_size=10, max_context=10, eos_token_ids=[0]),
        limits=Limits(max_frame_bytes=1 << 20, max_batch_size=1, max_queued_requests=1, default_max_tokens=1),
    )


async def _refusal_from(tmp_path, answer) -> ServerError:
    """What `Client.connect` raises against a fake server that answers its Hello with `answer`."""
    hellos: list[Hello] = []

    async def fake_server(stream) -> None:
        async with stream:
            reader: FrameReader[ClientMessage] = FrameReader(stream, ClientMessage, 1 << 20)  # type: ignore[arg-type]
            body = await reader.read_frame()
            assert body is not None
            hello = reader.decode(body)
            assert isinstance(hello, Hello)
            hellos.append(hello)
            await stream.send(encode_frame(answer))

    path = tmp_path / "fake.sock"
    listener = await anyio.create_unix_listener(path)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, fake_server)
        try:
            with pytest.raises(ServerError) as info, anyio.fail_after(10):
                async with Client.connect(path):
                    pass
        finally:
            tg.cancel_scope.cancel()
    assert [h.protocol_version for h in hellos] == [PROTOCOL_VERSION]  # the client says the newest
    return info.value


async def test_a_welcome_of_another_version_is_a_protocol_error(tmp_path):
    error = await _refusal_from(tmp_path, _welcome(PROTOCOL_VERSION - 1))
    assert error.code == "protocol_error" and f"version {PROTOCOL_VERSION - 1}" in str(error)


async def test_a_version_refusal_reaches_the_caller_with_its_message(tmp_path):
    refusal = Error(code="protocol_error", message="protocol version 2 is not supported; this server speaks protocol versions 1", supported_versions=[1])
    error = await _refusal_from(tmp_path, refusal)
    assert error.code == "protocol_error" and "speaks protocol versions 1" in str(error)
