"""The typed errors callers catch, and the one table between them, wire codes and HTTP.

Every error the runtime raises on purpose is an `MlxrtError` with a `code`; the socket
server sends that code (`Error.code`) and the client raises the same class again from
it (`error_for`); the HTTP face answers with the code's status and OpenAI error type
(`ERROR_KINDS`). Pure data: no mlx, no anyio.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

ErrorCode = Literal[
    "invalid_request",  # the request failed validation (message names the field)
    "too_large",  # the request can never fit (context, prompt size or KV budget)
    "checkpoint_not_found",  # Resume: no checkpoint for that request id
    "checkpoint_invalid",  # Resume: corrupt, truncated, foreign-model or other-version checkpoint
    "busy",  # the admission queue is full; retry later
    "unavailable",  # a distributed world lost a rank: nothing runs until it is relaunched
    "duplicate_request",  # the request_id is already live
    "unknown_request",  # Cancel for an id this connection does not own
    "invalid_message",  # the frame decoded but is not a valid client message
    "frame_too_large",  # the length prefix exceeds the server's limit; the connection closes
    "protocol_error",  # out-of-order message (e.g. anything before Hello), or a refused peer
    "shutting_down",  # the server is stopping
    "internal",  # a bug; the message says what, the server's log has the details
    "adapter_not_found",  # the request or call names an adapter the runtime does not know
    "adapter_invalid",  # an adapter directory cannot be applied (format, shapes, rank, slots)
    "connection_lost",  # client side only: the connection ended before the answer
    # HTTP only:
    "unauthorized",  # no or wrong API key
    "model_not_found",  # the request names a model this server does not serve
    "not_found",  # no such route
    "method_not_allowed",  # the route exists for other methods
    "body_too_large",  # the request body exceeds server.max_body_bytes (refused before it is read)
    "body_timeout",  # the request body did not arrive within server.body_timeout_s
    "host_not_allowed",  # the Host header names a host this server does not answer (DNS rebinding)
    "unsupported_media_type",  # a POST without a JSON body and without an API key (a browser form)
    "rate_limited",  # this client is past its pace (server.client_requests_per_s, client_max_held)
]


class ErrorKind(NamedTuple):
    """How one error code is answered over HTTP: the status and OpenAI's error `type`."""

    http_status: int
    openai_type: str


# The one table: every code's HTTP status (429/503 answers carry Retry-After).
ERROR_KINDS: dict[str, ErrorKind] = {
    "invalid_request": ErrorKind(400, "invalid_request_error"),
    # A prompt too long for the context is a 400 in OpenAI's API too.
    "too_large": ErrorKind(400, "invalid_request_error"),
    "checkpoint_not_found": ErrorKind(404, "not_found_error"),
    "checkpoint_invalid": ErrorKind(422, "invalid_request_error"),
    "busy": ErrorKind(503, "server_overloaded"),
    "duplicate_request": ErrorKind(409, "invalid_request_error"),
    "unknown_request": ErrorKind(404, "not_found_error"),
    "invalid_message": ErrorKind(400, "invalid_request_error"),
    "frame_too_large": ErrorKind(413, "invalid_request_error"),
    "protocol_error": ErrorKind(400, "invalid_request_error"),
    "shutting_down": ErrorKind(503, "server_unavailable"),
    "unavailable": ErrorKind(503, "server_unavailable"),
    "internal": ErrorKind(500, "server_error"),
    "adapter_not_found": ErrorKind(404, "not_found_error"),
    "adapter_invalid": ErrorKind(422, "invalid_request_error"),
    "connection_lost": ErrorKind(502, "server_error"),
    "unauthorized": ErrorKind(401, "authentication_error"),
    "model_not_found": ErrorKind(404, "not_found_error"),
    "not_found": ErrorKind(404, "not_found_error"),
    "method_not_allowed": ErrorKind(405, "invalid_request_error"),
    "body_too_large": ErrorKind(413, "invalid_request_error"),
    "body_timeout": ErrorKind(408, "invalid_request_error"),
    "host_not_allowed": ErrorKind(421, "invalid_request_error"),
    "unsupported_media_type": ErrorKind(415, "invalid_request_error"),
    "rate_limited": ErrorKind(429, "rate_limit_error"),
}


def rebuild_error(cls: type[Exception], args: tuple, attributes: dict) -> Exception:
    """An error as `reduce_error` took it apart (its class's own `__init__` not called again)."""
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(attributes)
    return error


def reduce_error(error: Exception) -> tuple:
    """How an error with keyword or extra `__init__` arguments pickles (across to or from a
    worker process): its class, message and attributes as they are."""
    return rebuild_error, (type(error), error.args, dict(error.__dict__))


class MlxrtError(Exception):
    """Base of every error the runtime raises on purpose."""

    code: ErrorCode = "internal"

    def __reduce__(self) -> tuple:
        return reduce_error(self)


