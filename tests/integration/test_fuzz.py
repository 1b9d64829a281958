"""Thousands of hostile frames against a live server, then the server must be as it was.

A seeded generator (the same frames every run) mixes random bytes, truncated and
oversize frames, messages of the wrong shape, deep nesting, broken schemas and tool
definitions, valid requests (some cancelled, some abandoned) and bursts followed by
abrupt closes, over many connections. Afterwards: the server is alive, a greedy request
returns its reference output, nothing is live, and KV and memory are back near baseline.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import msgspec
import pytest

from net.client import Client
from net.framing import HEADER, encode_frame
from protocols.api import Finished, GenerateRequest
from protocols.wire import PROTOCOL_VERSION, Error, GetStats, Hello
from tests.support.events import collect
from tests.support.mlx_reference import greedy_tokens, load_reference
from tests.support.serve import running_server, wait_idle
from tests.support.wire import RawConnection

pytestmark = [pytest.mark.server, pytest.mark.slow]

NUM_CONNECTIONS = 60
FRAMES_PER_CONNECTION = 60  # 3,600 frames in all
MAX_TOKENS = 10


def pack(value) -> bytes:
    return msgspec.msgpack.encode(value)


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


class Fuzzer:
    """Frames of every kind a careless or hostile client sends, from one seed."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.count = 0

    def request_id(self) -> str:
        return self.rng.choice([f"f{self.count}", "dup", "", "a/b", "x" * 300, "../x", f"n{self.rng.randrange(50)}"])

    def schema(self, depth: int = 0):
        rng = self.rng
        kind = rng.choice(["object", "array", "string", "integer", "number", "boolean", "bad", "ref", "enum"])
        if depth > 3 or kind in ("integer", "number", "boolean"):
            return {"type": kind if kind != "bad" else "nope", "minimum": rng.choice([0, "x", None])}
        if kind == "object":
            return {
                "type": "object",
                "properties": {f"p{i}": self.schema(depth + 1) for i in range(rng.randrange(4))},
                "required": rng.choice([[], ["p0"], "p0", [1]]),
            }
        if kind == "array":
            return {"type": "array", "items": self.schema(depth + 1), "minItems": rng.choice([0, 2, -1, "2"])}
        if kind == "string":
            return {"type": "string", "minLength": rng.choice([0, 3, "x", -2, None]), "maxLength": rng.choice([5, 1, 0, 1.5])}
        if kind == "ref":
            return {"$ref": rng.choice(["#/nope", "#", "http://x"])}
        if kind == "enum":
            return {"enum": rng.choice([[], [1, "a"], "x"])}
        return rng.choice([[], "schema", 3, None])

    def tool(self):
        rng = self.rng
        return rng.choice(
            [
                {"type": "function", "function": {"name": rng.choice(["f", "", 3, None]), "parameters": self.schema()}},
                {"type": "function", "function": "f"},
                {"function": {"name": "g", "parameters": rng.choice([[1], "x", self.schema()])}},
                "tool",
            ]
        )

    def generate(self) -> GenerateRequest | dict:
        rng = self.rng
        rid = self.request_id()
        prompt = rng.choice(
            [
                {"prompt_ids": [rng.randrange(1024) for _ in range(rng.randrange(1, 40))]},
                {"prompt_ids": [rng.randrange(-5, 5000) for _ in range(5)]},
                {"prompt": "def f():" * rng.randrange(1, 30)},
                {"messages": [{"role": "user", "content": "hi"}]},
                {"messages": rng.choice([[], [1], [{"role": 3}], [{"content": [[[["deep"]]]]}]])},
                {},
            ]
        )
        extra = rng.choice(
            [
                {},
                {"response_format": {"type": "json_schema", "json_schema": {"schema": self.schema()}}},
                {
                    "response_format": rng.choice(
                        [{"type": "regex", "pattern": "(("}, {"type": "grammar", "ebnf": "root ::= x"}, {"type": "json_object"}, "json", {"type": 5}]
                    )
                },
                {
                    "tools": [self.tool() for _ in range(rng.randrange(1, 3))],
                    "tool_choice": rng.choice(
                        ["required", "auto", {"function": "f"}, {"function": None}, {"type": "function", "function": {"name": "f"}}, "x"]
                    ),
                    "messages": [{"role": "user", "content": "hi"}],
                },
                {"stop": rng.choice([["a"] * 100, ["\n"], [""], [3]])},
                {
                    "sampling": rng.choice(
                        [{"temperature": -1}, {"top_p": 0}, {"top_k": -3}, {"temperature": 0.8, "seed": 3}, {"seed": -1}, {"penalty_context_size": 10**9}]
                    )
                },
                {"max_tokens": rng.choice([0, -1, 10**12, 5])},
                {"checkpoint_every": rng.choice([-1, 2, "x"])},
                {"top_logprobs": rng.choice([50, -1, 3]), "logprobs": True},
            ]
        )
        fields = {"request_id": rid, "max_tokens": rng.choice([2, 4, MAX_TOKENS]), **prompt, **extra}
        return {"type": "Generate", "request": fields}

    def deep(self) -> bytes:
        depth = self.rng.choice([100, 1000, 100_000])
        return b"\x91" * depth + b"\xc0"

    def body(self) -> bytes:
        rng = self.rng
        self.count += 1
        choice = rng.randrange(12)
        if choice == 0:
            return rng.randbytes(rng.randrange(0, 200))
        if choice == 1:
            return self.deep()
        if choice == 2:
            return pack({"type": rng.choice(["Generate", "Resume", "Cancel", "GetStats", "Hello", "Nope", 5]), "request": rng.choice([1, "x", [], {}])})
        if choice == 3:
            return pack({"type": "Cancel", "request_id": self.request_id()})
        if choice == 4:
            return pack({"type": "Resume", "request_id": self.request_id()})
        if choice == 5:
            return encode_frame(GetStats())[HEADER.size :]
        if choice == 6:
            return encode_frame(Hello(protocol_version=PROTOCOL_VERSION))[HEADER.size :]
        return pack(self.generate())

    def connection_bytes(self) -> tuple[bytes, str]:
        """Frames for one connection, and how it ends: read all, close abruptly, truncate, oversize."""
        rng = self.rng
        frames = b"".join(frame(self.body()) for _ in range(FRAMES_PER_CONNECTION))
        ending = rng.choice(["read", "read", "close", "truncate", "oversize", "burst"])
        if ending == "truncate":
            frames += HEADER.pack(1000) + b"\x81"
        elif ending == "oversize":
            frames += HEADER.pack(1 << 31)
        elif ending == "burst":
            frames += encode_frame(GetStats()) * 5000
        return frames, ending


