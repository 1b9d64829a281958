"""How a request's body arrives (`read_body`, within a size and a time) and its events leave as
an HTTP response, for every route: server-sent events in the route's own encoding (`sse_body`,
sent by `SseResponse`, which gives up on a client that stops reading), or one collected response
(`collect`, `whole_response`); a client that disconnects, while its request is queued or
mid-stream, cancels it (`unless_disconnected`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from net.http.errors import HttpError, error_of
from net.http.outputs import Output, ending_error
from net.http.responses import error_response, json_response
from protocols.api import Event
from protocols.errors import MlxrtError

log = structlog.get_logger(actor="http")

T = TypeVar("T")

# nginx's "client closed request": logged and counted, never received.
CLIENT_LEFT = 499


async def sse_body(stream, first: Event | None, events: AsyncIterator[Event], output: Output, endpoint: str) -> AsyncGenerator[bytes, None]:
    """The request's events as server-sent events in the output's own encoding, ended by its
    terminator; an error mid-stream is its error event."""
    first_chunk = output.first_chunk()
    pending = [output.sse(first_chunk)] if first_chunk is not None else []
    try:
        event = first if first is not None else await anext(events)
        while True:
            pending += [output.sse(chunk) for chunk in output.on_event(event)]
            if output.finished is not None:  # (several choices: once all have)
                error = ending_error(output.finished)
                pending.append(output.sse_error(error) if error is not None else output.sse_end())
                yield b"".join(pending)
                return
            if pending:
                yield b"".join(pending)
                pending = []
            event = await anext(events)
    except MlxrtError as exc:
        yield b"".join(pending) + output.sse_error(error_of(exc, endpoint=endpoint))
    finally:
        await close_stream(stream)


def whole_response(done: list[bool], output: Output, headers: dict[str, str]) -> Response:
    """A collected response (`done`: what `unless_disconnected` gave): the whole of it, its error,
    or nothing for a client that left."""
    if not done:
        return Response(status_code=CLIENT_LEFT)
    assert output.finished is not None
    error = ending_error(output.finished)
    if error is not None:
        return error_response(error, output.error_body)
    return json_response(output.response(), headers=headers)


async def collect(first: Event, events: AsyncIterator[Event], output: Output) -> bool:
    event = first
    while True:
        output.on_event(event)
        if output.finished is not None:  # (several choices: once all have)
            return True
        event = await anext(events)


async def close_stream(stream) -> None:
    with anyio.CancelScope(shield=True):
        await stream.aclose()


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> list[T]:
    """Run `work` unless the client disconnects first: [its result], or [] if the client left.
    What `work` raises comes out as itself, not in an exception group."""
    result: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_disconnect, receive, tg.cancel_scope)
        try:
            result.append(await work())
        except Exception as exc:
            failure.append(exc)
        tg.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return result


async def cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class SseResponse(StreamingResponse):
    """Server-sent events. A client that disconnects cancels the stream (and so its request);
    one that leaves a chunk unaccepted for `stall_s` is given up on."""

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        *,
        stall_s: float,
        headers: dict[str, str],
        background: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ):
        super().__init__(body, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body
        self._stall_s = stall_s
        # What feeds the body, run beside it (several choices' requests: `choices.Merged.run`).
        self._feed = background

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with aclosing(self._body) as body, anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_disconnect, receive, tg.cancel_scope)
            if self._feed is not None:
                tg.start_soon(self._feed)
            try:
                await self._send(send, {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for data in body:
                    await self._send(send, {"type": "http.response.body", "body": data, "more_body": True})
                await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
            except TimeoutError:
                log.warning("http_client_stalled", seconds=self._stall_s)
            tg.cancel_scope.cancel()

    async def _send(self, send: Send, message: Message) -> None:
        with anyio.fail_after(self._stall_s):
            await send(message)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused by its Content-Length before reading, or as soon as it passes the limit."""
    too_large = f"the request body exceeds {limit} bytes (server.max_body_bytes)"
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise HttpError("body_too_large", too_large)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HttpError("body_too_large", too_large)
                chunks.append(chunk)
    except TimeoutError:
        raise HttpError("body_timeout", f"the request body did not arrive within {timeout:g} s (server.body_timeout_s)") from None
    return b"".join(chunks)
