"""The runtime's exception types: what callers catch."""

from __future__ import annotations

from contextlib import contextmanager


class MlxrtError(Exception):
    """Base of every error the runtime raises on purpose."""


class ConfigError(MlxrtError, ValueError):
    """A config file or value is invalid; the message names the file and key."""


class InvalidRequestError(MlxrtError, ValueError):
    """A request was rejected before any compute; `field` names the culprit."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class ServerBusyError(MlxrtError):
    """The admission queue is full; retry later."""


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit (context length or KV budget)."""


class ModelLoadError(MlxrtError):
    """The model could not be loaded (missing directory, unsupported architecture)."""


class RuntimeClosedError(MlxrtError):
    """The runtime is shutting down or has failed; no new requests are taken."""


@contextmanager
def single_errors():
    """Re-raise a task group's lone failure as itself rather than wrapped in an ExceptionGroup."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from group
        raise
