"""Shared fixtures. Shared helpers live in `tests/support/` (test modules import only from there)."""

from __future__ import annotations

import os
from pathlib import Path

import runtime  # noqa: F401  (fast BLAS before mlx loads)

os.environ.setdefault("MLXRT_HOME", str(Path(__file__).resolve().parent.parent / ".cache" / "mlxrt"))

import pytest

from runtime.config import RuntimeConfig
from tests.support.config import make_config


@pytest.fixture
def tiny_config() -> RuntimeConfig:
    return make_config()
