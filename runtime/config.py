"""The runtime's configuration: one tree of frozen structs loaded from TOML.

`RuntimeConfig.load(path)` decodes with unknown keys rejected and every error
naming the file, the key and the expected type. Only `[model] path` is required.
The sections and their ranges are `protocols.config`'s; this module adds the tree,
the sources (file, `MLXRT_*` environment, flags) and paths derived from them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import msgspec

from protocols.config import (
    AdapterConfig,
    CheckpointConfig,
    DistributedConfig,
    EmbeddingsConfig,
    GenerationConfig,
    KvConfig,
    LimitsConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    ModelPoolConfig,
    PoolModelConfig,
    SchedulerConfig,
    Section,
    ServerConfig,
    SpeculativeConfig,
    TracingConfig,
)
from protocols.errors import ConfigError
from runtime import env

__all__ = [
    "AdapterConfig",
    "CheckpointConfig",
    "DistributedConfig",
    "EmbeddingsConfig",
    "GenerationConfig",
    "KvConfig",
    "LimitsConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ModelPoolConfig",
    "PoolModelConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "TracingConfig",
]

SECTIONS = (
    "model",
    "scheduler",
    "kv",
    "generation",
    "limits",
    "logging",
    "server",
    "checkpoints",
    "speculative",
    "tracing",
    "lora",
    "model_pool",
    "distributed",
    "embeddings",
)


class RuntimeConfig(Section, frozen=True):
    model: ModelConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    kv: KvConfig = KvConfig()
    generation: GenerationConfig = GenerationConfig()
    limits: LimitsConfig = LimitsConfig()
    logging: LoggingConfig = LoggingConfig()
    server: ServerConfig = ServerConfig()
    checkpoints: CheckpointConfig = CheckpointConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    tracing: TracingConfig = TracingConfig()
    lora: LoraConfig = LoraConfig()
    # `[[adapters]]`: LoRA adapters known (and loaded) at start; more through `load_adapter`.
    adapters: list[AdapterConfig] = msgspec.field(default_factory=list)
    # `[[models]]`: more models a `ModelPool` serves beside `[model]` (the default one).
    models: list[PoolModelConfig] = msgspec.field(default_factory=list)
    model_pool: ModelPoolConfig = ModelPoolConfig()
    distributed: DistributedConfig = DistributedConfig()
    embeddings: EmbeddingsConfig = EmbeddingsConfig()

    @classmethod
    def load(cls, path: str | Path, *, environ: Mapping[str, str] | None = None, overrides: Mapping[str, object] | None = None) -> RuntimeConfig:
        """A file, then `MLXRT_<SECTION>_<KEY>` variables, then `overrides` ("section.key": value)."""
        path = Path(path)
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
        try:
            tree = msgspec.toml.decode(text)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
        from_env = env_overrides(environ if environ is not None else env.environment())
        _merge(tree, from_env, "environment")
        _merge(tree, dict(overrides or {}), "command line")
        origins = [name for name, extra in (("MLXRT_* variables", from_env), ("command-line flags", overrides)) if extra]
        source = f"{path} (with {' and '.join(origins)})" if origins else str(path)
        config = cls.from_tree(tree, source=source)
        return config.resolve_relative_to(path.parent)

    @classmethod
    def from_toml(cls, text: str | bytes, *, source: str = "<config>") -> RuntimeConfig:
        try:
            tree = msgspec.toml.decode(text)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{source}: invalid TOML: {exc}") from exc
        return cls.from_tree(tree, source=source)

    @classmethod
    def from_tree(cls, tree: dict, *, source: str) -> RuntimeConfig:
        try:
            return msgspec.convert(tree, type=cls, strict=True)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{source}: {_explain(exc)}") from None

    @classmethod
    def for_model(cls, path: str, **sections: Section) -> RuntimeConfig:
        """A config built in code, checked like one loaded from a file."""
        tree = {name: msgspec.to_builtins(section) for name, section in sections.items()}
        return cls.from_tree({"model": {"path": path}, **tree}, source="<arguments>")

    def resolve_relative_to(self, base: Path) -> RuntimeConfig:
        """Model paths in a file are relative to the file's directory."""
        path, config = self.model.path, self
        if not path.startswith("builtin:"):
            config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=str(base / Path(path).expanduser())))
        if config.checkpoints.dir:
            resolved = base / Path(config.checkpoints.dir).expanduser()
            config = msgspec.structs.replace(config, checkpoints=msgspec.structs.replace(config.checkpoints, dir=str(resolved)))
        if config.models:
            models = [m if m.path.startswith("builtin:") else msgspec.structs.replace(m, path=str(base / Path(m.path).expanduser())) for m in config.models]
            config = msgspec.structs.replace(config, models=models)
        if config.adapters:
            adapters = [msgspec.structs.replace(a, path=str(base / Path(a.path).expanduser())) for a in config.adapters]
            config = msgspec.structs.replace(config, adapters=adapters)
        if config.tracing.span_log:
            resolved = base / Path(config.tracing.span_log).expanduser()
            config = msgspec.structs.replace(config, tracing=msgspec.structs.replace(config.tracing, span_log=str(resolved)))
        return config

    @property
    def model_name(self) -> str:
        """The name HTTP clients use for the model (`server.served_model_name`), and its metrics label."""
        path = self.model.path
        return self.server.served_model_name or (path if path.startswith("builtin:") else Path(path).name or path)

    @property
    def step_token_budget(self) -> int:
        s = self.scheduler
        return s.step_token_budget or 4 * s.prefill_chunk_size + s.max_batch_size

    def check_distributed(self) -> None:
        """Raise `ConfigError` for what a distributed world does not run (yet): every rank
        would need the same adapters, draft model or other models, and quantized or paged KV
        is untested there."""
        if not self.distributed.backend:
            return
        refused = [
            (bool(self.models), "`[[models]]` (one model per world)"),
            (bool(self.adapters), "`[[adapters]]` (LoRA adapters are not sharded)"),
            (bool(self.speculative.draft), "`speculative.draft` (a draft model is not sharded)"),
            (self.kv.bits != 0, "`kv.bits` (quantized KV)"),
            (self.kv.block_size not in (0, "auto"), "`kv.block_size` (paged KV)"),
            (bool(self.kv.disk_cache_dir), "`kv.disk_cache_dir` (each rank holds a shard of the KV)"),
        ]
        found = [what for bad, what in refused if bad]
        if found:
            raise ConfigError(f"`distributed.backend = {self.distributed.backend!r}` does not run with {', '.join(found)}")

    def checkpoint_directory(self) -> Path:
        """`checkpoints.dir`, or `$MLXRT_HOME/checkpoints`."""
        return Path(self.checkpoints.dir).expanduser() if self.checkpoints.dir else env.home() / "checkpoints"


