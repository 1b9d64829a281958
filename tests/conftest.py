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


# The modules that take a minute or more on two cores (the longest first): collected first, so
# that pytest-xdist's module-at-a-time scheduling (`--dist loadfile`) hands them out while both
# workers are fresh and ends the run with short modules on both, not one long one on one.
HEAVY_FIRST = (
    "tests/integration/test_distributed.py",
    "tests/integration/test_conformance.py",
    "tests/integration/test_resume_server.py",
    "tests/integration/test_model_pool.py",
    "tests/integration/test_gguf.py",
    "tests/tools/test_default_model_cli.py",
    "tests/integration/test_hardening_server.py",
    "tests/net/test_lm_eval.py",
    "tests/integration/test_soak_http.py",
    "tests/integration/test_speculation.py",
    "tests/integration/test_kv_quant.py",
    "tests/integration/test_server.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
