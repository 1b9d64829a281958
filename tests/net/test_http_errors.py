"""Refusals over HTTP: OpenAI's error JSON with the status of the shared error table, the
field at fault named; API keys; body limits; a full queue; the request limit; a server still
loading; CORS."""

from __future__ import annotations

import anyio
import openai
import pytest

from net.http.server import HttpServer
from protocols.errors import ERROR_KINDS
from tests.support.config import make_config
from tests.support.http_serving import http_config, raw_request, serving

MESSAGES = [{"role": "user", "content": "hi"}]


def _post(path: str, body: bytes, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: localhost", "Content-Type: application/json", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n").encode()


async def _status_error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        await call
    return info.value


@pytest.mark.server
async def test_invalid_requests_are_400s_naming_the_field():
    async with serving() as served:
        client = served.client()
        chat = client.chat.completions.create
        cases = {
            "temperature": chat(model=served.model, messages=MESSAGES, temperature=5),
            "messages[0].role": chat(model=served.model, messages=[{"role": "robot", "content": "x"}]),
            "messages": chat(model=served.model, messages=[]),
            "top_logprobs": chat(model=served.model, messages=MESSAGES, logprobs=True, top_logprobs=30),
            "n": chat(model=served.model, messages=MESSAGES, n=65),
            "seed": chat(model=served.model, messages=MESSAGES, seed=-1),
            "response_format": chat(model=served.model, messages=MESSAGES, response_format={"type": "xml"}),  # type: ignore[arg-type,typeddict-item]
            "tool_choice": chat(model=served.model, messages=MESSAGES, tool_choice="required"),
            "logit_bias": chat(model=served.model, messages=MESSAGES, logit_bias={"99999": 5}),  # not in the vocabulary
            "max_tokens": chat(model=served.model, messages=MESSAGES, max_tokens=0),
            "suffix": client.completions.create(model=served.model, prompt="x", suffix="y"),
            "prompt": client.completions.create(model=served.model, prompt=[]),
            "prompt[1]": client.completions.create(model=served.model, prompt=[[1, 2], []]),
        }
        for field, call in cases.items():
            error = await _status_error(call)
            assert error.status_code == 400, (field, error)
            assert error.body["type"] == "invalid_request_error" and error.body["param"] == field, (field, error.body)
            assert error.body["message"]
        too_long = await _status_error(chat(model=served.model, messages=[{"role": "user", "content": "x " * 5000}], max_tokens=4))
        status, _, body = await raw_request(served.url, _post("/v1/chat/completions", b"{not json"), b"{not json")
        await client.close()
    assert too_long.status_code == 400 and too_long.body["code"] == "context_length_exceeded"
    assert status == 400 and b"invalid_request_error" in body


