"""`HttpServer`: the HTTP app (`net.http.app`) on uvicorn, in the serving process's event loop.

It binds before the model loads (a taken port fails fast, and /health answers "loading"),
serves the runtime once `attach`ed, and on `stop()` turns /health to "draining", stops
accepting, and gives open responses `SHUTDOWN_GRACE_S` to finish (the runtime's shutdown
ends their requests) before closing what is left. Signals stay with the caller (`mlxrt
serve` handles SIGINT/SIGTERM for the socket and HTTP together). Needs the asyncio backend.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket

import anyio
import uvicorn

from net.http.app import Api, build_app
from net.http.connections import ConnectionGuard, guarded_protocol, open_connections_cap
from protocols.errors import ConfigError
from runtime.config import RuntimeConfig
from runtime.serving import Serving

SHUTDOWN_GRACE_S = 5.0
LOOPBACK = "127.0.0.1"


def parse_address(text: str) -> tuple[str, int]:
    """`server.http` as (host, port): "8000" and ":8000" mean 127.0.0.1; "[::1]:8000" for IPv6."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or LOOPBACK
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"`server.http` must be host:port or a port, got {text!r}")
    return host, int(port)


def allowed_hosts(configured: list[str], bound: str) -> frozenset[str] | None:
    """Host names requests may address (None: any): the configured ones, else the loopback
    names when bound to loopback (a DNS-rebinding page sends its own name)."""
    if "*" in configured:
        return None
    if configured:
        return frozenset(h.lower().strip("[]") for h in configured)
    return frozenset({"localhost", "127.0.0.1", "::1"}) if is_loopback(bound) else None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _Uvicorn(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()  # the serving process handles signals itself


class HttpServer:
    def __init__(self, config: RuntimeConfig):
        self.host, self.port = parse_address(config.server.http)
        server = config.server
        hosts = allowed_hosts(server.http_allowed_hosts, self.host)
        self.api = Api(config.server, config.model_name, allowed_hosts=hosts, store_share=config.limits.max_response_store_share)
        self.app = build_app(self.api)
        # Connections are guarded here (deadlines, a cap with idle eviction); requests by the
        # app (`RequestLimit`): uvicorn's own limit counted idle sockets and answered 503 to all.
        self.guard = ConnectionGuard(open_connections_cap(server.http_max_open_connections), server.http_header_timeout_s, server.client_stall_timeout_s)
        self._uvicorn = _Uvicorn(
            uvicorn.Config(
                self.app,
                http=guarded_protocol(self.guard),
                lifespan="off",
                log_config=None,
                log_level="warning",
                access_log=False,
                proxy_headers=False,
                server_header=False,
                timeout_keep_alive=int(max(1, server.http_keepalive_s)),
                timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
            )
        )
        self._stopped = anyio.Event()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def bind(self) -> socket.socket:
        """The listening socket; raises `ConfigError` if the address cannot be used."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named, so asyncio sets TCP_NODELAY on accepted connections (it checks the
        # protocol): without it, Nagle holds each event behind the previous one's delayed ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(2048)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {self.host}:{self.port} (server.http): {exc.strerror}") from None
        self.port = sock.getsockname()[1]  # the one the system picked for port 0
        return sock

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until `stop()`; signals readiness (the socket is bound) with the URL."""
        sock = self.bind()
        try:
            task_status.started(self.url)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.guard.run)
                await self._uvicorn.serve(sockets=[sock])
                tg.cancel_scope.cancel()
        finally:
            sock.close()
            self._stopped.set()

    def attach(self, runtime: Serving) -> None:
        self.api.attach(runtime)

    def stop(self) -> None:
        """Drain: refuse new requests, let open responses end, then close."""
        self.api.draining = True
        self._uvicorn.should_exit = True

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
