"""Raw-socket robustness of `mlxrt serve`: malformed frames get typed errors, never a crash."""

from __future__ import annotations

import random
import sys
from collections import Counter

import msgspec
import pytest

from net.client import Client
from net.framing import HEADER
from protocols.api import Finished, GenerateRequest, TokenDelta
from protocols.wire import PROTOCOL_VERSION, SUPPORTED_PROTOCOL_VERSIONS, Cancel, Error, Generate, GetStats, Hello, Stats
from tests.support.config import CHUNK
from tests.support.events import collect
from tests.support.mlx_reference import greedy_tokens, load_reference
from tests.support.serve import running_server, wait_idle
from tests.support.waiting import wait_until
from tests.support.wire import RawConnection

pytestmark = pytest.mark.server

HANDSHAKE_TIMEOUT_S = 0.5
STALL_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 6
MAX_FRAME_BYTES = 8 * 1024 * 1024  # the server's default
MAX_TOKENS = 16


def pack(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    options = {"handshake_timeout_s": HANDSHAKE_TIMEOUT_S, "client_stall_timeout_s": STALL_TIMEOUT_S, "max_connections": MAX_CONNECTIONS}
    with running_server(tmp_path_factory.mktemp("frames"), server=options) as process:
        yield process


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], list[int]]:
    model, tokenizer = load_reference("builtin:tiny")
    prompt = [random.Random(17).randrange(1000) for _ in range(2 * CHUNK + 5)]
    return prompt, greedy_tokens(model, tokenizer, prompt, MAX_TOKENS)


def codes(messages) -> list[str]:
    assert all(isinstance(m, Error) for m in messages), messages
    return [m.code for m in messages]


def peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


# 20 frames that are not msgpack at all (or not exactly one msgpack value).
INVALID_MSGPACK = [
    b"",
    b"\xc1",  # the one byte msgpack never uses
    b"\xc1\xc1\xc1",
    b"\x92\x01",  # array of 2 with one element
    b"\x81\xa4type",  # map missing its value
    b"\xd9\x05ab",  # str8 announcing 5 bytes, 2 present
    b"\xdb\xff\xff\xff\xffabc",  # str32 announcing 4 GiB
    b"\xdd\xff\xff\xff\xff",  # array32 announcing 4 G elements
    b"\xdf\xff\xff\xff\xff",  # map32 announcing 4 G pairs
    b"\xc6\x00\x00\x10\x00\x00",  # bin32, truncated
    b"\xcb\x00\x00",  # float64, truncated
    b"\xcf\x01",  # uint64, truncated
    b"\xc7\x05\x01ab",  # ext8, truncated
    pack({"type": "GetStats"}) + b"\x00",  # trailing bytes
    pack({"type": "GetStats"}) + pack({"type": "GetStats"}),  # two values in one frame
    b"\x82\xa4type\xa8GetStats",  # map of 2 with 1 pair
    b"\xff" * 64,
    bytes(range(256)),
    b"\x85" + b"\xc0" * 3,
    b"\xa5typ",
]

# 20 well-formed msgpack values that are not valid client messages.
WRONG_TYPES = [
    {"type": "Generate", "request": {"prompt_ids": "abc"}},
    {"type": "Generate", "request": {"prompt_ids": [1, "x"]}},
    {"type": "Generate", "request": "nope"},
    {"type": "Generate"},
    {"type": "Generate", "request": {"prompt_ids": [1], "max_tokens": "ten"}},
    {"type": "Generate", "request": {"prompt_ids": [1], "sampling": {"temperature": "hot"}}},
    {"type": "Generate", "request": {"prompt_ids": [1], "unknown_field": 1}},
    {"type": "Generate", "request": {"prompt_ids": [1], "stop": "x"}},
    {"type": "Generate", "request": {"prompt_ids": [1], "ignore_eos": "yes"}},
    {"type": "Generate", "request": {"prompt_ids": [1], "priority": 1.5}},
    {"type": "Generate", "request": {"prompt_ids": [1]}, "extra": True},
    {"type": "Cancel"},
    {"type": "Cancel", "request_id": 5},
    {"type": "GetStats", "extra": 1},
    {"type": "Hello", "protocol_version": "1"},
    {"type": 7},
    {"request": {"prompt_ids": [1]}},
    [1, 2, 3],
    5,
    None,
]

