"""`mlxrt serve`: the runtime behind a Unix socket.

Owns the listener and one `Connection` per client. A connection reads frames
(`protocols.wire`), starts one forwarding task per `Generate`, and writes every
outgoing frame through one bounded queue drained by a writer task: a client that
stops reading fills its own queue and stalls only its own requests (whose
sessions coalesce tokens), and is dropped after `client_stall_timeout_s`.
A client that disconnects has its requests cancelled.
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import anyio
import msgspec
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskGroup

from actors.mailbox import LiveSet
from net import socket_path
from net.framing import FrameReader, FrameTooLarge, encode_frame
from protocols.api import Finished
from protocols.errors import ErrorCode, MlxrtError, error_code
from protocols.wire import (
    PROTOCOL_VERSION,
    SUPPORTED_PROTOCOL_VERSIONS,
    AdapterCommand,
    Adapters,
    Cancel,
    ClientMessage,
    Error,
    Generate,
    GetStats,
    Hello,
    Limits,
    ModelSummary,
    Resume,
    Welcome,
    for_version,
)
from runtime.config import ServerConfig
from runtime.serving import Serving

log = structlog.get_logger(actor="server")

FLUSH_GRACE_S = 2.0
SEND_BUFFER_BYTES = 64 * 1024


class Server:
    """Serves a runtime (a `Runtime` or a `ModelPool`) on a Unix socket until `stop()`."""

    def __init__(self, runtime: Serving, config: ServerConfig, path: Path):
        self.runtime = runtime
        self.config = config
        self.path = path
        self.connections: LiveSet[Connection] = LiveSet()
        self._mode = int(config.socket_mode, 8)
        self._stopping = anyio.Event()
        self._inode: int | None = None

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until `stop()`; signals readiness with the socket path."""
        socket_path.prepare(self.path, self._mode)
        listener = await anyio.create_unix_listener(self.path, mode=self._mode)
        self._inode = os.stat(self.path).st_ino
        log.info("listening", socket=str(self.path), mode=self.config.socket_mode)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._accept, listener, tg)
                task_status.started(self.path)
                await self._stopping.wait()
                await listener.aclose()
                for connection in self.connections:
                    connection.stop_reading()
                with anyio.move_on_after(2 * FLUSH_GRACE_S):
                    await self.connections.wait_empty()
                tg.cancel_scope.cancel()
        finally:
            self._remove_socket()

    def stop(self) -> None:
        self._stopping.set()

    async def _accept(self, listener, tg: TaskGroup) -> None:
        try:
            await listener.serve(self._handle, task_group=tg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # closed by stop()

    async def _handle(self, stream: SocketStream) -> None:
        async with stream:
            uid = peer_uid(stream)
            if uid is not None and uid != os.getuid() and uid not in self.config.allowed_uids:
                log.warning("peer_refused", uid=uid)
                await _send_quietly(stream, Error(code="protocol_error", message=f"uid {uid} is not allowed"))
                return
            if len(self.connections) >= self.config.max_connections or self._stopping.is_set():
                code: ErrorCode = "shutting_down" if self._stopping.is_set() else "busy"
                await _send_quietly(stream, Error(code=code, message="no more connections accepted"))
                return
            # A small kernel buffer keeps what a stalled client holds bounded and makes its
            # requests pause soon (they stop decoding once their queues are full).
            sock = stream.extra(SocketAttribute.raw_socket, None)
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            connection = Connection(self, stream)
            self.connections.add(connection)
            try:
                await connection.run()
            except Exception:
                # A bug in one connection ends that connection, never the server.
                log.exception("connection_failed")
            finally:
                self.connections.discard(connection)

    def _remove_socket(self) -> None:
        try:
            if self._inode is not None and os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def welcome(self, version: int = PROTOCOL_VERSION) -> Welcome:
        """The answer to a `Hello` that chose protocol `version`."""
        info, config = self.runtime.model_info, self.runtime.config
        return Welcome(
            protocol_version=version,
            model=ModelSummary(
                path=info.path,
                model_type=info.model_type,
                vocab_size=info.vocab_size,
                max_context=info.max_context,
                eos_token_ids=info.eos_token_ids,
                has_chat_template=info.has_chat_template,
            ),
            limits=Limits(
                max_frame_bytes=self.config.max_frame_bytes,
                max_batch_size=config.scheduler.max_batch_size,
                max_queued_requests=config.scheduler.max_queued_requests,
                default_max_tokens=config.generation.default_max_tokens,
            ),
        )


class Connection:
    """One client: its frames, its requests, its outgoing queue."""

    def __init__(self, server: Server, stream: SocketStream):
        self._server = server
        self._runtime = server.runtime
        self._stream = stream
        # This connection's live requests (their ids are unique runtime-wide: `Runtime.submit`).
        self._requests: LiveSet[str] = LiveSet()
        self._outbox_send, self._outbox_receive = anyio.create_memory_object_stream[bytes](server.config.send_buffer_frames)
        self._reading = anyio.CancelScope()
        self._writer_done = anyio.Event()
        # The protocol version this client's Hello chose: the shape of everything sent to it.
        self._version = PROTOCOL_VERSION

    def stop_reading(self) -> None:
        """Take no more requests; the live ones are cancelled and their endings flushed."""
        self._reading.cancel()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write_loop)
            with self._reading:
                try:
                    await self._read_loop(tg)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # the writer is gone: the client left or stopped reading
            # The client left, broke the protocol, or the server is stopping:
            # nobody will send for these requests again.
            with anyio.CancelScope(shield=True), anyio.move_on_after(FLUSH_GRACE_S):
                for request_id in self._requests:
                    await self._runtime.cancel(request_id)
                await self._requests.wait_empty()
                self._outbox_send.close()
                await self._writer_done.wait()
            tg.cancel_scope.cancel()

    async def send(self, message: msgspec.Struct) -> None:
        await self._outbox_send.send(encode_frame(for_version(message, self._version)))

    async def _write_loop(self) -> None:
        stall = self._server.config.client_stall_timeout_s
        try:
            async with self._outbox_receive:
                async for frame in self._outbox_receive:
                    with anyio.fail_after(stall):
                        await self._stream.send(frame)
        except TimeoutError:
            log.warning("client_stalled", seconds=stall, live_requests=len(self._requests))
            self.stop_reading()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            self.stop_reading()
        finally:
            self._writer_done.set()

    async def _read_loop(self, tg: TaskGroup) -> None:
        config = self._server.config
        reader: FrameReader[ClientMessage] = FrameReader(self._stream, ClientMessage, config.max_frame_bytes)  # type: ignore[arg-type]
        if not await self._handshake(reader):
            return
        while True:
            if not await self._wait_frame(reader):
                return
            try:
                with anyio.fail_after(config.frame_timeout_s):
                    body = await reader.read_frame()
            except FrameTooLarge as exc:
                await self.send(Error(code="frame_too_large", message=str(exc)))
                return
            except TimeoutError:
                log.warning("frame_timeout", seconds=config.frame_timeout_s)
                await self.send(Error(code="protocol_error", message=f"a frame took longer than {config.frame_timeout_s:g} s to arrive"))
                return
            except anyio.IncompleteRead:
                return
            if body is None:
                return
            try:
                message = reader.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                await self.send(Error(code="invalid_message", message=str(exc)))
                continue
            await self._dispatch(message, tg)

    async def _wait_frame(self, reader: FrameReader) -> bool:
        """Wait for the next frame to begin; False when the client left or stayed idle too long
        (no frame for `idle_timeout_s` while none of its requests is live)."""
        idle = self._server.config.idle_timeout_s
        while True:
            with anyio.move_on_after(idle):
                return await reader.wait_frame()
            if not self._requests:
                log.info("idle_connection_closed", seconds=idle)
                await self.send(Error(code="protocol_error", message=f"closed after {idle:g} s without a request"))
                return False

    async def _handshake(self, reader: FrameReader) -> bool:
        """Read the Hello and settle this connection's protocol version; any other first frame, or
        a version this server does not speak, is refused (naming the versions it does)."""
        with anyio.move_on_after(self._server.config.handshake_timeout_s):
            try:
                body = await reader.read_frame()
                hello = reader.decode(body) if body is not None else None
            except (FrameTooLarge, anyio.IncompleteRead, msgspec.DecodeError, msgspec.ValidationError):
                hello = None
            if not isinstance(hello, Hello):
                await self.send(_version_refusal("the first frame must be a Hello"))
                return False
            if hello.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS:
                log.info("protocol_version_refused", protocol_version=hello.protocol_version)
                await self.send(_version_refusal(f"protocol version {hello.protocol_version} is not supported"))
                return False
            self._version = hello.protocol_version
            await self.send(self._server.welcome(self._version))
            return True
        log.warning("handshake_timeout", seconds=self._server.config.handshake_timeout_s)
        return False

    async def _dispatch(self, message, tg: TaskGroup) -> None:
        match message:
            case Generate(request=request):
                await self._start(request.request_id, tg, lambda: self._runtime.submit(request))
            case Resume(request_id=rid):
                await self._start(rid, tg, lambda: self._runtime.submit_resume(rid))
            case Cancel(request_id=rid):
                if rid in self._requests:
                    await self._runtime.cancel(rid)
                else:
                    await self.send(Error(code="unknown_request", message="no such request on this connection", request_id=rid))
            case GetStats():
                stats = await self._runtime.stats()
                await self.send(msgspec.structs.replace(stats, connections=len(self._server.connections)))
            case AdapterCommand():
                await self.send(await self._adapters(message))
            case Hello():
                await self.send(Error(code="protocol_error", message="Hello was already received"))

    async def _adapters(self, command: AdapterCommand) -> Adapters:
        rt = self._runtime
        try:
            if command.op == "load":
                await rt.load_adapter(command.name, command.path, pinned=command.pinned)
            elif command.op == "unload":
                await rt.unload_adapter(command.name)
            return Adapters(adapters=await rt.adapters())
        except MlxrtError as exc:
            return Adapters(adapters=[], code=error_code(exc), message=str(exc), field=getattr(exc, "field", None))

    async def _start(self, rid: str | None, tg: TaskGroup, submit) -> None:
        """Submit now (the runtime claims the id, and refuses a live one, before anything else
        is read), then forward the request's events from a task of its own."""
        if not rid:
            await self.send(Error(code="invalid_request", message="request_id is required on the socket", field="request_id"))
            return
        try:
            stream = submit()
        except MlxrtError as exc:
            await self.send(_refusal(rid, exc))
            return
        self._requests.add(rid)
        tg.start_soon(self._forward, stream, name=f"forward-{rid}")

    async def _forward(self, stream) -> None:
        rid = stream.request_id
        try:
            refusal = None
            try:
                async with stream:
                    async for event in stream:
                        await self.send(event)
                        if isinstance(event, Finished):
                            break
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                raise
            except MlxrtError as exc:
                refusal = _refusal(rid, exc)
            except Exception as exc:
                log.exception("request_failed", request_id=rid)
                refusal = Error(code="internal", message=f"the request failed ({type(exc).__name__}); the server log has the details", request_id=rid)
            if refusal is not None:
                await self.send(refusal)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the client is gone; its requests are being cancelled
        finally:
            self._requests.discard(rid)


def _version_refusal(reason: str) -> Error:
    """The Error that ends a handshake: why, and the versions a client may ask for."""
    versions = ", ".join(map(str, SUPPORTED_PROTOCOL_VERSIONS))
    message = f"{reason}; this server speaks protocol versions {versions}: send Hello(protocol_version=N) with one of them first"
    return Error(code="protocol_error", message=message, supported_versions=list(SUPPORTED_PROTOCOL_VERSIONS))


def _refusal(rid: str, exc: MlxrtError) -> Error:
    """The Error frame for a request the runtime refused."""
    return Error(code=error_code(exc), message=str(exc), request_id=rid, field=getattr(exc, "field", None))


def peer_uid(stream: SocketStream) -> int | None:
    """The connecting process's uid (Linux SO_PEERCRED), or None where unavailable."""
    sock = stream.extra(SocketAttribute.raw_socket, None)
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


async def _send_quietly(stream: SocketStream, message: msgspec.Struct) -> None:
    try:
        with anyio.move_on_after(1.0):
            await stream.send(encode_frame(message))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass
