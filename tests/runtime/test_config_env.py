"""Config precedence: command-line flags > MLXRT_* environment > file > defaults."""

from __future__ import annotations

import pytest

from runtime.config import RuntimeConfig, env_overrides
from runtime.errors import ConfigError


def _file(tmp_path, text: str = '[model]\npath = "builtin:tiny"\n[scheduler]\nmax_batch_size = 4\n'):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_environment_overrides_file_and_flags_override_environment(tmp_path):
    environ = {"MLXRT_SCHEDULER_MAX_BATCH_SIZE": "6", "MLXRT_SERVER_SOCKET": "/from/env.sock", "HOME": "/x"}
    config = RuntimeConfig.load(_file(tmp_path), environ=environ, overrides={"server.socket": "/from/flag.sock"})
    assert config.scheduler.max_batch_size == 6
    assert config.server.socket == "/from/flag.sock"
    assert RuntimeConfig.load(_file(tmp_path), environ={}).scheduler.max_batch_size == 4


def test_environment_values_parse_as_toml_literals():
    parsed = env_overrides(
        {"MLXRT_KV_BUDGET_BYTES": "1024", "MLXRT_SERVER_ALLOWED_UIDS": "[1, 2]", "MLXRT_MODEL_PATH": "/m", "MLXRT_HOME": "/h", "MLXRT_BLAS": "off"}
    )
    assert parsed == {"kv.budget_bytes": 1024, "server.allowed_uids": [1, 2], "model.path": "/m"}


def test_bad_environment_value_names_origin_and_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        RuntimeConfig.load(_file(tmp_path), environ={"MLXRT_SCHEDULER_MAX_BATCH_SIZE": "many"})
    assert "MLXRT_" in str(info.value) and "max_batch_size" in str(info.value) and "c.toml" in str(info.value)


def test_unknown_environment_key_is_rejected(tmp_path):
    with pytest.raises(ConfigError) as info:
        RuntimeConfig.load(_file(tmp_path), environ={"MLXRT_SCHEDULER_MAX_BATCHES": "3"})
    assert "max_batches" in str(info.value)
