"""mlxrt's public face: the embedding API, config, and errors.

Importing this package first gives MLX a fast BLAS on Linux (see `runtime.blas`): it
must run before anything imports `mlx.core`, so it comes before the imports below.
"""

from typing import TYPE_CHECKING

from runtime import blas as _blas
from runtime import env as _env

_blas.ensure_fast_blas(_env.get("BLAS"))

from protocols.stats import Stats  # noqa: E402
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

if TYPE_CHECKING:
    from runtime.runtime import Runtime


def __getattr__(name: str):
    # The runtime (and with it MLX, mlx-lm and transformers: seconds of imports) loads on first
    # use, so a socket client or a config check starts in a blink.
    if name == "Runtime":
        from runtime import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "InvalidRequestError",
    "MlxrtError",
    "ModelLoadError",
    "RequestTooLargeError",
    "Runtime",
    "RuntimeClosedError",
    "RuntimeConfig",
    "ServerBusyError",
    "Stats",
]