class ConfigError(MlxrtError, ValueError):
    """A config file or value is invalid; the message names the file and key."""


class DiskCacheError(ConfigError):
    """`kv.disk_cache_dir` cannot be used: not ours, open to others, not a directory."""


class DiskCacheLockedError(DiskCacheError):
    """Another server (or runtime) of the same model and KV format holds `kv.disk_cache_dir`."""


class InvalidRequestError(MlxrtError, ValueError):
    """A request was rejected before any compute; `field` names the culprit."""

    code: ErrorCode = "invalid_request"

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit (context length, prompt size or KV budget)."""

    code: ErrorCode = "too_large"


class ContextLengthError(RequestTooLargeError):
    """The prompt leaves no room in the model's context: its tokens and the context, for the
    HTTP APIs' own messages ("prompt is too long: N tokens > M maximum", context_length_exceeded)."""

    def __init__(self, message: str, *, num_tokens: int, max_context: int, field: str | None = "prompt"):
        super().__init__(message, field=field)
        self.num_tokens = num_tokens
        self.max_context = max_context


class DuplicateRequestError(InvalidRequestError):
    """The request id belongs to a request that is still live."""

    code: ErrorCode = "duplicate_request"

    def __init__(self, message: str, *, field: str | None = "request_id"):
        super().__init__(message, field=field)


class ServerBusyError(MlxrtError):
    """The admission queue is full; retry later."""

    code: ErrorCode = "busy"


class AdapterNotFoundError(InvalidRequestError):
    """The request (or an unload) names an adapter the runtime does not know."""

    code: ErrorCode = "adapter_not_found"


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this runtime does not serve."""

    code: ErrorCode = "model_not_found"


class AdapterLoadError(MlxrtError):
    """An adapter cannot be applied: not mlx-lm's LoRA format, shapes that do not fit the
    model, a rank over `lora.max_rank`, or no free adapter slot."""

    code: ErrorCode = "adapter_invalid"


class ModelLoadError(MlxrtError):
    """The model could not be loaded (missing directory, unsupported architecture)."""


class RuntimeClosedError(MlxrtError):
    """The runtime is shutting down or has failed; no new requests are taken."""

    code: ErrorCode = "shutting_down"


class UnavailableError(MlxrtError):
    """What the request needs cannot be had now, through no fault of the caller's (a lost rank,
    a model of a pool that could not be loaded); the message says what."""

    code: ErrorCode = "unavailable"


class ModelUnavailableError(UnavailableError, ModelLoadError):
    """A pool's model could not be loaded for a request (its files, or the configuration it
    shares with the pool's other models): a 503 naming why; the other models keep serving."""


class WorldUnavailableError(UnavailableError):
    """A rank of the distributed world died or stalled past `distributed.step_timeout_s`: the
    requests it was running ended, and no request runs until the world is relaunched."""


class InternalError(MlxrtError):
    """Something failed that is not the caller's fault; details are in the log."""

    code: ErrorCode = "internal"


class CheckpointError(MlxrtError):
    """A checkpoint cannot be used to resume."""

    code: ErrorCode = "checkpoint_invalid"


class CheckpointNotFoundError(CheckpointError):
    code: ErrorCode = "checkpoint_not_found"


class CorruptCheckpointError(CheckpointError):
    """Truncated, altered, not a regular file, or not a checkpoint at all."""


class UnsupportedCheckpointError(CheckpointError):
    """Written by another format version."""


class ForeignCheckpointError(CheckpointError):
    """Written for another model or tokenizer."""


class ServerError(MlxrtError):
    """An error frame with a connection-level code (protocol, frame, unknown request)."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code  # per instance: several connection-level codes share this class


class ConnectionLostError(ServerError):
    """The connection to the server ended before the answer."""

    def __init__(self, message: str = "the server closed the connection"):
        super().__init__("connection_lost", message)


_BY_CODE: dict[str, type[MlxrtError]] = {
    cls.code: cls
    for cls in (
        InvalidRequestError,
        RequestTooLargeError,
        DuplicateRequestError,
        ServerBusyError,
        RuntimeClosedError,
        InternalError,
        CheckpointError,
        CheckpointNotFoundError,
        AdapterNotFoundError,
        AdapterLoadError,
        ModelNotFoundError,
        UnavailableError,
    )
}


def error_code(exc: BaseException) -> ErrorCode:
    """The wire code for an exception (`internal` for anything not raised on purpose)."""
    return exc.code if isinstance(exc, MlxrtError) else "internal"


def error_for(code: str, message: str, field: str | None = None) -> MlxrtError:
    """The exception a client raises for an error frame."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return ServerError(code, message)  # type: ignore[arg-type]
    if issubclass(cls, InvalidRequestError):
        return cls(message, field=field)
    return cls(message)
