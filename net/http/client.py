"""A small HTTP/1.1 client for the OpenAI-compatible API (h11 over anyio): what `mlxrt chat
--http` and `mlxrt bench-http` speak. One kept-alive connection; a JSON body posted, the answer
streamed back as bytes or as server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import anyio
import h11


class HttpError(Exception):
    """The server answered with an error status (the body's message included)."""

    def __init__(self, status: int, body: bytes):
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body.decode(errors="replace")[:300]
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class HttpConnection:
    """A kept-alive HTTP/1.1 connection that posts JSON bodies and streams back the answers."""

    def __init__(self, stream: anyio.abc.ByteStream, host: str, headers: list[tuple[str, str]] | None = None):
        self._stream = stream
        self._host = host
        self._headers = headers or []
        self._conn = h11.Connection(h11.CLIENT)

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str, *, api_key: str = "", timeout: float = 10.0) -> AsyncIterator[HttpConnection]:
        """Connect to `http://host:port` (the path of `url` is ignored)."""
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{url!r}: expected http://host:port")
        headers = [("Authorization", f"Bearer {api_key}")] if api_key else []
        with anyio.fail_after(timeout):
            stream = await anyio.connect_tcp(parts.hostname, parts.port or 80)
        async with stream:
            yield cls(stream, parts.netloc, headers)

    async def get_json(self, target: str) -> dict:
        """GET `target`; its JSON body."""
        return json.loads(await self.get(target))

    async def get(self, target: str) -> bytes:
        """GET `target`; its body."""
        return b"".join([chunk async for chunk in self._exchange("GET", target, None)])

    async def delete(self, target: str) -> bytes:
        """DELETE `target`; its body."""
        return b"".join([chunk async for chunk in self._exchange("DELETE", target, None)])

    def post(self, target: str, body: bytes) -> AsyncIterator[bytes]:
        """POST `body` (JSON) to `target`; yields the response body as it arrives."""
        return self._exchange("POST", target, body)

    async def _exchange(self, method: str, target: str, body: bytes | None) -> AsyncIterator[bytes]:
        if self._conn.our_state is not h11.IDLE:
            raise ConnectionError("the server closed this connection after its last answer (Connection: close)")
        headers = [("Host", self._host), *self._headers]
        if body is not None:
            headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        data = self._conn.send(h11.Request(method=method, target=target, headers=headers))
        if body is not None:
            data += self._conn.send(h11.Data(data=body))
        await self._stream.send(data + self._conn.send(h11.EndOfMessage()))
        status, error = 200, b""
        while True:
            event = self._conn.next_event()
            if event is h11.NEED_DATA:
                self._conn.receive_data(await self._stream.receive())
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                if status == 200:
                    yield bytes(event.data)
                else:
                    error += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                if self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE:
                    self._conn.start_next_cycle()  # (else the server closes it: `Connection: close`)
                if status != 200:
                    raise HttpError(status, error)
                return

    async def events(self, target: str, payload: dict) -> AsyncIterator[dict]:
        """POST `payload` with `stream: true`; yields each server-sent event's JSON data."""
        buffer = b""
        async for chunk in self.post(target, json.dumps(payload).encode()):
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.splitlines():
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        yield json.loads(line[6:])
