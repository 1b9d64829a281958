"""Shared test fixtures: built-in models cached under .cache/, runtime configs."""

from __future__ import annotations

import os
from pathlib import Path

import runtime  # noqa: F401  (fast BLAS before mlx loads)

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("MLXRT_HOME", str(REPO / ".cache" / "mlxrt"))

import pytest  # noqa: E402

from runtime.config import GenerationConfig, LoggingConfig, RuntimeConfig, SchedulerConfig  # noqa: E402

CHUNK = 16


def make_config(model: str = "builtin:tiny", **scheduler) -> RuntimeConfig:
    options = {"max_batch_size": 8, "prefill_chunk_size": CHUNK, **scheduler}
    return RuntimeConfig.for_model(
        model,
        scheduler=SchedulerConfig(**options),
        generation=GenerationConfig(seed=0),
        logging=LoggingConfig(level="warning", format="json"),
    )


@pytest.fixture
def tiny_config() -> RuntimeConfig:
    return make_config()


def builtin_dir(name: str):
    """A built-in model's directory under the tests' MLXRT_HOME (built on first use)."""
    from engine.builtin import ensure_builtin
    from runtime import env

    return ensure_builtin(name, root=env.home())
