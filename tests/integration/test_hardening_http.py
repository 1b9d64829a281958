"""Hardening, second round: 2,000 idle and slow HTTP connections against `mlxrt serve --http`
(issue 26 finding 1). Before: they held uvicorn's connection limit (/health and the API
answered 503), then the process's descriptors (socket clients could not connect, checkpoint
writes failed) and the accept loop logged a traceback per failure. Now /health, the socket and
a running request are unaffected, descriptors and the log stay bounded."""

from __future__ import annotations

import random
import re
import resource
import socket

import anyio
import pytest

from net.client import Client
from protocols import GenerateRequest
from tests.support.events import collect
from tests.support.http_serving import raw_request
from tests.support.mlx_reference import greedy_tokens, load_reference
from tests.support.serve import running_server

pytestmark = pytest.mark.server

NUM_CONNECTIONS = 2000
CAP = 256


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))


def _attack(host: str, port: int, n: int) -> list[socket.socket]:
    """n connections: most silent, some dripping half a request head."""
    sockets = []
    for i in range(n):
        try:
            sock = socket.create_connection((host, port), timeout=5)
        except OSError:
            continue  # the listen backlog is full for a moment: the server is busy closing
        if i % 4 == 0:
            try:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
            except OSError:
                pass
        sockets.append(sock)
    return sockets


async def test_two_thousand_idle_and_slow_connections_leave_health_the_socket_and_a_request_alone(tmp_path):
    _raise_fd_limit(NUM_CONNECTIONS + 512)
    model, tokenizer = load_reference("builtin:tiny")
    prompt = [random.Random(41).randrange(1000) for _ in range(17)]
    expected = greedy_tokens(model, tokenizer, prompt, 200)
    server_options = {"http": "127.0.0.1:0", "http_max_open_connections": CAP, "http_header_timeout_s": 3.0}
    with running_server(tmp_path, server=server_options) as server:
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", server.wait_for_output("OpenAI-compatible HTTP on"))[1]  # type: ignore[index]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        fds_before = server.num_fds()
        async with Client.connect(server.socket) as client, anyio.create_task_group() as tg:
            outcome: list = []

            async def running_request() -> None:
                outcome.append(await collect(client.generate(GenerateRequest(prompt_ids=prompt, max_tokens=200))))

            tg.start_soon(running_request)
            attackers = await anyio.to_thread.run_sync(_attack, host, int(port), NUM_CONNECTIONS)
            try:
                with anyio.fail_after(20):
                    status, _, body = await raw_request(url, b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
                assert status == 200 and b'"ok"' in body
                assert server.num_fds() <= fds_before + CAP + 16, f"{server.num_fds()} descriptors (cap {CAP})"
                async with Client.connect(server.socket) as other:  # the socket still takes clients
                    assert (await collect(other.generate(GenerateRequest(prompt_ids=prompt[:5], max_tokens=3)))).last.finish_reason == "length"
            finally:
                for sock in attackers:
                    sock.close()
        assert outcome[0].tokens == expected and outcome[0].last.finish_reason == "length"
        assert len(attackers) >= NUM_CONNECTIONS // 2
        log = server.log_text()
        assert len(log) < 100_000 and "Traceback" not in log, log[-3000:]
