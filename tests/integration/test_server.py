"""`mlxrt serve` end to end: a server subprocess, `Client`s talking to it over the socket."""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import subprocess
import sys

import anyio
import pytest

from net.client import Client
from net.framing import encode_frame
from protocols.api import Finished, GenerateRequest, PrefillProgress, SamplingParams, TokenDelta
from protocols.kv import KvStats
from protocols.scheduler import SchedulerStats
from protocols.wire import PROTOCOL_VERSION, Cancel, Error, Generate, Stats
from runtime import InvalidRequestError, RequestTooLargeError, Runtime, ServerBusyError
from tests.support.config import CHUNK, REPO, make_config
from tests.support.doomed_client import first_line
from tests.support.events import Outcome, collect
from tests.support.mlx_reference import greedy_tokens, load_reference
from tests.support.serve import start_server, stop_all, wait_idle
from tests.support.wire import RawConnection

pytestmark = pytest.mark.server

MAX_TOKENS = 20
# Different lengths; five are longer than the server's prefill chunk.
PROMPT_LENGTHS = [1, 6, CHUNK + 1, 2 * CHUNK + 3, 11, 40, 4 * CHUNK + 7, 90]


def _prompts() -> list[list[int]]:
    rng = random.Random(2024)
    return [[rng.randrange(1000) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references() -> tuple[list[list[int]], list[list[int]]]:
    model, tokenizer = load_reference("builtin:tiny")
    prompts = _prompts()
    return prompts, [greedy_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]


BUSY_SCHEDULER = {"max_batch_size": 1, "max_queued_requests": 1}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's servers, started together so that their start-ups overlap.

    "main" serves the tests that leave it idle; "busy" has room for one running and
    one queued request; "shutdown" is there to be stopped by SIGTERM.
    """
    started = {
        "main": start_server(tmp_path_factory.mktemp("main")),
        "busy": start_server(tmp_path_factory.mktemp("busy"), scheduler=BUSY_SCHEDULER),
        "shutdown": start_server(tmp_path_factory.mktemp("shutdown")),
    }
    try:
        yield started
    finally:
        stop_all(started.values())


@pytest.fixture(scope="module")
def server(servers):
    process = servers["main"]
    process.wait_ready()
    yield process
    assert process.alive, f"the shared server died:\n{process.stderr()}"


@pytest.fixture(scope="module")
def busy_server(servers):
    process = servers["busy"]
    process.wait_ready()
    return process


@pytest.fixture
def doomed_server(servers):
    process = servers["shutdown"]
    process.wait_ready()
    return process


async def _fresh_request_matches(client: Client, references, i: int = 3) -> None:
    prompts, expected = references
    outcome = await collect(client.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=MAX_TOKENS)))
    assert outcome.tokens == expected[i]
    assert outcome.last.finish_reason == ("length" if len(expected[i]) == MAX_TOKENS else "stop")


# -- parity and stats --------------------------------------------------------------


async def test_concurrent_greedy_requests_match_mlx_lm_and_in_process_runtime(server, references):
    prompts, expected = references
    over_socket: dict[int, Outcome] = {}
    async with Client.connect(server.socket) as a, Client.connect(server.socket) as b:

        async def one(i: int) -> None:
            client = (a, b)[i % 2]
            request = GenerateRequest(prompt_ids=prompts[i], max_tokens=MAX_TOKENS, request_id=f"parity-{i}")
            over_socket[i] = await collect(client.generate(request))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        await wait_idle(a)

    in_process: dict[int, Outcome] = {}
    async with Runtime.open(make_config()) as rt:

        async def local(i: int) -> None:
            in_process[i] = await collect(rt.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=MAX_TOKENS)))

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(local, i)

    for i, prompt in enumerate(prompts):
        socket_run, local_run = over_socket[i], in_process[i]
        assert socket_run.tokens == expected[i], f"prompt of {len(prompt)} tokens diverged from mlx-lm over the socket"
        assert socket_run.tokens == local_run.tokens, f"prompt of {len(prompt)} tokens: socket and in-process runs differ"
        finished = socket_run.last
        assert finished.request_id == f"parity-{i}"
        assert finished.finish_reason == local_run.last.finish_reason == ("length" if len(expected[i]) == MAX_TOKENS else "stop")
        assert finished.usage.prompt_tokens == len(prompt)
        assert all(e.request_id == f"parity-{i}" for e in socket_run.events)
    # The references are not degenerate.
    assert len({t for tokens in expected for t in tokens}) > 20


async def test_stats_and_welcome_over_the_socket(server):
    async with Client.connect(server.socket) as client:
        welcome = client.welcome
        assert welcome.protocol_version == PROTOCOL_VERSION
        assert welcome.model.model_type == "llama" and welcome.model.vocab_size > 0 and welcome.model.max_context > 0
        assert welcome.limits.max_batch_size == 8 and welcome.limits.max_queued_requests == 256
        outcome = await collect(client.generate(GenerateRequest(prompt_ids=[3, 4, 5], max_tokens=7, ignore_eos=True)))
        assert outcome.last.finish_reason == "length" and len(outcome.tokens) == 7
        stats = await wait_idle(client, connections=1)
        assert isinstance(stats, Stats) and isinstance(stats.scheduler, SchedulerStats) and isinstance(stats.kv, KvStats)
        assert stats.live_requests == 0 and stats.kv.live_tokens == 0 and stats.connections == 1
        assert stats.scheduler.num_finished >= 1 and stats.scheduler.steps >= 7
        assert stats.kv.bytes_per_token > 0


# -- cancellation ------------------------------------------------------------------


async def test_cancel_by_message_ends_the_stream_cancelled(server):
    rid = "cancel-by-message"
    request = GenerateRequest(prompt_ids=[9, 8, 7, 6], max_tokens=2000, ignore_eos=True, request_id=rid)
    async with Client.connect(server.socket) as client:
        outcome, cancelled = Outcome(), False
        with anyio.fail_after(30):
            async for event in client.generate(request):
                outcome.events.append(event)
                if isinstance(event, TokenDelta):
                    outcome.tokens += event.token_ids
                    if not cancelled:
                        cancelled = True
                        await client.cancel(rid)
                elif isinstance(event, Finished):
                    outcome.finished.append(event)
        finished = outcome.last
        assert finished.finish_reason == "cancelled" and finished.request_id == rid
        # Ended by the cancel, long before its 2,000 tokens (not a clock check: a token count).
        assert finished.usage.completion_tokens == len(outcome.tokens) < 2000
        assert cancelled
        await wait_idle(client)


async def test_a_request_id_is_free_again_once_finished(server):
    """Finished is sent only after the id is released everywhere: reusing it at once is never a duplicate."""
    async with Client.connect(server.socket) as client:
        for i in range(20):
            request = GenerateRequest(prompt_ids=[1, 2, 3 + i], max_tokens=2, ignore_eos=True, request_id="again")
            outcome = await collect(client.generate(request))
            assert outcome.last.finish_reason == "length" and len(outcome.tokens) == 2
        await wait_idle(client)


async def test_an_unconsumed_stream_does_not_starve_the_others(server):
    async with Client.connect(server.socket) as client:
        paused = client.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=1500, ignore_eos=True, request_id="paused"))
        async with contextlib.aclosing(paused):
            first = await paused.__anext__()
            assert isinstance(first, TokenDelta)
            # While "paused" keeps generating unread, another request on the connection runs to the
            # end. (The deadline only guards against a hang: starvation would never finish.)
            other = GenerateRequest(prompt_ids=[4, 5, 6], max_tokens=600, ignore_eos=True, request_id="other")
            with anyio.fail_after(120):
                outcome = await collect(client.generate(other))
            assert outcome.last.finish_reason == "length" and len(outcome.tokens) == 600
            rest = await collect(paused)
            # (A delta carries every token ready when it is sent: the first may hold more than one.)
            assert rest.last.finish_reason == "length" and len(first.token_ids) + len(rest.tokens) == 1500
    async with Client.connect(server.socket) as client:
        await wait_idle(client)


async def test_cancel_storm_leaves_nothing_behind(server, references):
    rng = random.Random(1234)
    n = 32
    victims = set(rng.sample(range(n), n // 2))
    # Where each victim is cancelled: at its first prefill progress report, or after k tokens.
    cancel_at = {i: "prefill" if rng.random() < 0.25 else rng.randint(1, 100) for i in victims}
    prompts = [
        [rng.randrange(1000) for _ in range(rng.randint(3 * CHUNK, 6 * CHUNK) if cancel_at.get(i) == "prefill" else rng.randint(1, 50))] for i in range(n)
    ]
    results: dict[int, tuple[Outcome, bool]] = {}

    async with Client.connect(server.socket) as a, Client.connect(server.socket) as b:

        async def one(i: int) -> None:
            client, rid, point = (a, b)[i % 2], f"storm-{i}", cancel_at.get(i)
            request = GenerateRequest(prompt_ids=prompts[i], max_tokens=200, ignore_eos=True, request_id=rid, report_progress=True)
            outcome, sent = Outcome(), False
            async for event in client.generate(request):
                outcome.events.append(event)
                if isinstance(event, TokenDelta):
                    outcome.tokens += event.token_ids
                elif isinstance(event, Finished):
                    outcome.finished.append(event)
                if point is not None and not sent and not outcome.finished:
                    due = len(outcome.tokens) >= point if isinstance(point, int) else True
                    if due:
                        sent = True
                        await client.cancel(rid)
            results[i] = (outcome, sent)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)

        assert sorted(results) == list(range(n))
        for i, (outcome, sent) in results.items():
            finished = outcome.last  # exactly one Finished, and it is the last event
            assert finished.request_id == f"storm-{i}"
            if i in victims:
                assert sent
                assert finished.finish_reason == "cancelled", f"storm-{i} (cancel at {cancel_at[i]}) ended {finished.finish_reason}"
                assert finished.usage.completion_tokens == len(outcome.tokens) < 200
            else:
                assert finished.finish_reason == "length", f"storm-{i} ended {finished.finish_reason}"
                assert len(outcome.tokens) == finished.usage.completion_tokens == 200
            assert finished.usage.prompt_tokens == len(prompts[i])
            assert any(isinstance(e, PrefillProgress) for e in outcome.events) or cancel_at.get(i) == "prefill"

        stats = await wait_idle(a, connections=2)
        assert stats.kv.reserved_tokens == 0 and stats.kv.live_tokens == 0 and stats.live_requests == 0
        await _fresh_request_matches(b, references)


async def test_client_killed_mid_stream_releases_everything(server, references):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.doomed_client", str(server.socket)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert first_line(proc, 30).strip() == "streaming"
        async with Client.connect(server.socket) as client:
            with anyio.fail_after(10):  # earlier tests' connections may still be closing
                while not ((stats := await client.stats()).live_requests == 1 and stats.connections == 2):
                    await anyio.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(10) == -signal.SIGKILL
            stats = await wait_idle(client, connections=1)
            assert stats.kv.live_tokens == 0 and stats.kv.reserved_tokens == 0
            await _fresh_request_matches(client, references)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


# -- errors ------------------------------------------------------------------------


async def _drain(events) -> None:
    async for _ in events:
        pass


async def test_typed_errors_over_the_socket(server, references):
    prompts, expected = references
    async with Client.connect(server.socket) as client, Client.connect(server.socket) as other:
        good: dict[int, Outcome] = {}

        async def run_good(i: int) -> None:
            good[i] = await collect(client.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=MAX_TOKENS)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_good, 5)
            with pytest.raises(InvalidRequestError) as info:
                await _drain(client.generate(GenerateRequest(prompt_ids=[1, 2], sampling=SamplingParams(temperature=-1.0))))
            assert type(info.value) is InvalidRequestError and info.value.field == "sampling.temperature"
            assert "temperature" in str(info.value)

            with pytest.raises(InvalidRequestError) as info:
                await _drain(client.generate(GenerateRequest(prompt_ids=[1, 2], max_tokens=0)))
            assert info.value.field == "max_tokens"

            too_long = [1] * client.welcome.model.max_context
            with pytest.raises(RequestTooLargeError) as info:
                await _drain(client.generate(GenerateRequest(prompt_ids=too_long)))
            assert info.value.field == "prompt"

            # A request id live on one connection is refused on another.
            long = GenerateRequest(prompt_ids=[4, 4, 4], max_tokens=2000, ignore_eos=True, request_id="shared-id")
            async with contextlib.aclosing(client.generate(long)) as events:
                async for event in events:
                    if isinstance(event, TokenDelta):
                        with pytest.raises(InvalidRequestError) as info:
                            await _drain(other.generate(long))
                        assert info.value.field == "request_id"
                        break  # leaving the stream cancels it

            tg.start_soon(run_good, 6)
        assert good[5].tokens == expected[5] and good[6].tokens == expected[6]
        # The same connections keep working.
        await _fresh_request_matches(client, references, 0)
        await _fresh_request_matches(other, references, 1)
        await wait_idle(client)


async def test_an_oversized_request_fails_alone(server):
    from runtime import MlxrtError

    async with Client.connect(server.socket) as client:
        limit = client.welcome.limits.max_frame_bytes
        other = client.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=600, ignore_eos=True, request_id="bystander"))
        async with contextlib.aclosing(other):
            assert isinstance(await other.__anext__(), TokenDelta)
            error = None
            try:
                await collect(client.generate(GenerateRequest(prompt="x" * (limit + 1024), request_id="oversized")))
            except Exception as exc:
                error = type(exc)  # not the exception itself: what it references must be collectable below
            gc.collect()  # streams the client failed to close warn here, inside this test
            assert error is not None and issubclass(error, MlxrtError), f"expected a typed error, got {error!r}"
            rest = await collect(other)
            assert rest.last.finish_reason == "length", "the oversized request took its connection's other requests down"
        await wait_idle(client)


async def test_full_queue_answers_busy_quickly(busy_server):
    outcomes: dict[int, tuple[str, int]] = {}  # request -> (how it ended, its place in the order of endings)
    async with Client.connect(busy_server.socket) as client:

        async def submit(i: int) -> None:
            request = GenerateRequest(prompt_ids=[1, 2, 3, i], max_tokens=400, ignore_eos=True, request_id=f"busy-{i}")
            try:
                outcome = await collect(client.generate(request))
                outcomes[i] = (outcome.last.finish_reason, len(outcomes))
            except ServerBusyError:
                outcomes[i] = ("busy", len(outcomes))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(submit, i)
        busy = [t for reason, t in outcomes.values() if reason == "busy"]
        done = [t for reason, t in outcomes.values() if reason == "length"]
        assert len(busy) + len(done) == 6, outcomes
        assert busy and done, outcomes
        # Refusals come at once, while the admitted request is still generating.
        assert max(busy) < min(done), outcomes
        await wait_idle(client)


async def _assert_still_serving(process) -> None:
    """The departed connection is gone, the server answers a new one and does not exit."""
    try:
        async with Client.connect(process.socket) as client:
            await wait_idle(client, connections=1)
            outcome = await collect(client.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=5, ignore_eos=True)))
            assert outcome.last.finish_reason == "length"
    except Exception as exc:
        raise AssertionError(f"the server stopped serving ({exc!r}):\n{process.stderr()}") from exc
    assert process.wait_exit(0.2) is None, f"the server crashed:\n{process.stderr()}"


def _start_runner(raw: RawConnection, rid: str) -> None:
    raw.hello()
    raw.send(Generate(request=GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=5000, ignore_eos=True, request_id=rid)))
    while not isinstance(raw.read(), TokenDelta):
        pass


async def test_refusing_a_request_of_a_departed_client_does_not_crash_the_server(busy_server):
    """Regression (bug in 4251e0d..d2bc91e, fixed in be3bfab): Connection._forward sent its refusals from inside except clauses,
    so BrokenResourceError from a closed outbox escaped and took the whole server down."""
    # Runs after test_full_queue_answers_busy_quickly: should it regress, it kills busy_server.
    process = busy_server
    # Deterministic: a 1 MB prompt takes ~0.5 s to tokenize before it is refused as too large; the
    # client leaves at once, the running request's Finished(cancelled) hits the closed socket and the
    # writer stops; then the refusal is sent into the closed outbox.
    with RawConnection(process.socket) as raw:
        _start_runner(raw, "runner")
        raw.send(Generate(request=GenerateRequest(prompt="hello world " * 90_000, request_id="too-large")))
    await _assert_still_serving(process)
    # Racy but usually immediate: busy refusals for a client that has just left.
    for attempt in range(2):
        with RawConnection(process.socket) as raw:
            _start_runner(raw, f"runner-{attempt}")
            requests = [Generate(request=GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=50, request_id=f"extra-{attempt}-{i}")) for i in range(6)]
            raw.send_bytes(b"".join(encode_frame(r) for r in requests))
        await _assert_still_serving(process)


async def test_a_server_killed_mid_stream_surfaces_as_connection_lost(busy_server):
    """SIGKILL: no Finished can come; the client must say so with ConnectionLostError, not hang."""
    from net import socket_path
    from net.client import ConnectionLostError

    # Last user of busy_server: it does not survive this test.
    process = busy_server
    async with Client.connect(process.socket) as client:
        received = 0
        with anyio.fail_after(15), pytest.raises(ConnectionLostError):
            async for event in client.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=5000, ignore_eos=True)):
                if isinstance(event, TokenDelta):
                    received += 1
                    if received == 1:
                        process.proc.kill()
        assert received >= 1
        assert process.wait_exit(10) == -signal.SIGKILL
    # The socket file outlives a killed server; the next server's preparation removes it as stale.
    assert process.socket.is_socket()
    socket_path.prepare(process.socket, 0o600)
    assert not process.socket.exists()


async def test_cancel_sent_right_after_generate_is_honoured(server):
    """Regression (bug in 4251e0d..d2bc91e, fixed in be3bfab): a Cancel read before the request's session existed (Runtime._prepare
    awaits the tokenizer thread) was dropped by Runtime.cancel, and the request ran to max_tokens."""
    with RawConnection(server.socket, timeout=30) as raw:
        raw.hello()
        rid = "instant-cancel"
        request = GenerateRequest(prompt_ids=[2, 3, 4], max_tokens=1000, ignore_eos=True, request_id=rid)
        # Both frames in one write: the server reads them back to back.
        raw.send_bytes(encode_frame(Generate(request=request)) + encode_frame(Cancel(request_id=rid)))
        tokens, finished = raw.read_until_finished(rid)
        # The request was accepted (it is in the connection's set) when the Cancel arrived.
        assert finished.finish_reason == "cancelled", f"the cancel was lost: {len(tokens)} tokens, {finished.finish_reason}"


# -- shutdown ----------------------------------------------------------------------


async def test_sigterm_cancels_in_flight_requests_and_exits_cleanly(doomed_server):
    process = doomed_server
    with RawConnection(process.socket, timeout=15) as raw, RawConnection(process.socket, timeout=15) as late:
        raw.hello()
        late.hello()
        raw.send(Generate(request=GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=5000, ignore_eos=True, request_id="raw-inflight")))
        while not isinstance(first := raw.read(), TokenDelta):
            pass

        async with Client.connect(process.socket) as client:
            request = GenerateRequest(prompt_ids=[7, 7, 7], max_tokens=5000, ignore_eos=True, request_id="inflight")
            outcome, signalled = Outcome(), False
            with anyio.fail_after(15):
                async for event in client.generate(request):
                    outcome.events.append(event)
                    if isinstance(event, TokenDelta):
                        outcome.tokens += event.token_ids
                        if not signalled:
                            signalled = True
                            process.proc.send_signal(signal.SIGTERM)
                    elif isinstance(event, Finished):
                        outcome.finished.append(event)
            # Guaranteed: rt.shutdown() cancels every live session before the
            # connections are flushed, so the stream ends with Finished(cancelled).
            assert outcome.last.finish_reason == "cancelled"
            assert outcome.last.usage.completion_tokens == len(outcome.tokens) < 5000

        # The raw connection gets its request's Finished(cancelled), then end of stream.
        tokens, finished = raw.read_until_finished("raw-inflight")
        assert finished.finish_reason == "cancelled"
        assert finished.usage.completion_tokens == len(first.token_ids) + len(tokens) < 5000
        assert raw.read_until_eof() == []

        # A request sent after the server reported the signal never starts: it is refused
        # as `shutting_down`, or the connection has already been closed.
        assert "finishing" in process.wait_for_output("SIGTERM")
        if late.send(Generate(request=GenerateRequest(prompt_ids=[1, 2], max_tokens=5, request_id="late"))):
            messages = late.read_until_eof()
            assert all(isinstance(m, Error) and m.code == "shutting_down" and m.request_id == "late" for m in messages), messages

    assert process.wait_exit(10) == 0, process.stderr()
    assert not process.socket.exists()
    assert not process.alive
