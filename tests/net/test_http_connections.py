"""The HTTP front's connections and what browsers may send (issue 26 findings 1, 8, 12): silent,
dripping and unread connections are closed on deadlines and never crowd out `/health` or the
API; the open-connection cap evicts idle connections, never busy ones; a page under another
host name, or a form POST, is refused."""

from __future__ import annotations

import socket
import time

import anyio
import pytest
import uvicorn
from uvicorn.server import ServerState

from net.http.connections import ConnectionGuard, guarded_protocol
from tests.support.http_serving import raw_request, serving
from tests.support.waiting import wait_until_async

HEAD_TIMEOUT_S = 1.0


def _get(path: str, host: str = "localhost") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n".encode()


def _open_silent(url: str, n: int) -> list[socket.socket]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return [socket.create_connection((host, int(port))) for _ in range(n)]


async def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` (EOF or reset) within `within` seconds."""
    sock.setblocking(False)
    with anyio.move_on_after(within):
        while True:
            try:
                if sock.recv(1024) == b"":
                    return True
            except BlockingIOError:
                await anyio.sleep(0.05)
            except OSError:  # reset
                return True
    return False


@pytest.mark.server
async def test_silent_and_dripping_connections_are_closed_at_the_head_deadline():
    async with serving(http_header_timeout_s=HEAD_TIMEOUT_S) as served:
        silent, dripping = _open_silent(served.url, 2)
        dripping.sendall(b"GET /health HTTP/1.1\r\n")
        assert await _closed_by_server(silent, within=HEAD_TIMEOUT_S + 3)
        for _ in range(8):  # one header byte at a time: bytes do not extend the deadline
            try:
                dripping.sendall(b"X")
            except OSError:
                break
            await anyio.sleep(0.25)  # a dripping client: the slowness is the point
        assert await _closed_by_server(dripping, within=HEAD_TIMEOUT_S + 3)
        assert served.http.guard.stats.head_timeouts >= 2
        status, _, _ = await raw_request(served.url, _get("/health"))
        assert status == 200
        for sock in (silent, dripping):
            sock.close()


@pytest.mark.server
async def test_idle_connections_beyond_the_cap_evict_each_other_not_health_or_the_api():
    """Finding 1: 40 silent sockets with room for 8 kept /health and the API answering 503."""
    async with serving(http_max_open_connections=8, http_max_connections=4) as served:
        idle = _open_silent(served.url, 40)
        await wait_until_async(lambda: served.http.guard.stats.evicted >= 32)  # all 40 accepted
        assert len(served.http.guard.open) <= 8
        status, _, body = await raw_request(served.url, _get("/health"))
        assert status == 200 and b'"ok"' in body
        async with served.client() as client:
            completion = await client.completions.create(model=served.model, prompt=[5, 6, 7], max_tokens=4)
        assert completion.usage is not None and completion.usage.completion_tokens == 4
        assert served.http.guard.stats.evicted >= 32
        for sock in idle:
            sock.close()


@pytest.mark.server
async def test_a_busy_connection_is_never_evicted():
    async with serving(http_max_open_connections=2) as served, served.client() as client:
        done: list[int] = []

        async def stream() -> None:
            chunks = await client.completions.create(model=served.model, prompt=[5, 6, 7], max_tokens=40, stream=True, extra_body={"ignore_eos": True})
            async for chunk in chunks:
                done.append(len(chunk.choices))
                await anyio.sleep(0.01)  # a slow reader keeps its connection busy for a while

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            await wait_until_async(lambda: done)  # the stream's connection is busy
            idle = _open_silent(served.url, 6)  # they evict each other, not the stream
        assert len(done) >= 20
        for sock in idle:
            sock.close()


class _Transport:
    """Enough of an asyncio transport for uvicorn's protocol: records whether it was aborted."""

    def __init__(self):
        self.aborted = False
        self.buffered = 0

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 9) if name in ("peername", "sockname") else default

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.aborted = True

    def write(self, data: bytes) -> None:
        self.buffered += len(data)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol) -> None:
        pass


def _connection(guard: ConnectionGuard):
    config = uvicorn.Config(app=lambda scope, receive, send: None, lifespan="off")
    config.load()
    connection = guarded_protocol(guard)(config=config, server_state=ServerState(), app_state={})
    transport = _Transport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    return connection, transport


async def test_an_unread_answer_is_dropped_at_the_write_deadline_and_busy_ones_are_never_evicted():
    """Finding 12: a client that never read its whole answer kept it in the server's memory
    (the transport's buffer, once the kernel's is full: writing paused)."""
    guard = ConnectionGuard(max_open=2, head_timeout_s=10.0, stall_timeout_s=1.0)
    reader, reader_transport = _connection(guard)
    stalled, stalled_transport = _connection(guard)
    reader.idle_since = stalled.idle_since = None  # both serving a request
    stalled.pause_writing()  # its client stopped reading
    now = time.monotonic()
    guard.sweep(now + 0.5)
    assert not stalled_transport.aborted
    guard.sweep(now + 1.5)
    assert stalled_transport.aborted and not reader_transport.aborted and guard.stats.write_stalls == 1
    _, third_transport = _connection(guard)  # the cap: one open, busy; room for this one
    fourth, fourth_transport = _connection(guard)  # both busy or new-and-idle: the idle one goes
    assert third_transport.aborted and not fourth_transport.aborted and not reader_transport.aborted
    fourth.idle_since = None
    _, fifth_transport = _connection(guard)  # every connection busy: the new one is refused
    assert fifth_transport.aborted and guard.stats.refused == 1


@pytest.mark.server
@pytest.mark.parametrize(
    "head,status",
    [
        (_get("/v1/models", host="evil.example:8000"), 421),  # a DNS-rebinding page's own name
        (_get("/health", host="attacker.test"), 421),
        (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n", 415),
        (b"POST /v1/completions HTTP/1.1\r\nHost: [::1]:80\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 2\r\n", 415),
    ],
)
async def test_what_a_browser_page_sends_is_refused(head, status):
    """Finding 8: without a key, cross-origin forms and text/plain POSTs ran generations, and
    any Host was answered."""
    async with serving() as served:
        got, _, body = await raw_request(served.url, head, b"{}")
        assert got == status, body
        live = await served.runtime.stats()
        assert live.scheduler.num_finished == 0  # nothing ran


@pytest.mark.server
async def test_allowed_hosts_and_an_api_key_relax_the_browser_checks():
    async with serving(http_allowed_hosts=["models.internal"], api_key="k") as served:
        named, _, _ = await raw_request(served.url, _get("/health", host="models.internal:9000"))
        other, _, _ = await raw_request(served.url, _get("/health", host="localhost"))
        form = b"POST /v1/completions HTTP/1.1\r\nHost: models.internal\r\nAuthorization: Bearer k\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n"
        keyed, _, body = await raw_request(served.url, form, b"{}")
    assert (named, other) == (200, 421)
    assert keyed == 400 and b"invalid_request" in body  # past the guard: the body is checked as JSON
