"""Responses every part of the HTTP front sends: JSON, and OpenAI's error JSON with the status
`protocols.errors.ERROR_KINDS` gives its code."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

from net.http import openai_types as oa
from net.http.mapping import HttpError
from protocols.errors import ERROR_KINDS

JSON = "application/json"


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, headers=headers, media_type=JSON)


def error_response(error: HttpError) -> Response:
    """OpenAI's error JSON with the code's status; 429/503 say when to retry."""
    kind = ERROR_KINDS[error.code]
    headers = {}
    if kind.http_status in (429, 503):
        headers["Retry-After"] = "1"
    if error.code == "unauthorized":
        headers["WWW-Authenticate"] = "Bearer"
    if error.code in ("body_too_large", "body_timeout"):
        headers["Connection"] = "close"  # the rest of the body is never read
    body = oa.ErrorResponse(oa.ErrorBody(message=str(error), type=kind.openai_type, param=error.param, code=error.code))
    return json_response(body, kind.http_status, headers)
