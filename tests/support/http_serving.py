"""A runtime served over HTTP in the test's own event loop, an `openai` client for it, and raw
requests for what no client would send.

`serving(config)` opens a `Runtime` (or a `ModelPool`) and its `HttpServer` on a free loopback
port; `wait_runtime_idle` polls the runtime's stats until no request is live; `raw_request`
sends bytes over a fresh connection and parses the answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from openai import AsyncOpenAI

from net.http.server import HttpServer
from runtime import Runtime, RuntimeConfig
from tests.support.config import make_config


@dataclass
class Served:
    runtime: Any
    http: HttpServer
    url: str
    model: str

    def client(self, api_key: str = "unused") -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60.0)


def http_config(config: RuntimeConfig | None = None, **server) -> RuntimeConfig:
    config = config or make_config()
    return msgspec.structs.replace(config, server=msgspec.structs.replace(config.server, http="127.0.0.1:0", **server))


@asynccontextmanager
async def serving(config: RuntimeConfig | None = None, *, pool: bool = False, **server) -> AsyncIterator[Served]:
    """A runtime (a `ModelPool` with `pool`) and its HTTP server on a free loopback port,
    stopped on exit."""
    from runtime.pool import ModelPool

    config = http_config(config, **server)
    async with ModelPool.open(config) if pool else Runtime.open(config) as rt:
        http = HttpServer(config)
        async with anyio.create_task_group() as tg:
            url = await tg.start(http.serve)
            http.attach(rt)
            try:
                yield Served(rt, http, url, config.model_name)
            finally:
                http.stop()


async def wait_runtime_idle(rt: Runtime, timeout: float = 10.0):
    """The runtime's stats once no request is live (within `timeout`)."""
    with anyio.fail_after(timeout):
        while True:
            stats = await rt.stats()
            if stats.live_requests == 0 and stats.kv.live_requests == 0:
                return stats
            await anyio.sleep(0.02)


async def raw_request(url: str, head: bytes, body: bytes = b"", *, read_limit: int = 1 << 20) -> tuple[int, dict[str, str], bytes]:
    """Send `head` (request line and headers) and `body` over a fresh connection; the status,
    headers and body of the answer (read until the server closes or `read_limit`)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(head + b"\r\n" + body)
        data = b""
        with anyio.fail_after(10):
            while b"\r\n\r\n" not in data or len(data) < read_limit:
                try:
                    data += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                    break
                if b"\r\n\r\n" in data and _complete(data):
                    break
    return _parse(data)


def _complete(data: bytes) -> bool:
    _, headers, body = _parse(data)
    return "content-length" in headers and len(body) >= int(headers["content-length"])


def _parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body
