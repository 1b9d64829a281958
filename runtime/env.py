"""The one place the runtime reads its environment: variables named `MLXRT_*`.

Known names: MLXRT_BLAS (path to a BLAS library, or "off"), MLXRT_HOME (where
built-in models are cached), MLXRT_DISTRIBUTED_SECRET (a distributed world's shared secret,
never a config key), MLXRT_NATIVE ("0" turns mlxrt's CPU kernels off; read where they load,
`engine.native`, below this layer), MLXRT_MALLOC ("system": `mlxrt serve` keeps the system's malloc,
not jemalloc; `runtime.allocator`), and config overrides `MLXRT_<SECTION>_<KEY>`
(e.g. MLXRT_SERVER_SOCKET, MLXRT_SCHEDULER_MAX_BATCH_SIZE; see runtime.config).
"""

from __future__ import annotations

import os
from pathlib import Path

from protocols.config import WORLD_SECRET_VARIABLE

PREFIX = "MLXRT_"


def get(name: str) -> str | None:
    return os.environ.get(PREFIX + name)


def environment() -> dict[str, str]:
    """Every MLXRT_* variable that may override config (`MLXRT_<SECTION>_<KEY>`, see
    runtime.config): all but the world's secret, which never enters the config tree."""
    return {k: v for k, v in os.environ.items() if k.startswith(PREFIX) and k != WORLD_SECRET_VARIABLE}


def world_secret() -> str:
    """$MLXRT_DISTRIBUTED_SECRET: the secret a world's control connections prove ("" = unset)."""
    return os.environ.get(WORLD_SECRET_VARIABLE, "")


def runtime_dir() -> str | None:
    """$XDG_RUNTIME_DIR: the per-user directory for sockets, when the system provides one."""
    return os.environ.get("XDG_RUNTIME_DIR")


def home() -> Path:
    """$MLXRT_HOME, else ~/.cache/mlxrt: where built-in models and checkpoints are kept."""
    value = get("HOME")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "mlxrt"
