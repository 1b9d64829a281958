"""Per-client pacing (`net.http.pacing`): a client resending refused requests is held to
`server.client_refusals_per_s`, past `client_max_held` held answers its requests are refused
unread (429), `client_requests_per_s` bounds a client's requests; other clients are not held
for it. The middleware alone on a fake clock, then a real server."""

from __future__ import annotations

import json
import time

import anthropic
import anyio
import msgspec
import pytest

from net.http.client import HttpConnection, HttpError
from net.http.pacing import MAX_CLIENTS, Cell, ClientPacing
from protocols.config import ServerConfig
from protocols.errors import ERROR_KINDS
from tests.support.http_serving import raw_request, serving

pytestmark = pytest.mark.anyio


class Clock:
    """A fake monotonic clock that a paced answer's sleep moves forward."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def refusing_app(status: int = 400):
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


async def call(middleware, client: str = "10.0.0.1", path: str = "/v1/chat/completions", headers: list | None = None) -> tuple[int, dict[bytes, bytes]]:
    scope = {"type": "http", "path": path, "method": "POST", "headers": headers or [], "client": (client, 5000)}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message) -> None:
        sent.append(message)

    await middleware(scope, receive, send)
    return sent[0]["status"], dict(sent[0].get("headers") or [])


def test_a_cell_allows_its_burst_then_its_rate_and_takes_nothing_it_refuses():
    cell = Cell(rate=10.0, burst=3)
    assert [cell.reserve("a", 0.0, max_wait=1.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert cell.reserve("a", 0.0, max_wait=1.0) == pytest.approx(0.1)
    assert cell.reserve("a", 0.0, max_wait=0.15) is None  # (0.2 away: refused, nothing taken)
    assert cell.reserve("a", 0.0, max_wait=1.0) == pytest.approx(0.2)
    assert cell.reserve("b", 0.0, max_wait=0.0) == 0.0  # another key has its own turns
    assert cell.reserve("a", 10.0, max_wait=0.0) == 0.0  # and the burst comes back with time


def test_the_table_of_clients_stays_bounded():
    cell = Cell(rate=1.0, burst=1)
    for k in range(MAX_CLIENTS + 50):
        cell.charge(f"c{k}", now=float(k) * 1e-6)
    assert len(cell._tat) <= MAX_CLIENTS


async def test_a_clients_refusals_past_its_burst_are_held_to_its_rate_and_others_are_not():
    clock = Clock()
    config = ServerConfig(client_refusals_per_s=10.0, client_refusal_burst=5, client_max_delay_s=2.0)
    pacing = ClientPacing(refusing_app(), config, clock=clock, sleep=clock.sleep)
    start = clock.now
    for _ in range(25):
        assert (await call(pacing))[0] == 400
    # Five at once, then one every 0.1 s.
    assert clock.now - start == pytest.approx(2.0)
    assert len(clock.slept) == 20
    before = clock.now
    assert (await call(pacing, client="10.0.0.2"))[0] == 400 and clock.now == before
    # Answers that are not refusals are never held.
    ok = ClientPacing(refusing_app(200), config, clock=clock, sleep=clock.sleep)
    for _ in range(50):
        assert (await call(ok))[0] == 200
    assert clock.now == before


async def test_a_hold_is_at_most_the_max_delay_and_health_is_never_paced():
    clock = Clock()
    config = ServerConfig(client_refusals_per_s=1.0, client_refusal_burst=1, client_max_delay_s=0.5)
    pacing = ClientPacing(refusing_app(), config, clock=clock, sleep=clock.sleep)
    for _ in range(5):
        await call(pacing)
    assert max(clock.slept) == 0.5
    before = clock.now
    for _ in range(5):
        await call(pacing, path="/health")
        await call(pacing, path="/metrics")
    assert clock.now == before


async def test_past_max_held_a_clients_requests_are_refused_unread_with_retry_after():
    config = ServerConfig(client_refusals_per_s=1.0, client_refusal_burst=1, client_max_delay_s=5.0, client_max_held=2)
    release = anyio.Event()

    async def sleep(seconds: float) -> None:
        await release.wait()

    read: list[str] = []

    async def app(scope, receive, send) -> None:
        read.append(scope["path"])
        await refusing_app()(scope, receive, send)

    pacing = ClientPacing(app, config, sleep=sleep)
    statuses: list[int] = []

    async def one() -> None:
        statuses.append((await call(pacing))[0])

    async with anyio.create_task_group() as tg:
        await one()  # its burst: answered at once
        for _ in range(2):
            tg.start_soon(one)
        with anyio.fail_after(5):
            while len(read) < 3:
                await anyio.sleep(0.01)
        status, headers = await call(pacing)
        anthropic_status, _ = await call(pacing, path="/v1/messages")
        assert len(read) == 3  # the refused ones never reached the app
        release.set()
    assert (status, anthropic_status) == (429, 429) and headers[b"retry-after"] == b"5"
    assert sorted(statuses) == [400, 400, 400]


async def test_requests_past_the_request_rate_wait_their_turn_or_are_refused():
    clock = Clock()
    config = ServerConfig(client_refusals_per_s=0.0, client_requests_per_s=4.0, client_request_burst=2, client_max_delay_s=0.2)
    pacing = ClientPacing(refusing_app(200), config, clock=clock, sleep=clock.sleep)
    assert [(await call(pacing))[0] for _ in range(2)] == [200, 200]
    status, headers = await call(pacing)  # its turn 0.25 s away (past the 0.2 s bound): refused, not waited
    assert status == 429 and headers[b"retry-after"] == b"1" and not clock.slept
    clock.now += 0.1
    assert (await call(pacing))[0] == 200 and clock.slept == [pytest.approx(0.15)]  # waited its turn


async def test_with_api_keys_each_key_is_its_own_client_and_a_bad_key_its_address():
    clock = Clock()
    config = ServerConfig(api_keys=["key-a", "key-b"], client_refusals_per_s=10.0, client_refusal_burst=2)
    pacing = ClientPacing(refusing_app(), config, clock=clock, sleep=clock.sleep)
    for _ in range(10):
        await call(pacing, headers=[(b"authorization", b"Bearer key-a")])
    held_a = clock.now
    assert held_a > 100.0
    for _ in range(2):  # key-b, from the same address: a burst of its own
        await call(pacing, headers=[(b"x-api-key", b"key-b")])
    assert clock.now == held_a
    for k in range(4):  # guessed keys are the address's client, however many are tried
        await call(pacing, headers=[(b"authorization", f"Bearer guess-{k}".encode())])
    assert clock.now > held_a


def test_the_defaults_pace_refusals_and_not_requests():
    config = ServerConfig()
    assert (config.client_refusals_per_s, config.client_refusal_burst, config.client_max_delay_s, config.client_max_held) == (10.0, 20, 2.0, 8)
    assert config.client_requests_per_s == 0.0
    assert ERROR_KINDS["rate_limited"] == (429, "rate_limit_error")
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"client_refusals_per_s": -1}, ServerConfig)


async def _held_answers(url: str) -> float:
    _, _, body = await raw_request(url, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
    for line in body.decode().splitlines():
        if line.startswith("mlxrt:http_answers_held{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("/metrics has no mlxrt:http_answers_held")


@pytest.mark.server
async def test_a_client_resending_a_refused_request_over_http_is_held_and_a_429_is_each_apis_own():
    async with serving(client_refusals_per_s=0.5, client_refusal_burst=6, client_max_delay_s=2.0, client_max_held=1) as served:
        body = json.dumps({"model": served.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()

        async def post() -> tuple[int, dict[str, str], bytes]:
            return await raw_request(served.url, head, body)

        started = time.monotonic()
        statuses = [(await post())[0] for _ in range(7)]
        # Its burst at once, then the seventh held until its turn (2 s at 0.5 a second).
        assert statuses == [400] * 7 and time.monotonic() - started >= 1.9

        async def held() -> None:
            assert (await post())[0] == 400

        # While that client's one answer is held (client_max_held = 1), its next requests are
        # 429s in each API's own shape, Retry-After the longest hold.
        async with anyio.create_task_group() as tg:
            tg.start_soon(held)
            with anyio.fail_after(10):  # (until the server holds it back: /metrics says so)
                while await _held_answers(served.url) != 1:
                    await anyio.sleep(0.02)
            status, headers, answer = await post()
            # mlxrt's own client: the 429, then the connection it closed is not reused.
            async with HttpConnection.connect(served.url) as connection:
                with pytest.raises(HttpError) as ours:
                    async for _ in connection.post("/v1/chat/completions", body):
                        pass
                with pytest.raises(ConnectionError, match="Connection: close"):
                    async for _ in connection.post("/v1/chat/completions", body):
                        pass
            assert ours.value.status == 429
            client = anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0)
            with pytest.raises(anthropic.RateLimitError) as caught:
                await client.messages.create(model=served.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert await _held_answers(served.url) == 0
        assert status == 429 and headers["retry-after"] == "2"
        assert json.loads(answer)["error"]["type"] == "rate_limit_error"
        assert caught.value.status_code == 429 and caught.value.body["error"]["type"] == "rate_limit_error"
