"""mlxrt's public face: the embedding API, config, and errors.

Importing this package first gives MLX a fast BLAS on Linux (see `runtime.blas`).
"""

from runtime import blas as _blas
from runtime import env as _env

_blas.ensure_fast_blas(_env.get("BLAS"))

from runtime.config import RuntimeConfig  # noqa: E402
from runtime.errors import (  # noqa: E402
    ConfigError,
    InvalidRequestError,
    MlxrtError,
    ModelLoadError,
    RequestTooLargeError,
    RuntimeClosedError,
    ServerBusyError,
)

__all__ = [
    "ConfigError",
    "InvalidRequestError",
    "MlxrtError",
    "ModelLoadError",
    "RequestTooLargeError",
    "Runtime",
    "RuntimeClosedError",
    "RuntimeConfig",
    "RuntimeStats",
    "ServerBusyError",
]


def __getattr__(name: str):
    # Lazy: actor modules import runtime.mailbox, and runtime.runtime imports the actors.
    if name in ("Runtime", "RuntimeStats"):
        from runtime import runtime as _runtime

        return getattr(_runtime, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