UNKNOWN_TAGS = [
    {"type": "Launch"},
    {"type": "Launch", "payload": 1},
    {"type": "generate", "request": {"prompt_ids": [1]}},
    {"type": ""},
    {"type": "Welcome"},
    {"type": "Error", "code": "internal", "message": "x"},
    {"type": "Stats"},
    {"type": "TokenDelta", "request_id": "a", "token_ids": [1], "text": "x"},
    {"type": "Finished"},
    {"type": "Shutdown"},
]

# First frames that are not a valid Hello: each gets protocol_error naming the supported versions,
# and the connection closes.
NOT_HELLO_FIRST = [
    pack({"type": "Generate", "request": {"prompt_ids": [1, 2, 3], "request_id": "early"}}),
    pack({"type": "GetStats"}),
    pack({"type": "Cancel", "request_id": "x"}),
    pack({"type": "Hello", "protocol_version": max(SUPPORTED_PROTOCOL_VERSIONS) + 1}),
    pack({"type": "Hello", "protocol_version": min(SUPPORTED_PROTOCOL_VERSIONS) - 1}),
    pack({"type": "Hello"}),
    pack({"type": "Launch"}),
    b"\xc1",
    b"",
]


def test_a_hundred_malformed_frames_are_survived(server, reference):
    rng = random.Random(99)
    path = server.socket
    sent: Counter = Counter()
    peak_before = peak_rss_kib(server.proc.pid) if sys.platform == "linux" else None

    # Truncated frames: the length says 100, 10 bytes follow, then the client closes.
    for i in range(10):
        with RawConnection(path) as raw:
            if i % 2 == 0:
                raw.hello(SUPPORTED_PROTOCOL_VERSIONS[i % len(SUPPORTED_PROTOCOL_VERSIONS)])
            raw.send_bytes(HEADER.pack(100) + rng.randbytes(10))
            sent["truncated"] += 1
            if i % 4 == 3:
                continue  # plain close, nothing read
            raw.shutdown_write()
            # After Hello the server just drops the connection; before it, the handshake fails.
            assert codes(raw.read_until_eof()) == ([] if i % 2 == 0 else ["protocol_error"])

    # Oversize length prefixes, no body: refused from the prefix alone, then closed by the server.
    for size in [2**31, 2**32 - 1, MAX_FRAME_BYTES + 1, 2**30, 3 * 2**30, 2**24 * 100, 2**31 + 7, 2**28, 10**9, 2**32 - 2]:
        with RawConnection(path) as raw:
            raw.hello()
            raw.send_bytes(HEADER.pack(size))
            sent["oversize"] += 1
            messages = raw.read_until_eof()
            assert codes(messages) == ["frame_too_large"], size
            assert str(size) in messages[0].message
    # Nothing near the announced sizes was ever allocated.
    if peak_before is not None:
        assert peak_rss_kib(server.proc.pid) - peak_before < 256 * 1024

    # Invalid msgpack: each frame answered with invalid_message; the connection stays usable.
    prompt, expected = reference
    with RawConnection(path, timeout=30) as raw:
        raw.hello()
        for body in INVALID_MSGPACK:
            raw.send_body(body)
            sent["invalid_msgpack"] += 1
        answers = [raw.read() for _ in INVALID_MSGPACK]
        assert codes(answers) == ["invalid_message"] * len(INVALID_MSGPACK)
        raw.send(Generate(request=GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, request_id="after-garbage")))
        tokens, finished = raw.read_until_finished("after-garbage")
        assert tokens == expected and finished.finish_reason in ("length", "stop")

    # Valid msgpack of the wrong shape, then unknown tags: invalid_message each, connection usable.
    with RawConnection(path) as raw:
        raw.hello()
        for value in WRONG_TYPES:
            raw.send_body(pack(value))
            sent["wrong_types"] += 1
        for value in UNKNOWN_TAGS:
            raw.send_body(pack(value))
            sent["unknown_tags"] += 1
        answers = [raw.read() for _ in range(len(WRONG_TYPES) + len(UNKNOWN_TAGS))]
        assert codes(answers) == ["invalid_message"] * len(answers)
        assert all(a.request_id is None for a in answers)
        raw.send(GetStats())
        assert isinstance(raw.read(), Stats)

    # A first frame that is not Hello: protocol_error, and the server closes the connection.
    for body in NOT_HELLO_FIRST:
        with RawConnection(path) as raw:
            raw.send_body(body)
            sent["not_hello_first"] += 1
            refusals = raw.read_until_eof()
            assert codes(refusals) == ["protocol_error"]
            assert refusals[0].supported_versions == list(SUPPORTED_PROTOCOL_VERSIONS)
    with RawConnection(path) as raw:
        raw.send_bytes(HEADER.pack(2**31))  # oversize before Hello
        sent["not_hello_first"] += 1
        assert codes(raw.read_until_eof()) == ["protocol_error"]

    # Random garbage, before and after Hello: only Error frames come back, then the connection ends.
    for i in range(20):
        with RawConnection(path) as raw:
            after_hello = i % 2 == 0
            if after_hello:
                raw.hello()
            raw.send_bytes(rng.randbytes(rng.randint(1, 300)))
            sent["garbage"] += 1
            raw.shutdown_write()
            got = codes(raw.read_until_eof())
            if after_hello:
                assert set(got) <= {"invalid_message", "frame_too_large"}, got
            else:
                assert got == ["protocol_error"]

    assert sum(sent.values()) == 100, sent
    assert server.alive, server.stderr()