@pytest.mark.server
async def test_unknown_models_routes_and_methods():
    async with serving() as served:
        client = served.client()
        unknown = await _status_error(client.chat.completions.create(model="gpt-4o", messages=MESSAGES))
        card = await _status_error(client.models.retrieve("gpt-4o"))
        route, _, route_body = await raw_request(served.url, b"GET /v1/nothing HTTP/1.1\r\nHost: localhost\r\n")
        method, method_headers, method_body = await raw_request(served.url, b"GET /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        read_only, read_only_headers, _ = await raw_request(served.url, _post("/v1/models", b"{}"), b"{}")
        await client.close()
    assert unknown.status_code == 404 and unknown.body["param"] == "model" and unknown.body["code"] == "model_not_found"
    assert card.status_code == 404
    assert route == 404 and b"not_found_error" in route_body
    # A 405 says which methods the route takes (RFC 9110 15.5.6).
    assert method == 405 and method_headers.get("allow") == "POST" and b"method_not_allowed" in method_body
    assert read_only == 405 and set(read_only_headers.get("allow", "").split(", ")) == {"GET", "HEAD"}


@pytest.mark.server
async def test_an_api_key_is_required_when_set_and_compared_exactly():
    async with serving(api_key="s3cret") as served:
        async with served.client("s3cret-not") as client:
            wrong = await _status_error(client.chat.completions.create(model=served.model, messages=MESSAGES))
        async with served.client("s3cre") as client:
            prefix = await _status_error(client.models.list())
        missing, headers, _ = await raw_request(served.url, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")
        metrics, _, _ = await raw_request(served.url, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
        health, _, _ = await raw_request(served.url, b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        client = served.client("s3cret")
        ok = await client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=2)
        await client.close()
    assert wrong.status_code == prefix.status_code == missing == metrics == 401
    assert wrong.body["type"] == "authentication_error" and headers["www-authenticate"] == "Bearer"
    assert health == 200 and ok.choices[0].finish_reason == "length"


@pytest.mark.server
async def test_a_10_mb_body_is_refused_without_being_read():
    ten_mb = 10 * 1024 * 1024
    async with serving() as served:
        # Declared: refused from the Content-Length alone, before any of it is sent.
        status, headers, body = await raw_request(
            served.url, _post("/v1/chat/completions", b"x" * 0).replace(b"Content-Length: 0", f"Content-Length: {ten_mb}".encode())
        )
        assert status == 413 and b"max_body_bytes" in body and headers.get("connection") == "close"
        # Chunked: refused once past the limit; the server stops reading and closes.
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        sent = 0
        async with await anyio.connect_tcp(host, int(port)) as stream:
            await stream.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"x" * 65536
            answer = b""
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:

                    async def read() -> None:
                        nonlocal answer
                        try:
                            while True:
                                answer += await stream.receive()
                        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                            pass
                        tg.cancel_scope.cancel()

                    tg.start_soon(read)
                    try:
                        while sent < ten_mb:
                            await stream.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            sent += len(chunk)
                    except (anyio.BrokenResourceError, ConnectionResetError, BrokenPipeError):
                        pass
                    await anyio.sleep_forever()
        stats = await served.runtime.stats()
    assert answer.startswith(b"HTTP/1.1 413")
    assert served.http.api.config.max_body_bytes < ten_mb and sent < ten_mb
    assert stats.live_requests == 0


@pytest.mark.server
async def test_a_full_queue_answers_503_with_retry_after():
    config = make_config(max_batch_size=1, max_queued_requests=1)
    async with serving(config) as served:
        client = served.client()
        outcomes: list = []

        async def one() -> None:
            try:
                r = await client.chat.completions.with_raw_response.create(
                    model=served.model, messages=MESSAGES, max_tokens=40, extra_body={"ignore_eos": True}
                )
                outcomes.append(r.parse().choices[0].finish_reason)
            except openai.APIStatusError as error:
                outcomes.append((error.status_code, error.response.headers.get("retry-after"), error.body["type"]))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(one)
        await client.close()
    assert "length" in outcomes
    assert (503, "1", ERROR_KINDS["busy"].openai_type) in outcomes
    assert all(o in ("length", (503, "1", "server_overloaded")) for o in outcomes)


@pytest.mark.server
async def test_requests_past_the_http_limit_get_503_json_with_retry_after():
    """`server.http_max_connections` requests in flight: the next gets OpenAI's 503 JSON with
    Retry-After (not uvicorn's plain text), /health still answers, and once a stream ends a new
    request is served."""
    async with serving(http_max_connections=2) as served:
        client = served.client()
        streams = [
            await client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=400, stream=True, extra_body={"ignore_eos": True})
            for _ in range(2)
        ]
        for stream in streams:
            await stream.__anext__()  # both are in flight
        refused = await _status_error(client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=4))
        health, _, _ = await raw_request(served.url, b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        await streams[0].close()
        with anyio.fail_after(30):
            while True:  # the server sees the first stream end when its next write fails
                try:
                    served_after = await client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=4)
                    break
                except openai.APIStatusError as error:
                    assert error.status_code == 503
                    await anyio.sleep(0.05)
        await streams[1].close()
        await client.close()
    assert refused.status_code == 503 and refused.response.headers.get("retry-after") == "1"
    assert refused.body["type"] == ERROR_KINDS["busy"].openai_type and "http_max_connections" in refused.body["message"]
    assert health == 200
    assert served_after.choices[0].finish_reason in ("length", "stop")


async def test_health_is_503_until_the_runtime_is_attached():
    http = HttpServer(http_config())
    async with anyio.create_task_group() as tg:
        url = await tg.start(http.serve)
        health, _, body = await raw_request(url, b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        payload = b'{"model": "builtin:tiny", "messages": [{"role": "user", "content": "x"}]}'
        chat, chat_headers, _ = await raw_request(url, _post("/v1/chat/completions", payload), payload)
        http.stop()
    assert health == 503 and b"loading" in body
    assert chat == 503 and chat_headers["retry-after"] == "1"


@pytest.mark.server
async def test_cors_is_off_unless_configured():
    preflight = b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nOrigin: http://app.example\r\nAccess-Control-Request-Method: POST\r\n"
    get = b"GET /health HTTP/1.1\r\nHost: localhost\r\nOrigin: http://app.example\r\n"
    async with serving() as served:
        _, off_headers, _ = await raw_request(served.url, get)
        off_preflight, _, _ = await raw_request(served.url, preflight)
    async with serving(cors_origins=["http://app.example"], api_key="k") as served:
        on, on_headers, _ = await raw_request(served.url, preflight)
        _, other_headers, _ = await raw_request(served.url, get.replace(b"app.example", b"evil.example"))
    assert "access-control-allow-origin" not in off_headers and off_preflight == 405
    assert on == 200 and on_headers["access-control-allow-origin"] == "http://app.example"
    assert "access-control-allow-origin" not in other_headers


def test_the_listener_names_tcp_so_connections_get_nodelay():
    # asyncio sets TCP_NODELAY only on sockets whose protocol says TCP; without it, Nagle and
    # delayed ACKs hold each streamed event back by ~40 ms.
    import socket

    server = HttpServer(http_config())
    sock = server.bind()
    try:
        assert sock.proto == socket.IPPROTO_TCP and server.port > 0
    finally:
        sock.close()
