"""A loopback TCP proxy that records the HTTP exchanges passing through it, so a test can check
what a client it does not control (a coding agent) sent and what the server answered.

`recording_proxy(upstream)` forwards every connection to `upstream` ("http://host:port") and
keeps each direction's bytes; `exchanges()` parses them into requests and responses, in order
per connection (HTTP/1.1 keep-alive, Content-Length or chunked bodies)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import SocketStream


@dataclass
class HttpMessage:
    start_line: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def sse(self) -> list[dict[str, Any]]:
        """The `data:` payloads of a server-sent event stream, decoded."""
        lines = self.body.decode().splitlines()
        return [json.loads(line[5:]) for line in lines if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")]


@dataclass
class Recording:
    url: str = ""
    # One (client-to-server, server-to-client) byte pair per connection.
    connections: list[tuple[bytearray, bytearray]] = field(default_factory=list)

    def exchanges(self) -> list[tuple[HttpMessage, HttpMessage | None]]:
        """Every request with its response (None if none came), connection by connection."""
        out: list[tuple[HttpMessage, HttpMessage | None]] = []
        for sent, received in self.connections:
            requests, responses = parse_messages(bytes(sent)), parse_messages(bytes(received))
            out += [(request, responses[i] if i < len(responses) else None) for i, request in enumerate(requests)]
        return out


def parse_messages(data: bytes) -> list[HttpMessage]:
    messages = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if "content-length" in headers:
            size = int(headers["content-length"])
            body, data = rest[:size], rest[size:]
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while rest:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line.split(b";")[0] or b"0", 16)
                body, rest = body + rest[:size], rest[size + 2 :]
                if size == 0:
                    break
            data = rest
        else:
            body, data = rest, b""
        messages.append(HttpMessage(lines[0], headers, body))
    return messages


async def _pump(source: SocketStream, sink: SocketStream, record: bytearray) -> None:
    try:
        async for chunk in source:
            record += chunk
            await sink.send(chunk)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionResetError):
        pass
    finally:
        try:
            await sink.send_eof()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass


@asynccontextmanager
async def recording_proxy(upstream: str) -> AsyncIterator[Recording]:
    host, port = upstream.removeprefix("http://").rsplit(":", 1)
    recording = Recording()

    async def handle(client: SocketStream) -> None:
        sent, received = bytearray(), bytearray()
        recording.connections.append((sent, received))
        async with client, await anyio.connect_tcp(host, int(port)) as server, anyio.create_task_group() as tg:
            tg.start_soon(_pump, client, server, sent)
            await _pump(server, client, received)
            tg.cancel_scope.cancel()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener, anyio.create_task_group() as tg:
        recording.url = f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        tg.start_soon(listener.serve, handle)
        try:
            yield recording
        finally:
            tg.cancel_scope.cancel()