async def test_after_the_abuse_the_server_still_serves_correctly(server, reference):
    """Runs after the malformed frames: tokens match mlx-lm and nothing was left behind."""
    prompt, expected = reference
    async with Client.connect(server.socket) as client:
        outcome = await collect(client.generate(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS)))
        assert outcome.tokens == expected
        stats = await wait_idle(client, connections=1)
        assert stats.live_requests == 0 and stats.kv.live_tokens == 0 and stats.kv.reserved_tokens == 0
    assert server.alive


def test_silent_connections_are_closed_after_the_handshake_timeout(server):
    timeouts_before = server.log_text().count('"handshake_timeout"')
    with RawConnection(server.socket) as silent, RawConnection(server.socket) as partial, RawConnection(server.socket) as greeted:
        greeted.hello()
        partial.send_bytes(HEADER.pack(20) + b"\x81")  # a Hello that never completes
        assert silent.read_until_eof() == []  # the server closes without a word (move_on_after)
        assert codes(partial.read_until_eof()) in ([], ["protocol_error"])
        # Both were closed by the handshake timeout (the server says so), not by anything sooner.
        assert server.log_text().count('"handshake_timeout"') - timeouts_before >= 2, server.stderr()
        # A connection past its handshake may stay idle for longer than the timeout.
        greeted.send(GetStats())
        assert isinstance(greeted.read(), Stats)


def test_protocol_errors_name_the_request_and_keep_the_connection(server):
    with RawConnection(server.socket, timeout=30) as raw:
        raw.hello()
        raw.send(Generate(request=GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=5)))  # no request_id
        error = raw.read()
        assert isinstance(error, Error) and error.code == "invalid_request" and error.field == "request_id"

        live = GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=5000, ignore_eos=True, request_id="live")
        raw.send(Generate(request=live))
        while not isinstance(raw.read(), TokenDelta):
            pass
        raw.send(Generate(request=live))  # the same id again, while live
        raw.send(Cancel(request_id="nobody"))
        raw.send(Hello(protocol_version=PROTOCOL_VERSION))  # a second Hello
        raw.send(GetStats())
        errors: list[Error] = []
        stats: Stats | None = None
        while len(errors) < 3 or stats is None:
            message = raw.read()
            assert message is not None
            if isinstance(message, Error):
                errors.append(message)
            elif isinstance(message, Stats):
                stats = message
            else:
                assert isinstance(message, TokenDelta) and message.request_id == "live", message
        assert [(e.code, e.request_id) for e in errors] == [("duplicate_request", "live"), ("unknown_request", "nobody"), ("protocol_error", None)]
        assert stats.live_requests >= 1

        raw.send(Cancel(request_id="live"))
        _, finished = raw.read_until_finished("live")
        assert isinstance(finished, Finished) and finished.finish_reason == "cancelled"


