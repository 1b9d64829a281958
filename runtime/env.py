"""The one place the runtime reads its environment: variables named `MLXRT_*`.

Known names: MLXRT_BLAS (path to a BLAS library, or "off"), MLXRT_HOME (where
built-in models are cached), and the config overrides listed in `runtime.config`.
"""

from __future__ import annotations

import os

PREFIX = "MLXRT_"


def get(name: str) -> str | None:
    return os.environ.get(PREFIX + name)


def overrides() -> dict[str, str]:
    """Every MLXRT_* variable, without the prefix."""
    return {k[len(PREFIX) :]: v for k, v in os.environ.items() if k.startswith(PREFIX)}
