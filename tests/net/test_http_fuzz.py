"""The HTTP front under a seeded fuzz, as the socket server is in tests/integration/test_fuzz.py:
hundreds of hostile requests (wrong types and ranges in every field, deep nesting, broken and
oversized bodies, odd headers, wrong routes and methods, clients that leave mid-answer). Every
answer is a 2xx or a typed 4xx (503 only for a full server), none a 500; afterwards the
runtime is idle and serves exactly what it served before."""

from __future__ import annotations

import json
import random
from collections import Counter

import anyio
import pytest

from tests.support.http_serving import raw_request, serving, wait_runtime_idle

pytestmark = [pytest.mark.server, pytest.mark.slow]

NUM_REQUESTS = 800
MAX_TOKENS = 4


class HttpFuzzer:
    def __init__(self, seed: int, model: str):
        self.rng = random.Random(seed)
        self.model = model

    def value(self, depth: int = 0):
        rng = self.rng
        kinds = ["int", "big", "neg", "float", "str", "unicode", "none", "bool", "list", "dict", "deep"]
        kind = rng.choice(kinds if depth < 3 else kinds[:8])
        return {
            "int": lambda: rng.randrange(100),
            "big": lambda: 10 ** rng.choice([12, 30, 400]),
            "neg": lambda: -rng.randrange(1, 10**6),
            "float": lambda: rng.choice([0.5, 1e308, -0.0, 3.7]),
            "str": lambda: rng.choice(["", "x", "a" * 5000, "\r\n", "<|im_end|>"]),
            "unicode": lambda: rng.choice(["snow\u2603", "\ud7ff", "\x00"]),
            "none": lambda: None,
            "bool": lambda: rng.choice([True, False]),
            "list": lambda: [self.value(depth + 1) for _ in range(rng.randrange(3))],
            "dict": lambda: {rng.choice(["type", "role", "content", "name", "x"]): self.value(depth + 1) for _ in range(rng.randrange(3))},
            "deep": lambda: json.loads("[" * 300 + "]" * 300),
        }[kind]()

    def chat(self) -> dict:
        rng = self.rng
        body: dict = {"model": rng.choice([self.model, self.model, "nope", 3]), "max_tokens": rng.choice([MAX_TOKENS, MAX_TOKENS, 0, -1, 10**9])}
        body["messages"] = rng.choice(
            [
                [{"role": "user", "content": "hi"}],
                [{"role": rng.choice(["user", "system", "tool", "wizard"]), "content": self.value()}],
                [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}]}],
                self.value(),
            ]
        )
        return self._extras(body)

    def completion(self) -> dict:
        rng = self.rng
        body: dict = {"model": self.model, "max_tokens": rng.choice([MAX_TOKENS, 2, 0, "4"])}
        body["prompt"] = rng.choice(["def f():", [5, 6, 7], [[5, 6], [7]], [-1, 10**9], "", self.value()])
        return self._extras(body)

    def _extras(self, body: dict) -> dict:
        rng = self.rng
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            key = rng.choice(
                [
                    "temperature",
                    "top_p",
                    "seed",
                    "stop",
                    "logprobs",
                    "top_logprobs",
                    "n",
                    "stream",
                    "response_format",
                    "tools",
                    "tool_choice",
                    "request_id",
                    "user",
                ]
            )
            body[key] = rng.choice(
                [
                    self.value(),
                    {"type": "json_schema", "json_schema": {"name": "s", "schema": self.value()}},
                    {"type": "grammar", "ebnf": rng.choice(["root ::= root", "root ::= (", 'root ::= "a"'])},
                    f"id-{rng.randrange(10**6)}",
                ]
            )
        return body

    def request(self) -> tuple[bytes, bytes, str]:
        """(head, body, how the client ends: "read" or "leave")."""
        rng = self.rng
        kind = rng.randrange(10)
        path = rng.choice(["/v1/chat/completions", "/v1/completions"])
        if kind < 6:
            payload = self.chat() if path.endswith("chat/completions") else self.completion()
            try:
                body = json.dumps(payload).encode()
            except ValueError:
                body = b"{}"
        elif kind == 6:
            body = rng.choice([b"{not json", b"\xff\xfe\x00", b"[" * 100_000 + b"]" * 100_000, b'{"model": 1e999}', b""])
        elif kind == 7:
            path = rng.choice(["/v1/models/" + "x" * 3000, "/v1/../../etc/passwd", "/metrics", "/health", "/v1/embeddings"])
            body = b""
        else:
            body = json.dumps(self.completion()).encode()
        method = ("POST" if rng.random() < 0.9 else rng.choice(["GET", "PUT", "DELETE"])) if kind != 7 else "GET"
        headers = [f"{method} {path} HTTP/1.1", "Host: " + rng.choice(["localhost", "127.0.0.1:1", "[::1]"]), f"Content-Length: {len(body)}"]
        headers.append("Content-Type: " + rng.choice(["application/json", "application/json; charset=utf-8", "application/json", "text/plain"]))
        if rng.random() < 0.1:
            headers.append("X-Junk: " + "j" * 6000)
        ending = "leave" if rng.random() < 0.1 else "read"
        return ("\r\n".join(headers) + "\r\n").encode(), body, ending


async def _leave_early(url: str, head: bytes, body: bytes) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(head + b"\r\n" + body[: len(body) // 2])  # half a body, then gone


async def test_hundreds_of_hostile_http_requests_are_typed_refusals_and_leave_nothing_behind():
    # (Refusals paced fast enough for the fuzz to take seconds, slow enough that some are held.)
    async with serving(http_max_connections=16, body_timeout_s=2.0, http_header_timeout_s=5.0, client_refusals_per_s=200.0) as served:
        prompt = [5, 6, 7, 8, 9]
        async with served.client() as client:
            before = await client.completions.create(model=served.model, prompt=prompt, max_tokens=8, temperature=0)
        fuzzer = HttpFuzzer(seed=26, model=served.model)
        statuses: Counter = Counter()

        async def one(head: bytes, body: bytes, ending: str) -> None:
            if ending == "leave":
                await _leave_early(served.url, head, body)
                return
            status, _, answer = await raw_request(served.url, head, body)
            statuses[status] += 1
            assert status < 500 or status == 503, (head[:200], body[:200], answer[:300])

        for _ in range(NUM_REQUESTS // 8):  # eight at a time
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(one, *fuzzer.request())
        assert {200, 400, 404, 405, 415} <= set(statuses), statuses
        stats = await wait_runtime_idle(served.runtime, timeout=60)
        assert stats.kv.live_tokens == 0 and stats.kv.reserved_tokens == 0
        async with served.client() as client:
            after = await client.completions.create(model=served.model, prompt=prompt, max_tokens=8, temperature=0)
        assert after.choices[0].text == before.choices[0].text
