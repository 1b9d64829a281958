"""mlxrt's public face: the embedding API, config, and errors.

Importing this package first gives MLX a fast BLAS on Linux (see `runtime.blas`): it
must run before anything imports `mlx.core`, so it comes before the imports below.
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
from runtime.runtime import Runtime, RuntimeStats  # noqa: E402

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
