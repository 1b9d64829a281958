"""`mlxrt serve --http`: one process and one runtime behind the Unix socket and HTTP."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from net.client import Client
from protocols.api import GenerateRequest, SamplingParams
from tests.support.config import REPO
from tests.support.events import collect
from tests.support.http_serving import raw_request
from tests.support.serve import running_server, write_config

pytestmark = pytest.mark.server


async def test_serve_answers_over_http_and_the_socket_from_one_runtime(tmp_path):
    with running_server(tmp_path, server={"http": "127.0.0.1:0"}) as server:
        line = server.wait_for_output("OpenAI-compatible HTTP on")
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)[1]  # type: ignore[index]
        curl = server.wait_for_output("curl ")
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            response = await client.chat.completions.create(model="builtin:tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
        async with Client.connect(server.socket) as native:
            outcome = await collect(native.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=7, sampling=SamplingParams(temperature=0.0))))
            stats = await native.stats()
        health, _, health_body = await raw_request(url, b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        _, _, page_body = await raw_request(url, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
        page = page_body.decode()
        assert server.stop() == 0
    assert f"{url}/v1/chat/completions" in curl and "Content-Type: application/json" in curl
    assert response.choices[0].finish_reason == "length" and outcome.last.usage.completion_tokens == 7
    assert health == 200 and json.loads(health_body)["status"] == "ok"
    generated = {s.name: s.value for family in text_string_to_metric_families(page) for s in family.samples}["mlxrt:generation_tokens_total"]
    assert generated == 5 + 7 and stats.metrics is not None and stats.metrics.generation_tokens == 12


def test_a_taken_http_port_fails_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(tmp_path)
        result = subprocess.run(
            [sys.executable, "-m", "tools.cli", "serve", "--config", str(config), "--socket", str(tmp_path / "run" / "s.sock"), "--http", f"127.0.0.1:{port}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2 and "server.http" in result.stderr and "serving" not in result.stdout


async def test_sigterm_ends_open_http_streams_and_the_server_exits(tmp_path):
    with running_server(tmp_path, server={"http": "127.0.0.1:0"}) as server:
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", server.wait_for_output("OpenAI-compatible HTTP on"))[1]  # type: ignore[index]
        events = []
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="builtin:tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
            )
            try:
                async for chunk in stream:
                    events.append(chunk)
                    if len(events) == 3:
                        server.terminate()
            except Exception as exc:  # the SDK raises the error event the stream ends with
                events.append(exc)
        code = server.wait_exit(15)
    assert code == 0
    assert 3 <= len(events) < 1500 and isinstance(events[-1], Exception) and "shutting down" in str(events[-1])