async def test_a_client_that_stops_reading_is_dropped(server):
    """Its frames fill the socket and its outbox; the writer gives up after client_stall_timeout_s."""
    async with Client.connect(server.socket) as client:
        await wait_idle(client, connections=1)
        stalls_before = server.log_text().count('"client_stalled"')
        with RawConnection(server.socket, timeout=30) as stalled:
            stalled.hello()
            stalled.send(Generate(request=GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=2000, ignore_eos=True, request_id="stalled")))
            # Never read. The request would end by itself, but only the server can close the connection.
            stats = await wait_idle(client, timeout=15, connections=1)
            # Dropped by the stall deadline (its warning logged), not for another reason.
            wait_until(lambda: server.log_text().count('"client_stalled"') > stalls_before, message=server.stderr)
            assert stats.kv.live_tokens == 0 and stats.kv.reserved_tokens == 0
            frames = stalled.read_until_eof()  # what was buffered, then the end
            assert frames and all(isinstance(f, (TokenDelta, Finished)) for f in frames)
        await collect(client.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=3)))


async def test_connections_beyond_max_connections_are_refused(server):
    from runtime import ServerBusyError

    async with Client.connect(server.socket) as client:
        await wait_idle(client, connections=1)
        others = [RawConnection(server.socket) for _ in range(MAX_CONNECTIONS - 1)]
        try:
            for raw in others:
                raw.hello()
            assert (await client.stats()).connections == MAX_CONNECTIONS
            with RawConnection(server.socket) as extra:
                extra.send(Hello(protocol_version=PROTOCOL_VERSION))
                assert codes(extra.read_until_eof()) == ["busy"]
            with pytest.raises(ServerBusyError):
                async with Client.connect(server.socket):
                    pass
        finally:
            for raw in others:
                raw.close()
        await wait_idle(client, connections=1)
    async with Client.connect(server.socket) as again:
        assert (await again.stats()).connections >= 1


def test_deeply_nested_msgpack_is_an_invalid_message(server):
    """Regression (bug in 4251e0d..d2bc91e, fixed in be3bfab): msgspec raises RecursionError on deeply nested msgpack (possible inside
    GenerateRequest.messages, typed Any); only DecodeError/ValidationError were caught, so it killed the server."""
    # Last in this file: should it regress, it kills the module's server.
    process = server
    nested = b"\x91" * 100_000 + b"\xc0"  # [[[[...None...]]]]
    body = pack({"type": "Generate", "request": {"messages": [{"role": "user", "content": "x"}]}})
    body = body.replace(pack([{"role": "user", "content": "x"}]), b"\x91\x81\xa7content" + nested)
    assert msgspec.msgpack.Decoder(list).decode(b"\x91" * 10 + b"\xc0")  # the shape is valid msgpack
    with RawConnection(process.socket) as raw:
        raw.hello()
        raw.send_body(body)
        answer = raw.read()
        assert isinstance(answer, Error) and answer.code == "invalid_message", f"got {answer!r}; server exit code {process.wait_exit(5)}:\n{process.stderr()}"
        raw.send(GetStats())
        assert isinstance(raw.read(), Stats)
    with RawConnection(process.socket) as raw:  # the same frame instead of Hello
        raw.send_body(body)
        assert codes(raw.read_until_eof()) == ["protocol_error"]
    assert process.alive