def _run_connection(socket_path, data: bytes, ending: str, answers: Counter, failures: list) -> None:
    try:
        with RawConnection(socket_path, timeout=30) as raw:
            raw.hello()
            sent = raw.send_bytes(data)
            if ending == "read" and sent:
                raw.shutdown_write()
                for message in raw.read_until_eof(limit=1_000_000):
                    if isinstance(message, Error):
                        answers[message.code] += 1
                    elif isinstance(message, Finished):
                        answers["finished"] += 1
    except (OSError, AssertionError, msgspec.DecodeError) as exc:
        failures.append(repr(exc))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    options = {"client_stall_timeout_s": 2.0, "idle_timeout_s": 5.0, "frame_timeout_s": 2.0, "max_connections": 80}
    with running_server(
        tmp_path_factory.mktemp("fuzz"), server=options, scheduler={"max_batch_size": 8, "prefill_chunk_size": 16, "max_queued_requests": 64}
    ) as process:
        yield process


async def test_thousands_of_hostile_frames_leave_the_server_as_it_was(server):
    model, tokenizer = load_reference("builtin:tiny")
    prompt = [random.Random(31).randrange(1000) for _ in range(21)]
    expected = greedy_tokens(model, tokenizer, prompt, MAX_TOKENS)
    async with Client.connect(server.socket) as client:
        assert (await collect(client.generate(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS)))).tokens == expected
        baseline = await wait_idle(client, connections=1)
    rss_before = server.rss_kib()

    fuzzer = Fuzzer(seed=2026)
    failures: list[str] = []
    answers: Counter = Counter()
    batches = [[fuzzer.connection_bytes() for _ in range(10)] for _ in range(NUM_CONNECTIONS // 10)]
    for batch in batches:  # ten connections at a time
        threads = [threading.Thread(target=_run_connection, args=(server.socket, data, ending, answers, failures)) for data, ending in batch]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert server.alive, f"the server died:\n{server.stderr()}"
    assert fuzzer.count == NUM_CONNECTIONS * FRAMES_PER_CONNECTION
    # Every refusal is typed as the caller's fault; nothing is an internal error.
    assert answers["internal"] == 0, answers
    assert {"invalid_request", "invalid_message", "duplicate_request", "finished"} <= set(answers), answers

    async with Client.connect(server.socket) as client:
        stats = await wait_idle(client, timeout=60, connections=1)
        outcome = await collect(client.generate(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS)))
        assert outcome.tokens == expected
        stats = await wait_idle(client, connections=1)
    assert server.alive, server.stderr()
    assert stats.live_requests == 0 and stats.kv.live_tokens == 0 and stats.kv.reserved_tokens == 0
    assert stats.kv.physical_bytes <= baseline.kv.physical_bytes + stats.kv.prefix_bytes
    assert server.rss_kib() < rss_before + 200_000, f"RSS {rss_before} -> {server.rss_kib()} KiB"
    log = server.log_text()
    assert not any(event in log for event in ("prepare_failed", "request_failed", "connection_failed")), server.stderr()
