"""The repository root, the tests' runtime config and their built-in models.

`make_config` is the runtime config most tests use: the tiny built-in model, batches of 8,
prefill chunks of `CHUNK` tokens, seed 0, quiet JSON logs. `builtin_dir` is a built-in model's
directory under the tests' `MLXRT_HOME` (set by `tests/conftest.py`), built on first use.
"""

from __future__ import annotations

from pathlib import Path

from runtime.config import GenerationConfig, LoggingConfig, RuntimeConfig, SchedulerConfig

REPO = Path(__file__).resolve().parents[2]

CHUNK = 16


def make_config(model: str = "builtin:tiny", **scheduler) -> RuntimeConfig:
    options = {"max_batch_size": 8, "prefill_chunk_size": CHUNK, **scheduler}
    return RuntimeConfig.for_model(
        model,
        scheduler=SchedulerConfig(**options),
        generation=GenerationConfig(seed=0),
        logging=LoggingConfig(level="warning", format="json"),
    )


def builtin_dir(name: str) -> Path:
    """A built-in model's directory under the tests' MLXRT_HOME (built on first use)."""
    from engine.builtin import ensure_builtin
    from runtime import env

    return ensure_builtin(name, root=env.home())
