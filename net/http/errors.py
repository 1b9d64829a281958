"""The HTTP layer's errors: `HttpError` (a refusal with its code and the parameter at fault), a
runtime error as one (`error_of`, naming the OpenAI or Anthropic parameter a runtime field came
from), OpenAI's error JSON (`openai_error`), and a body decoded as a typed request or a 400
naming the field (`decode_body`)."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from net.http import openai_types as oa
from protocols.errors import ERROR_KINDS, ContextLengthError, ErrorCode, MlxrtError, error_code, reduce_error

T = TypeVar("T")


class HttpError(Exception):
    """A request refused by the HTTP layer itself (auth, routing, body, model name)."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param

    def __reduce__(self) -> tuple:
        return reduce_error(self)


class ContextLengthExceeded(HttpError):
    """A prompt with no room in the model's context, with its figures: each API words it its
    own way (OpenAI's code `context_length_exceeded`, Anthropic's "prompt is too long")."""

    def __init__(self, message: str, param: str | None, *, num_tokens: int, max_context: int):
        super().__init__("too_large", message, param)
        self.num_tokens = num_tokens
        self.max_context = max_context


def error_of(exc: BaseException, *, endpoint: str = "chat") -> HttpError:
    """The HTTP answer for a runtime error: its code, message and the OpenAI param at fault."""
    if isinstance(exc, HttpError):
        return exc
    field = getattr(exc, "field", None) if isinstance(exc, MlxrtError) else None
    message = str(exc) if isinstance(exc, MlxrtError) else "internal error; the server log has the details"
    if isinstance(exc, ContextLengthError):
        return ContextLengthExceeded(message, param_of(field, endpoint), num_tokens=exc.num_tokens, max_context=exc.max_context)
    return HttpError(error_code(exc), message, param_of(field, endpoint))


# Runtime field names as the Responses API's parameters (endpoint "responses").
RESPONSES_PARAMS = {"messages": "input", "prompt": "input", "prompt_ids": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def param_of(field: str | None, endpoint: str) -> str | None:
    """A runtime field name as the OpenAI (or Anthropic, endpoint "messages") parameter it came from."""
    if field is None:
        return None
    field = field.removeprefix("sampling.")
    if endpoint == "responses":
        return RESPONSES_PARAMS.get(field, field)
    if field in ("prompt", "prompt_ids"):
        return "messages" if endpoint in ("chat", "messages") else "prompt"
    if field == "stop" and endpoint == "messages":
        return "stop_sequences"
    return field


def openai_error(error: HttpError) -> tuple[oa.ErrorResponse, int]:
    """OpenAI's error JSON for an error, and its HTTP status (`ERROR_KINDS`)."""
    kind = ERROR_KINDS[error.code]
    if isinstance(error, ContextLengthExceeded):  # (OpenAI's words and code, which clients such as the Codex CLI act on)
        message = f"This model's maximum context length is {error.max_context} tokens. However, your input resulted in {error.num_tokens} tokens. Please reduce the length of the input."
        return oa.ErrorResponse(oa.ErrorBody(message=message, type=kind.openai_type, param=error.param, code="context_length_exceeded")), kind.http_status
    return oa.ErrorResponse(oa.ErrorBody(message=str(error), type=kind.openai_type, param=error.param, code=error.code)), kind.http_status


_AT = re.compile(r"^(?P<text>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def decode_body(body: bytes, kind: type[T]) -> T:
    """A request body as `kind`; a 400 naming the field (e.g. `messages[0].role`) otherwise."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        assert match is not None  # the pattern matches any text
        path = (match["path"] or "").lstrip(".") or None
        raise HttpError("invalid_request", f"{match['text']}{f' (at {path})' if path else ''}", path) from None
    except msgspec.DecodeError as exc:
        raise HttpError("invalid_request", f"the body is not valid JSON: {exc}") from None
