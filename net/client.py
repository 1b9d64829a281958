"""`Client`: the socket twin of `Runtime.generate`.

    async with Client.connect(path) as client:
        async for event in client.generate(GenerateRequest(prompt="...", max_tokens=32)):
            ...

Requests are multiplexed over one connection by request id; a background task
routes incoming frames to each request's bounded stream. Errors arrive as the
same exception types the embedding API raises.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import msgspec
from anyio.abc import SocketStream
from anyio.streams.memory import MemoryObjectSendStream

from actors.mailbox import CoalescingInbox, join_optional
from net.framing import FrameReader, encode_frame
from protocols.api import AdapterInfo, Event, Finished, GenerateRequest, TokenDelta, new_request_id
from protocols.errors import ConnectionLostError, ServerError, error_for
from protocols.wire import PROTOCOL_VERSION, AdapterCommand, Adapters, Cancel, Error, Generate, GetStats, Hello, Resume, ServerMessage, Stats, Welcome
from runtime.errors import DuplicateRequestError, RequestTooLargeError, single_errors

MAX_FRAME_BYTES = 64 * 1024 * 1024


class Client:
    def __init__(self, stream: SocketStream, reader: FrameReader, welcome: Welcome):
        self.welcome = welcome
        self._stream = stream
        self._reader = reader
        self._send_lock = anyio.Lock()
        self._streams: dict[str, CoalescingInbox] = {}
        # One control call (stats, adapters) at a time: its answer is the next such frame.
        self._control_lock = anyio.Lock()
        self._control: MemoryObjectSendStream[Stats | Adapters] | None = None
        self._closed = False

    @classmethod
    @asynccontextmanager
    async def connect(cls, path: str | Path, *, timeout: float = 10.0, name: str = "mlxrt-client") -> AsyncIterator[Client]:
        with anyio.fail_after(timeout):
            stream = await anyio.connect_unix(str(path))
        async with stream:
            reader: FrameReader[ServerMessage] = FrameReader(stream, ServerMessage, MAX_FRAME_BYTES)  # type: ignore[arg-type]
            with anyio.fail_after(timeout):
                try:
                    await stream.send(encode_frame(Hello(protocol_version=PROTOCOL_VERSION, client=name)))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # the server refused us before reading; its Error frame says why
                try:
                    welcome = await _read_one(reader)
                except (anyio.IncompleteRead, anyio.BrokenResourceError):
                    welcome = None
            if welcome is None:
                raise ConnectionLostError("the server closed the connection during the handshake")
            if isinstance(welcome, Error):
                raise _error_for(welcome)
            if not isinstance(welcome, Welcome):
                raise ServerError("protocol_error", f"expected Welcome, got {type(welcome).__name__}")
            if welcome.protocol_version != PROTOCOL_VERSION:
                # Every frame after it would be in another version's shape.
                raise ServerError("protocol_error", f"the server chose protocol version {welcome.protocol_version}; this client speaks {PROTOCOL_VERSION}")
            client = cls(stream, reader, welcome)
            with single_errors():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client._read_loop)
                    try:
                        yield client
                    finally:
                        client._closed = True
                        tg.cancel_scope.cancel()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """The request's events, exactly as `Runtime.generate` yields them."""
        rid = request.request_id or new_request_id()
        async for event in self._request(rid, Generate(request=msgspec.structs.replace(request, request_id=rid))):
            yield event

    async def resume(self, request_id: str) -> AsyncIterator[Event]:
        """Continue a checkpointed request, exactly as `Runtime.resume` does."""
        async for event in self._request(request_id, Resume(request_id=request_id)):
            yield event

    async def _request(self, rid: str, start: msgspec.Struct) -> AsyncIterator[Event]:
        if rid in self._streams:
            raise DuplicateRequestError(f"request_id {rid!r} is already in use")
        frame = encode_frame(start)
        if len(frame) > self.welcome.limits.max_frame_bytes:
            raise RequestTooLargeError(
                f"the request encodes to {len(frame)} bytes; the server accepts frames up to {self.welcome.limits.max_frame_bytes}",
                field="prompt",
            )
        inbox = CoalescingInbox(_merge_events)
        self._streams[rid] = inbox
        finished = False
        try:
            await self._send_frame(frame)
            while True:
                try:
                    item = await inbox.receive()
                except anyio.EndOfStream:
                    raise ConnectionLostError() from None
                if isinstance(item, Error):
                    finished = True
                    raise _error_for(item)
                yield item
                if isinstance(item, Finished):
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and not self._closed:
                with anyio.CancelScope(shield=True):
                    await self.cancel(rid)

    async def cancel(self, request_id: str) -> None:
        try:
            await self._send(Cancel(request_id=request_id))
        except ConnectionLostError:
            pass

    async def stats(self) -> Stats:
        answer = await self._call(GetStats())
        assert isinstance(answer, Stats)
        return answer

    async def load_adapter(self, name: str, path: str | Path, *, pinned: bool = False) -> AdapterInfo:
        """Load a LoRA adapter on the server (`path` on the server's machine); see
        `Runtime.load_adapter`. Raises the server's typed error."""
        adapters = await self._adapter_call(AdapterCommand(op="load", name=name, path=str(path), pinned=pinned))
        return next(a for a in adapters if a.name == name)

    async def unload_adapter(self, name: str) -> None:
        await self._adapter_call(AdapterCommand(op="unload", name=name))

    async def adapters(self) -> list[AdapterInfo]:
        return await self._adapter_call(AdapterCommand(op="list"))

    async def _adapter_call(self, command: AdapterCommand) -> list[AdapterInfo]:
        answer = await self._call(command)
        assert isinstance(answer, Adapters)
        if answer.code is not None:
            raise error_for(answer.code, answer.message, answer.field)
        return answer.adapters

    async def _call(self, message: msgspec.Struct) -> Stats | Adapters:
        async with self._control_lock:
            send, receive = anyio.create_memory_object_stream[Stats | Adapters](1)
            self._control = send
            try:
                with send, receive:
                    await self._send(message)
                    try:
                        return await receive.receive()
                    except anyio.EndOfStream:
                        raise ConnectionLostError() from None
            finally:
                self._control = None

    async def _send(self, message: msgspec.Struct) -> None:
        await self._send_frame(encode_frame(message))

    async def _send_frame(self, frame: bytes) -> None:
        if self._closed:
            raise ConnectionLostError()
        async with self._send_lock:
            try:
                await self._stream.send(frame)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                raise ConnectionLostError() from None

    async def _read_loop(self) -> None:
        try:
            while True:
                message = await _read_one(self._reader)
                if message is None:
                    return
                await self._route(message)
        except (anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return
        finally:
            self._closed = True
            for inbox in list(self._streams.values()):
                inbox.close()
            if self._control is not None:
                self._control.close()

    async def _route(self, message) -> None:
        if isinstance(message, Stats | Adapters):
            if self._control is not None:
                try:
                    self._control.send_nowait(message)
                except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # the asker gave up; a late answer is dropped
            return
        # Never blocks: a request whose caller is not reading accumulates (merged) tokens
        # instead of holding up every other request on this connection.
        target = self._streams.get(getattr(message, "request_id", None) or "")
        if target is not None:
            target.send_nowait(message)


async def _read_one(reader: FrameReader):
    body = await reader.read_frame()
    return None if body is None else reader.decode(body)


def _merge_events(last, new):
    if isinstance(last, TokenDelta) and isinstance(new, TokenDelta):
        logprobs = join_optional(last.logprobs, new.logprobs)
        return msgspec.structs.replace(last, token_ids=last.token_ids + new.token_ids, text=last.text + new.text, logprobs=logprobs)
    return None


def _error_for(error: Error) -> Exception:
    return error_for(error.code, error.message, error.field)
