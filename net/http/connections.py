"""The HTTP front's connections, guarded: uvicorn's h11 protocol with deadlines and a cap.

uvicorn waits for a request's head without a deadline, arms its keep-alive timer only after a
response (and disarms it on any byte, so a client dripping a header keeps its connection for
good), and keeps a finished response in memory for as long as its client does not read it.
`guarded_protocol` returns uvicorn's `H11Protocol` with, per connection:
- a head deadline: once a connection opens or goes idle (its last response sent), a complete
  request head must arrive within `server.http_header_timeout_s`, however many bytes trickle in;
- a write deadline: a response the client leaves unread (the transport's buffer full, writing
  paused) for `server.client_stall_timeout_s` is aborted, its buffered bytes dropped;
and a cap on open connections (`server.http_max_open_connections`): a connection beyond it
evicts the idle connection that waited longest (a busy one is never evicted), or is closed
itself when every connection is busy. `ConnectionGuard.run` sweeps the deadlines once a second
and logs what it closed at most every `LOG_EVERY_S`, so a flood cannot flood the log.
"""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass, field

import anyio
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger(actor="http")

SWEEP_S = 1.0
LOG_EVERY_S = 10.0
# Descriptors kept for everything but HTTP connections (the socket server, model and checkpoint
# files, the event loop's own): the cap is lowered to fit the process's limit.
RESERVED_FDS = 256


@dataclass
class GuardStats:
    """Connections the guard closed, by why (since the server started)."""

    head_timeouts: int = 0
    write_stalls: int = 0
    evicted: int = 0
    refused: int = 0

    def total(self) -> int:
        return self.head_timeouts + self.write_stalls + self.evicted + self.refused


@dataclass
class ConnectionGuard:
    max_open: int
    head_timeout_s: float
    stall_timeout_s: float
    # Open connections, oldest first (a dict keeps insertion order).
    open: dict[GuardedH11Protocol, None] = field(default_factory=dict)
    stats: GuardStats = field(default_factory=GuardStats)
    _logged: GuardStats = field(default_factory=GuardStats)

    def admit(self, connection: GuardedH11Protocol) -> bool:
        """Room for a new connection: an idle one goes if the cap is reached; False if none is."""
        if len(self.open) >= self.max_open:
            victim = next((c for c in self.open if c.idle_since is not None), None)
            if victim is None:
                self.stats.refused += 1
                return False
            self.stats.evicted += 1
            victim.abort()
        self.open[connection] = None
        return True

    def forget(self, connection: GuardedH11Protocol) -> None:
        self.open.pop(connection, None)

    def sweep(self, now: float) -> None:
        for connection in list(self.open):
            if connection.idle_since is not None and now - connection.idle_since > self.head_timeout_s:
                self.stats.head_timeouts += 1
                connection.abort()
            elif connection.paused_since is not None and now - connection.paused_since > self.stall_timeout_s:
                self.stats.write_stalls += 1
                connection.abort()

    async def run(self) -> None:
        """Sweep until cancelled; log what was closed, in one line per `LOG_EVERY_S` at most."""
        last_log = time.monotonic()
        while True:
            await anyio.sleep(SWEEP_S)
            now = time.monotonic()
            self.sweep(now)
            if now - last_log >= LOG_EVERY_S and self.stats.total() != self._logged.total():
                s, before = self.stats, self._logged
                log.warning(
                    "http_connections_closed",
                    head_timeouts=s.head_timeouts - before.head_timeouts,
                    write_stalls=s.write_stalls - before.write_stalls,
                    evicted=s.evicted - before.evicted,
                    refused=s.refused - before.refused,
                    open=len(self.open),
                )
                self._logged, last_log = GuardStats(**vars(s)), now


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a `ConnectionGuard` (set on the subclass `guarded_protocol` makes)."""

    guard: ConnectionGuard
    # Since when it waits for a request head (None while a request is being served), and since
    # when the client has left its response unread (None while writing flows).
    idle_since: float | None = None
    paused_since: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = time.monotonic()
        if not self.guard.admit(self):
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        self.idle_since = self.paused_since = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # a complete head starts a cycle: no longer idle
        if self.cycle is not None and not self.cycle.response_complete:
            self.idle_since = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is None or self.cycle.response_complete:
            self.idle_since = time.monotonic()

    def pause_writing(self) -> None:
        super().pause_writing()
        self.paused_since = time.monotonic()

    def resume_writing(self) -> None:
        super().resume_writing()
        self.paused_since = None

    def abort(self) -> None:
        """Close now, dropping whatever the client left unread."""
        self.guard.forget(self)
        self.idle_since = self.paused_since = None
        self.transport.abort()  # (also when already closing: its unsent bytes are dropped)


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to `guard`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})


def open_connections_cap(configured: int) -> int:
    """The cap on open HTTP connections this process can hold: the configured one, lowered to
    what the descriptor limit leaves (raised to its hard limit first; mlx-lm lowers it to 2,048)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    room = max(16, soft - RESERVED_FDS) if soft != resource.RLIM_INFINITY else configured
    if configured > room:
        log.warning("http_connection_cap_lowered", configured=configured, cap=room, fd_limit=soft)
    return min(configured, room)
