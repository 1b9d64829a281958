"""The runtime's exception types (defined in `protocols.errors`), and task-group plumbing."""

from __future__ import annotations

from contextlib import contextmanager

from protocols.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    ConnectionLostError,
    CorruptCheckpointError,
    DuplicateRequestError,
    ForeignCheckpointError,
    InternalError,
    InvalidRequestError,
    MlxrtError,
    ModelLoadError,
    ModelNotFoundError,
    ModelUnavailableError,
    RequestTooLargeError,
    RuntimeClosedError,
    ServerBusyError,
    ServerError,
    UnavailableError,
    UnsupportedCheckpointError,
    WorldUnavailableError,
)

__all__ = [
    "AdapterLoadError",
    "AdapterNotFoundError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "ConnectionLostError",
    "CorruptCheckpointError",
    "DuplicateRequestError",
    "ForeignCheckpointError",
    "InternalError",
    "InvalidRequestError",
    "MlxrtError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelUnavailableError",
    "RequestTooLargeError",
    "RuntimeClosedError",
    "ServerBusyError",
    "ServerError",
    "UnavailableError",
    "UnsupportedCheckpointError",
    "WorldUnavailableError",
    "single_errors",
]


@contextmanager
def single_errors():
    """Re-raise a task group's lone failure as itself rather than wrapped in an ExceptionGroup."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from group
        raise
