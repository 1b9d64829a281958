"""Tests for runtime.config: TOML loading, strict keys, validation, path resolution."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from runtime.config import (
    GenerationConfig,
    KvConfig,
    LoggingConfig,
    ModelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from runtime.errors import ConfigError, MlxrtError

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((REPO_ROOT / "configs").glob("*.toml"))

MINIMAL = '[model]\npath = "models/llama"\n'


def with_minimal(extra: str) -> str:
    return MINIMAL + extra


# -- defaults ----------------------------------------------------------------------


def test_minimal_config_has_documented_defaults():
    config = RuntimeConfig.from_toml(MINIMAL)
    assert config.model == ModelConfig(path="models/llama", dtype="auto", max_context=None, trust_remote_code=False)
    assert config.scheduler == SchedulerConfig(max_batch_size=32, max_queued_requests=256, prefill_chunk_size=256, step_token_budget=0)
    assert config.kv == KvConfig(budget_bytes=0)
    assert config.generation == GenerationConfig(default_max_tokens=256, seed=None)
    assert config.logging == LoggingConfig(level="info", format="auto")
    # from_toml does not touch paths; only load() resolves them against the file.
    assert config.model.path == "models/llama"


def test_from_toml_accepts_bytes():
    assert RuntimeConfig.from_toml(MINIMAL.encode()) == RuntimeConfig.from_toml(MINIMAL)


def test_full_config_round_trips_through_toml():
    text = with_minimal(
        'dtype = "bfloat16"\nmax_context = 4096\ntrust_remote_code = true\n'
        "[scheduler]\nmax_batch_size = 4\nmax_queued_requests = 10\nprefill_chunk_size = 64\nstep_token_budget = 100\n"
        "[kv]\nbudget_bytes = 1048576\n"
        "[generation]\ndefault_max_tokens = 32\nseed = 7\n"
        '[logging]\nlevel = "debug"\nformat = "json"\n'
    )
    config = RuntimeConfig.from_toml(text)
    assert config.model.dtype == "bfloat16" and config.model.max_context == 4096 and config.model.trust_remote_code
    assert config.scheduler == SchedulerConfig(max_batch_size=4, max_queued_requests=10, prefill_chunk_size=64, step_token_budget=100)
    assert config.kv.budget_bytes == 1 << 20
    assert config.generation == GenerationConfig(default_max_tokens=32, seed=7)
    assert config.logging == LoggingConfig(level="debug", format="json")
    assert config.step_token_budget == 100
    assert RuntimeConfig.from_toml(msgspec.toml.encode(config)) == config


def test_step_token_budget_defaults_to_four_chunks_plus_batch():
    assert RuntimeConfig.from_toml(MINIMAL).step_token_budget == 4 * 256 + 32
    config = RuntimeConfig.from_toml(with_minimal("[scheduler]\nmax_batch_size = 3\nprefill_chunk_size = 40\n"))
    assert config.step_token_budget == 4 * 40 + 3
    explicit = RuntimeConfig.from_toml(with_minimal("[scheduler]\nstep_token_budget = 7\n"))
    assert explicit.step_token_budget == 7


def test_config_is_frozen():
    config = RuntimeConfig.from_toml(MINIMAL)
    with pytest.raises(AttributeError):
        config.scheduler.max_batch_size = 1  # type: ignore[misc]


# -- errors name the source and the key ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (with_minimal("foo = 1\n"), ["foo", "`model`"]),
        (with_minimal("[scheduler]\nmax_batch = 4\n"), ["max_batch", "`scheduler`"]),
        (with_minimal("[caches]\nsize = 1\n"), ["caches"]),
        (with_minimal("[kv]\nbudget = 1\n"), ["budget", "`kv`"]),
    ],
)
def test_unknown_key_is_rejected(text, fragments):
    with pytest.raises(ConfigError) as info:
        RuntimeConfig.from_toml(text, source="my.toml")
    message = str(info.value)
    assert message.startswith("my.toml: ")
    assert "unknown field" in message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (with_minimal('[scheduler]\nmax_batch_size = "8"\n'), "$.scheduler.max_batch_size"),
        (with_minimal("[scheduler]\nprefill_chunk_size = 1.5\n"), "$.scheduler.prefill_chunk_size"),
        (with_minimal("[kv]\nbudget_bytes = true\n"), "$.kv.budget_bytes"),
        ("[model]\npath = 3\n", "$.model.path"),
        (with_minimal('dtype = "int8"\n'), "$.model.dtype"),
        (with_minimal('[logging]\nlevel = "loud"\n'), "$.logging.level"),
        (with_minimal('[generation]\nseed = "x"\n'), "$.generation.seed"),
        ('model = "x"\n', "$.model"),
    ],
)
def test_wrong_type_is_rejected_naming_the_key(text, key):
    with pytest.raises(ConfigError) as info:
        RuntimeConfig.from_toml(text, source="cfg.toml")
    assert str(info.value).startswith("cfg.toml: ")
    assert f"`{key.removeprefix('$.')}`" in str(info.value)


def test_missing_model_section_is_rejected():
    with pytest.raises(ConfigError, match=r"^x\.toml: .*missing required field `model`"):
        RuntimeConfig.from_toml("[scheduler]\nmax_batch_size = 2\n", source="x.toml")


def test_missing_model_path_is_rejected():
    with pytest.raises(ConfigError, match="missing required field `path`"):
        RuntimeConfig.from_toml('[model]\ndtype = "auto"\n')


def test_invalid_toml_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^bad\.toml: invalid TOML"):
        RuntimeConfig.from_toml("[model\npath = 'x'\n", source="bad.toml")


def test_config_error_is_a_value_error_and_mlxrt_error():
    with pytest.raises(ValueError):
        RuntimeConfig.from_toml("nope")
    assert issubclass(ConfigError, MlxrtError)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("[scheduler]\nmax_batch_size = 0\n", "scheduler.max_batch_size"),
        ("[scheduler]\nmax_batch_size = -2\n", "scheduler.max_batch_size"),
        ("[scheduler]\nmax_queued_requests = 0\n", "scheduler.max_queued_requests"),
        ("[scheduler]\nprefill_chunk_size = 0\n", "scheduler.prefill_chunk_size"),
        ("[scheduler]\nprefill_chunk_size = -512\n", "scheduler.prefill_chunk_size"),
        ("[scheduler]\nstep_token_budget = -1\n", "scheduler.step_token_budget"),
        ("[kv]\nbudget_bytes = -1\n", "kv.budget_bytes"),
        ("[generation]\ndefault_max_tokens = 0\n", "generation.default_max_tokens"),
        ("max_context = 1\n", "model.max_context"),
    ],
)
def test_out_of_range_values_are_rejected(extra, key):
    with pytest.raises(ConfigError) as info:
        RuntimeConfig.from_toml(MINIMAL + extra, source="range.toml")
    message = str(info.value)
    assert message.startswith("range.toml: ")
    assert f"`{key}`" in message


@pytest.mark.parametrize(
    "extra",
    [
        "[scheduler]\nmax_batch_size = 1\nmax_queued_requests = 1\nprefill_chunk_size = 1\nstep_token_budget = 0\n",
        "[kv]\nbudget_bytes = 0\n",
        "max_context = 2\n",
        "[generation]\ndefault_max_tokens = 1\n",
    ],
)
def test_boundary_values_are_accepted(extra):
    RuntimeConfig.from_toml(MINIMAL + extra)


def test_empty_model_path_is_rejected():
    with pytest.raises(ConfigError, match=r"`model\.path` must be str of length >= 1"):
        RuntimeConfig.from_toml('[model]\npath = ""\n')


def test_for_model_validates():
    config = RuntimeConfig.for_model("builtin:tiny", scheduler=SchedulerConfig(max_batch_size=2))
    assert config.model.path == "builtin:tiny" and config.scheduler.max_batch_size == 2
    with pytest.raises(ConfigError, match=r"^<arguments>: `scheduler.prefill_chunk_size`"):
        RuntimeConfig.for_model("builtin:tiny", scheduler=SchedulerConfig(prefill_chunk_size=0))


# -- load() and paths ---------------------------------------------------------------


def test_load_resolves_relative_model_path_against_the_file(tmp_path):
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    path = config_dir / "mlxrt.toml"
    path.write_text('[model]\npath = "models/llama"\n')
    config = RuntimeConfig.load(path)
    assert config.model.path == str(config_dir / "models" / "llama")
    assert RuntimeConfig.load(str(path)) == config


def test_load_keeps_builtin_and_absolute_paths(tmp_path):
    builtin = tmp_path / "builtin.toml"
    builtin.write_text('[model]\npath = "builtin:tiny"\n')
    assert RuntimeConfig.load(builtin).model.path == "builtin:tiny"
    absolute_model = tmp_path / "elsewhere" / "model"
    absolute = tmp_path / "absolute.toml"
    absolute.write_text(f"[model]\npath = {str(absolute_model)!r}\n")
    assert RuntimeConfig.load(absolute).model.path == str(absolute_model)


def test_resolve_relative_to_keeps_the_other_sections():
    config = RuntimeConfig.from_toml(with_minimal("[scheduler]\nmax_batch_size = 3\n"))
    resolved = config.resolve_relative_to(Path("/base"))
    assert resolved.model.path == "/base/models/llama"
    assert resolved.scheduler == config.scheduler
    assert config.model.path == "models/llama"


def test_load_missing_file_is_a_config_error(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        RuntimeConfig.load(missing)
    assert str(missing) in str(info.value)
    assert "cannot read config" in str(info.value)


def test_load_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(with_minimal("[scheduler]\nmax_batch_size = 0\n"))
    with pytest.raises(ConfigError, match="^" + re.escape(f"{path}: `scheduler.max_batch_size` must be int >= 1")):
        RuntimeConfig.load(path)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    config = RuntimeConfig.load(path)
    # Every shipped launch uses a built-in model, except the commented template for a local one.
    assert config.model.path.startswith("builtin:") or path.name == "example-local.toml"
    assert config.step_token_budget >= config.scheduler.prefill_chunk_size + 1


def test_shipped_configs_exist():
    assert {p.name for p in CONFIG_FILES} >= {"default.toml", "tiny.toml", "bench.toml"}
    tiny = RuntimeConfig.load(REPO_ROOT / "configs" / "tiny.toml")
    assert (tiny.model.path, tiny.scheduler.max_batch_size, tiny.scheduler.prefill_chunk_size) == ("builtin:tiny", 8, 32)
