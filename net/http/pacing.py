"""Per-client pacing of the HTTP API: a client resending what is refused, or sending faster than
allowed, is slowed to a rate, whatever the size of its requests.

A client is the API key its request proves (its fingerprint) or, without one, its address (all
of a host's keyless clients are one client). Two rates, each a generic cell rate (GCRA: a
"theoretical arrival time" per client, so a burst is allowed and the rate holds on average):

- **refusals** (`server.client_refusals_per_s`, bursts of `client_refusal_burst`): a client's
  4xx answers past its rate are held back until their turn, at most `client_max_delay_s` each.
  Resending a refused request as soon as it is answered (what a buggy retry loop or a flood
  does: each costs the server's event loop its parsing and checking, under the GIL the MLX
  thread needs) is then that rate at most. While `client_max_held` of its answers are held,
  its new requests are refused at once (429, Retry-After), before their bodies are read.
- **requests** (`server.client_requests_per_s`, bursts of `client_request_burst`; off by
  default: a local load generator is one client): a request past the rate waits its turn before
  its body is read, or is refused (429) when that is more than `client_max_delay_s` away.

/health and /metrics are never paced. The table of clients is bounded (`MAX_CLIENTS`: those
whose times have passed go first)."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from net.http.errors import HttpError
from net.http.middleware import KeyRing
from net.http.responses import error_body_for, error_response
from protocols.config import ServerConfig

MAX_CLIENTS = 4096
OPEN_PATHS = ("/health", "/metrics")


class Cell:
    """A generic cell rate: `rate` a second, bursts of `burst`, per key."""

    def __init__(self, rate: float, burst: int):
        self.interval = 1.0 / rate
        self.tolerance = burst * self.interval
        self._tat: dict[str, float] = {}

    def reserve(self, key: str, now: float, max_wait: float) -> float | None:
        """Take a turn: the seconds until it comes (0: now), or None (nothing taken) when it is
        more than `max_wait` away."""
        tat = max(self._tat.get(key, now), now) + self.interval
        return None if tat - now - self.tolerance > max_wait else self.charge(key, now)

    def charge(self, key: str, now: float) -> float:
        """Take a turn however far away: the seconds until it comes."""
        if len(self._tat) >= MAX_CLIENTS and key not in self._tat:
            self._forget(now)
        tat = self._tat[key] = max(self._tat.get(key, now), now) + self.interval
        return max(0.0, tat - now - self.tolerance)

    def _forget(self, now: float) -> None:
        """Clients whose turns have all come are as good as new; if none, the one due soonest."""
        for key in [key for key, tat in self._tat.items() if tat <= now]:
            del self._tat[key]
        if len(self._tat) >= MAX_CLIENTS:
            del self._tat[min(self._tat, key=self._tat.__getitem__)]


class ClientPacing:
    """The pacing middleware (see the module)."""

    def __init__(
        self,
        app: ASGIApp,
        config: ServerConfig,
        held: dict[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ):
        self.app = app
        keys = [key for key in (config.api_key, *config.api_keys) if key]
        self._keys = KeyRing(keys) if keys else None
        self._refusals = Cell(config.client_refusals_per_s, config.client_refusal_burst) if config.client_refusals_per_s else None
        self._requests = Cell(config.client_requests_per_s, config.client_request_burst) if config.client_requests_per_s else None
        self._max_delay = config.client_max_delay_s
        self._max_held = config.client_max_held
        self._held: dict[str, int] = held if held is not None else {}  # answers held back, by client (`/metrics` reads it)
        self._clock, self._sleep = clock, sleep

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or (self._refusals is None and self._requests is None):
            await self.app(scope, receive, send)
            return
        client = self._client(scope)
        held = self._held.get(client, 0)
        if held >= self._max_held:
            await self._refuse(scope, receive, send, f"{held} of this client's refused requests are being answered slowly", self._max_delay)
            return
        if self._requests is not None:
            wait = self._requests.reserve(client, self._clock(), self._max_delay)
            if wait is None:
                await self._refuse(scope, receive, send, "this client sends requests faster than server.client_requests_per_s", self._max_delay)
                return
            if wait:
                await self._sleep(wait)
        if self._refusals is None:
            await self.app(scope, receive, send)
            return
        refusals = self._refusals

        async def pacing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                wait = min(refusals.charge(client, self._clock()), self._max_delay)
                if wait:
                    await self._hold(client, wait)
            await send(message)

        await self.app(scope, receive, pacing_send)

    async def _hold(self, client: str, wait: float) -> None:
        self._held[client] = self._held.get(client, 0) + 1
        try:
            await self._sleep(wait)
        finally:
            self._held[client] -= 1
            if not self._held[client]:
                del self._held[client]

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, why: str, retry_after: float) -> None:
        response = error_response(HttpError("rate_limited", f"{why}; retry later"), error_body_for(scope["path"]))
        response.headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        response.headers["Connection"] = "close"  # (its body is never read)
        await response(scope, receive, send)

    def _client(self, scope: Scope) -> str:
        """The key's fingerprint when the request proves one, else the peer's address."""
        if self._keys is not None:
            owner = self._keys.owner(dict(scope["headers"]))
            if owner is not None:
                return owner
        peer = scope.get("client")
        return f"address:{peer[0]}" if peer else "address:local"