_EXPECTED = re.compile(r"^Expected `(?P<type>[^`]+)`(?P<rule>[^,]*?)(?:, got (?P<got>.+?))?$")


def _explain(exc: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.a.b`" as "`a.b` must be int >= 1"."""
    text, _, where = str(exc).rpartition(" - at `$.")
    if not text:
        return str(exc)
    key = where.rstrip("`")
    match = _EXPECTED.match(text)
    if match is None:
        return f"`{key}`: {text}"
    rule = match["rule"].strip()
    got = f", got {match['got'].strip('`')}" if match["got"] else ""
    return f"`{key}` must be {match['type']}{' ' + rule if rule else ''}{got}"


def env_overrides(environ: Mapping[str, str]) -> dict[str, object]:
    """`MLXRT_SCHEDULER_MAX_BATCH_SIZE=8` -> {"scheduler.max_batch_size": 8} (values parsed as TOML)."""
    found = {}
    for name, raw in environ.items():
        if not name.startswith(env.PREFIX):
            continue
        lowered = name[len(env.PREFIX) :].lower()
        section = next((s for s in SECTIONS if lowered.startswith(s + "_")), None)
        if section is not None:
            found[f"{section}.{lowered[len(section) + 1 :]}"] = _parse_value(raw)
    return found


def _parse_value(raw: str) -> object:
    try:
        return msgspec.toml.decode(f"v = {raw}")["v"]
    except msgspec.DecodeError:
        return raw


def _merge(tree: dict, overrides: dict[str, object], origin: str) -> None:
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS or not key:
            raise ConfigError(f"{origin}: unknown config key `{dotted}`")
        table = tree.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{origin}: `{section}` is not a table")
        table[key] = value
