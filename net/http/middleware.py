"""The HTTP front's middleware, outermost first in `build_app`: responses counted by route
and status; the Host header checked against the names the server answers and POST bodies
required to be JSON unless a key is set (browsers: DNS rebinding, cross-site forms); API
requests in flight capped; CORS; the API keys (a bearer token, or Anthropic's `x-api-key`),
the one a request proved recorded in its scope (`OWNER`) as a fingerprint, for the routes that
keep what a key made its own (the Responses API's store). Refusals use the error JSON of the
route's API (`responses.error_body_for`)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from net.http.errors import HttpError
from net.http.responses import anthropic_route, error_body_for, error_response

PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/health",
    "/metrics",
)
# Routes with a parameter, counted under their pattern (not one label per id).
PATTERNS = (("/v1/models/", "/v1/models/{model}"), ("/v1/responses/", "/v1/responses/{response_id}"))


# The scope key holding the fingerprint of the API key a request proved ("" without keys).
OWNER = "mlxrt.owner"
# Fingerprints are keyed per process: they name a key within this process and let no one test a
# guessed key against one seen elsewhere (a log, a dump); what they tag is lost on restart too.
_FINGERPRINT_KEY = secrets.token_bytes(32)


def owner_fingerprint(api_key: bytes) -> str:
    """The owner recorded for what a request with `api_key` makes: a keyed hash, never the key."""
    return hmac.new(_FINGERPRINT_KEY, api_key, hashlib.sha256).hexdigest()


def request_owner(scope: Scope) -> str:
    """The fingerprint of the key the request proved; "" when the server has no keys."""
    return scope.get(OWNER, "")


class KeyRing:
    """The server's API keys: which one a request's headers prove (`Authorization: Bearer <key>`
    or Anthropic's `x-api-key: <key>`), compared in constant time against every key."""

    def __init__(self, api_keys: Iterable[str]):
        self._keys = [(key.encode(), owner_fingerprint(key.encode())) for key in dict.fromkeys(api_keys) if key]
        assert self._keys, "a key ring without a key"

    def owner(self, headers: dict[bytes, bytes]) -> str | None:
        """The fingerprint of the key the headers prove, or None."""
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = token.strip() if scheme.lower() == b"bearer" else b""
        return self._owner(bearer) or self._owner(headers.get(b"x-api-key", b"").strip())

    def _owner(self, token: bytes) -> str | None:
        """The fingerprint of the key `token` is; every key is compared, so the time taken tells nothing."""
        found = None
        for key, fingerprint in self._keys:
            if hmac.compare_digest(token, key):
                found = fingerprint
        return found


class Authorization:
    """API-key check for every path but the open ones (`KeyRing`). The key's fingerprint goes
    into the scope (`OWNER`)."""

    def __init__(self, app: ASGIApp, api_keys: Iterable[str], open_paths: tuple[str, ...] = ("/health",)):
        self.app = app
        self._keys = KeyRing(api_keys)
        self._open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open:
            owner = self._keys.owner(dict(scope["headers"]))
            if owner is None:
                how = "x-api-key: <key>, or Authorization: Bearer <key>" if anthropic_route(scope["path"]) else "Authorization: Bearer <key>"
                response = error_response(HttpError("unauthorized", f"a valid API key is required ({how})"), error_body_for(scope["path"]))
                await response(scope, receive, send)
                return
            scope = {**scope, OWNER: owner}
        await self.app(scope, receive, send)


class ResponseCounter:
    """Counts responses by route and status (`mlxrt:http_responses_total`; status "none" when
    the client left before one was sent)."""

    def __init__(self, app: ASGIApp, counter: Counter, model_name: str):
        self.app = app
        self._counter = counter
        self._model_name = model_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in PATHS else next((pattern for prefix, pattern in PATTERNS if path.startswith(prefix)), "other")
        status = "none"

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self._counter.labels(self._model_name, route, status).inc()


class RequestLimit:
    """At most `limit` API requests in flight (`server.http_max_connections`): past it, OpenAI's
    503 JSON with Retry-After. /health and /metrics are always answered (connections are
    guarded below the app: `net.http.connections`)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self._limit = limit
        self._in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/metrics"):
            await self.app(scope, receive, send)
            return
        if self._in_flight >= self._limit:
            busy = HttpError("busy", f"{self._limit} HTTP requests are in flight (server.http_max_connections); retry later")
            await error_response(busy, error_body_for(scope["path"]))(scope, receive, send)
            return
        self._in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._in_flight -= 1


class BrowserGuard:
    """What a web page in the user's browser must not do to a local server: address it under
    another name (a DNS-rebinding page resolves its own name to 127.0.0.1: the Host header names
    it), or POST to it without a CORS preflight (forms and `text/plain` need none; a JSON body
    does). `allowed_hosts` None = any host; `json_only` is off when an API key guards the API."""

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str] | None, json_only: bool):
        self.app = app
        self._hosts = allowed_hosts
        self._json_only = json_only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error = self._refusal(scope["method"], headers.get(b"host", b""), headers.get(b"content-type", b""))
            if error is not None:
                await error_response(error, error_body_for(scope["path"]))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, method: str, host: bytes, content_type: bytes) -> HttpError | None:
        if self._hosts is not None and host_name(host) not in self._hosts:
            return HttpError("host_not_allowed", "this server does not answer to that Host (server.http_allowed_hosts)")
        if self._json_only and method == "POST" and content_type.split(b";")[0].strip().lower() != b"application/json":
            return HttpError("unsupported_media_type", "POST bodies must be JSON (Content-Type: application/json)")
        return None


def host_name(header: bytes) -> str:
    """The host of a Host header, lower-case, without its port or IPv6 brackets."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text
