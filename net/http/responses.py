"""Responses every part of the HTTP front sends: JSON, and the error JSON of the route's API
(OpenAI's, or Anthropic's under /v1/messages) with the status `protocols.errors.ERROR_KINDS`
gives its code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from starlette.responses import Response

from net.http.anthropic import anthropic_error
from net.http.errors import HttpError, openai_error
from protocols.errors import ERROR_KINDS

# An error's JSON body and HTTP status, in one API's shape.
ErrorBody = Callable[[HttpError], tuple[Any, int]]

JSON = "application/json"


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, headers=headers, media_type=JSON)


def anthropic_route(path: str) -> bool:
    """A path of Anthropic's Messages API (/v1/messages and below)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body_for(path: str) -> ErrorBody:
    """The error shape of the API a path belongs to: Anthropic's under /v1/messages, else OpenAI's."""
    return anthropic_error if anthropic_route(path) else openai_error


def error_response(error: HttpError, body_of: ErrorBody = openai_error) -> Response:
    """The error JSON (OpenAI's by default) with its status; 429/503 say when to retry."""
    kind = ERROR_KINDS[error.code]
    headers = {}
    if kind.http_status in (429, 503):
        headers["Retry-After"] = "1"
    if error.code == "unauthorized":
        headers["WWW-Authenticate"] = "Bearer"
    if error.code in ("body_too_large", "body_timeout"):
        headers["Connection"] = "close"  # the rest of the body is never read
    body, status = body_of(error)
    return json_response(body, status, headers)
