"""The runtime's configuration: one tree of frozen structs loaded from TOML.

`RuntimeConfig.load(path)` decodes with unknown keys rejected and every error
naming the file, the key and the expected type. Only `[model] path` is required.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from runtime.errors import ConfigError


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config table."""


class ModelConfig(Section):
    # A local mlx-lm model directory, or "builtin:<name>" (see runtime.builtin).
    path: str
    # "auto": float32 on the CPU backend (BLAS-backed), the model's own dtype elsewhere.
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # Longest prompt + generation; default: the model's max_position_embeddings.
    max_context: int | None = None
    trust_remote_code: bool = False


class SchedulerConfig(Section):
    # Requests decoded together in one batched step.
    max_batch_size: int = 32
    # Requests accepted but not yet admitted; beyond this, submissions are refused.
    max_queued_requests: int = 256
    # Prompt tokens a request forwards per step; running streams wait at most one
    # chunk (attention over a long prefix makes big chunks slow on CPU).
    prefill_chunk_size: int = 256
    # Tokens (decode rows + prefill chunks) one step may process; 0 = 4 chunks + batch size.
    step_token_budget: int = 0


class KvConfig(Section):
    # Bytes of KV cache the runtime may hold; 0 = no limit.
    budget_bytes: int = 0


class GenerationConfig(Section):
    # max_tokens for requests that do not set it.
    default_max_tokens: int = 256
    # Seed of the generator that draws seeds for requests that do not set one.
    seed: int | None = None


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    # "auto": human-readable on a terminal, JSON lines otherwise.
    format: Literal["auto", "json", "console"] = "auto"


class RuntimeConfig(Section):
    model: ModelConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    kv: KvConfig = KvConfig()
    generation: GenerationConfig = GenerationConfig()
    logging: LoggingConfig = LoggingConfig()

    @classmethod
    def load(cls, path: str | Path) -> RuntimeConfig:
        path = Path(path)
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
        config = cls.from_toml(text, source=str(path))
        return config.resolve_relative_to(path.parent)

    @classmethod
    def from_toml(cls, text: str | bytes, *, source: str = "<config>") -> RuntimeConfig:
        try:
            config = msgspec.toml.decode(text, type=cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{source}: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{source}: invalid TOML: {exc}") from exc
        config.validate(source)
        return config

    @classmethod
    def for_model(cls, path: str, **sections: Section) -> RuntimeConfig:
        config = cls(model=ModelConfig(path=path), **sections)
        config.validate("<arguments>")
        return config

    def resolve_relative_to(self, base: Path) -> RuntimeConfig:
        """Model paths in a file are relative to the file's directory."""
        path = self.model.path
        if path.startswith("builtin:"):
            return self
        resolved = base / Path(path).expanduser()
        return msgspec.structs.replace(self, model=msgspec.structs.replace(self.model, path=str(resolved)))

    def validate(self, source: str) -> None:
        positive = {
            "scheduler.max_batch_size": self.scheduler.max_batch_size,
            "scheduler.max_queued_requests": self.scheduler.max_queued_requests,
            "scheduler.prefill_chunk_size": self.scheduler.prefill_chunk_size,
            "generation.default_max_tokens": self.generation.default_max_tokens,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"{source}: `{key}` must be >= 1, got {value}")
        for key, value in {"scheduler.step_token_budget": self.scheduler.step_token_budget, "kv.budget_bytes": self.kv.budget_bytes}.items():
            if value < 0:
                raise ConfigError(f"{source}: `{key}` must be >= 0, got {value}")
        if self.model.max_context is not None and self.model.max_context < 2:
            raise ConfigError(f"{source}: `model.max_context` must be >= 2, got {self.model.max_context}")
        if not self.model.path:
            raise ConfigError(f"{source}: `model.path` must not be empty")

    @property
    def step_token_budget(self) -> int:
        s = self.scheduler
        return s.step_token_budget or 4 * s.prefill_chunk_size + s.max_batch_size
