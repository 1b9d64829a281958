"""The socket client's own robustness, against fake servers that misbehave: a late answer to a
cancelled call, a connection that is lost."""

from __future__ import annotations

import gc

import anyio
import pytest

from net.client import Client
from net.framing import FrameReader, encode_frame
from protocols.api import Finished, GenerateRequest, TokenDelta
from protocols.kv import KvStats
from protocols.scheduler import SchedulerStats
from protocols.wire import PROTOCOL_VERSION, Generate, GetStats, Hello, Limits, ModelSummary, Stats, Welcome
from tests.support.events import collect

pytestmark = pytest.mark.server


async def test_client_survives_a_cancelled_stats_call(tmp_path):
    """A fake server answers the first GetStats late; the client connection must stay usable.

    Regression (bug in 4251e0d..d2bc91e, fixed in be3bfab): Client.stats left `_stats` pointing at its closed stream, so the late
    Stats made `_route` raise ClosedResourceError, silently ending the client's read loop.
    """
    from net.client import MAX_FRAME_BYTES
    from protocols.api import Usage
    from protocols.metrics import MetricsSnapshot
    from protocols.wire import ClientMessage

    path = tmp_path / "fake.sock"

    def stats(n: int) -> Stats:
        # `connections` numbers the answers, so a stale one is recognisable.
        return Stats(
            scheduler=SchedulerStats(waiting=0, prefilling=0, decoding=0, steps=0, num_finished=0),
            kv=KvStats(live_requests=0, live_tokens=0, live_bytes=0, reserved_tokens=0, physical_bytes=0, bytes_per_token=1, budget_bytes=None),
            live_requests=0,
            metrics=MetricsSnapshot(model_name="fake"),
            connections=n,
        )

    welcome = Welcome(
        protocol_version=PROTOCOL_VERSION,
        model=ModelSummary(path="fake", model_type="fake", vocab_size=10, max_context=10, eos_token_ids=[0]),
        limits=Limits(max_frame_bytes=1 << 20, max_batch_size=1, max_queued_requests=1, default_max_tokens=1),
    )
    first_stats_requested = anyio.Event()
    release_first = anyio.Event()
    connection_ended = anyio.Event()

    async def fake_server(stream) -> None:
        async with stream:
            reader = FrameReader(stream, ClientMessage, MAX_FRAME_BYTES)
            assert isinstance(reader.decode(await reader.read_frame()), Hello)
            await stream.send(encode_frame(welcome))
            answered = 0
            while (body := await reader.read_frame()) is not None:
                message = reader.decode(body)
                if isinstance(message, GetStats):
                    answered += 1
                    if answered == 1:
                        first_stats_requested.set()
                        await release_first.wait()
                    await stream.send(encode_frame(stats(answered)))
                elif isinstance(message, Generate):
                    rid = message.request.request_id
                    await stream.send(encode_frame(TokenDelta(request_id=rid, token_ids=[1], text="x")))
                    await stream.send(encode_frame(Finished(request_id=rid, finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1))))
        connection_ended.set()

    listener = await anyio.create_unix_listener(path)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, fake_server)
        async with Client.connect(path) as client:
            with anyio.CancelScope() as scope:

                async def cancel_when_sent():
                    await first_stats_requested.wait()
                    scope.cancel()

                tg.start_soon(cancel_when_sent)
                await client.stats()
            assert scope.cancelled_caught
            # The server now answers the abandoned call, then (in order) a request: by the time the
            # request's events arrive, the client has routed the late Stats.
            release_first.set()
            with anyio.fail_after(5):
                outcome = await collect(client.generate(GenerateRequest(prompt_ids=[1], max_tokens=1)))
                assert outcome.tokens == [1] and outcome.last.finish_reason == "length"
                assert (await client.stats()).connections == 2, "stats() must return the answer to its own GetStats"
        # Let the fake server see the end of stream before it is torn down (cancelling a pending
        # receive on a Unix socket can race with its readiness callback in anyio).
        with anyio.fail_after(5):
            await connection_ended.wait()
        tg.cancel_scope.cancel()


async def test_calls_on_a_lost_connection_raise_connection_lost(tmp_path):
    """After the server has gone, generate() and stats() say ConnectionLostError (a ServerError)."""
    from net.client import MAX_FRAME_BYTES, ConnectionLostError
    from protocols.wire import ClientMessage

    path = tmp_path / "fake.sock"
    welcome = Welcome(
        protocol_version=PROTOCOL_VERSION,
        model=ModelSummary(path="fake", model_type="fake", vocab_size=10, max_context=10, eos_token_ids=[0]),
        limits=Limits(max_frame_bytes=1 << 20, max_batch_size=1, max_queued_requests=1, default_max_tokens=1),
    )
    closed = anyio.Event()

    async def welcome_then_leave(stream) -> None:
        async with stream:
            reader = FrameReader(stream, ClientMessage, MAX_FRAME_BYTES)
            assert isinstance(reader.decode(await reader.read_frame()), Hello)
            await stream.send(encode_frame(welcome))
        closed.set()

    listener = await anyio.create_unix_listener(path)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, welcome_then_leave)
        outcomes = {}
        try:
            async with Client.connect(path) as client:
                with anyio.fail_after(5):
                    await closed.wait()
                    calls = {"generate": lambda: collect(client.generate(GenerateRequest(prompt_ids=[1], max_tokens=1))), "stats": client.stats}
                    for name, call in calls.items():
                        try:
                            await call()
                            outcomes[name] = "returned"
                        except ConnectionLostError:
                            outcomes[name] = "ConnectionLostError"
                        except Exception as exc:
                            outcomes[name] = repr(exc)
        finally:
            tg.cancel_scope.cancel()
    gc.collect()  # streams the client failed to close warn here, inside this test
    assert outcomes == {"generate": "ConnectionLostError", "stats": "ConnectionLostError"}
