"""The runtime's configuration: one tree of frozen structs loaded from TOML.

`RuntimeConfig.load(path)` decodes with unknown keys rejected and every error
naming the file, the key and the expected type. Only `[model] path` is required.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec

from runtime import env
from runtime.errors import ConfigError

SECTIONS = ("model", "scheduler", "kv", "generation", "limits", "logging", "server", "checkpoints")


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
    # A request whose caller has not read for this long is cancelled (it was paused, holding
    # its KV but no batch slot, since its caller fell behind); its stream ends `cancelled`.
    max_pause_s: float = 300.0


class KvConfig(Section):
    # Bytes of KV cache the runtime may hold, prefix cache included; 0 = no limit.
    budget_bytes: int = 0
    # Bytes the prefix cache may keep (least recently used entries go first); 0 disables it.
    prefix_cache_bytes: int = 1 << 30
    # Shorter sequences are not worth keeping.
    prefix_min_tokens: int = 16


class GenerationConfig(Section):
    # max_tokens for requests that do not set it.
    default_max_tokens: int = 256
    # Jump-forward decoding for grammar requests that do not say (never with logprobs).
    jump_forward: bool = False
    # Token fast-forwarding for requests that do not say: "off", "strict" (tool-call scaffolds
    # from the chat template) or "echo" (strict, plus spans copied from the context, kept as
    # far as the model's greedy choice agrees). Never with a grammar or logprobs.
    fill: Literal["off", "strict", "echo"] = "off"
    # Longest span appended at once, and the anchor an echo span needs (tokens).
    fill_max_span: int = 32
    fill_echo_k: int = 8
    # Append one JSON line per fast-forwarded span to this file ("" = no trace).
    fill_trace: str = ""
    # Seed of the generator that draws seeds for requests that do not set one.
    seed: int | None = None


class LimitsConfig(Section):
    """What one request may ask for; beyond these it is refused before any compute."""

    # Prompt text (or rendered chat) bytes; 0 = derived from the context: max_context times the
    # longest token's bytes, so nothing refused could have fitted. Checked before tokenizing.
    max_prompt_bytes: int = 0
    # Stop strings per request, and their total bytes.
    max_stop_strings: int = 64
    max_stop_bytes: int = 8192
    # Source bytes of a response_format or of a request's tools, and their nesting depth.
    max_grammar_bytes: int = 65536
    max_grammar_depth: int = 64
    # Bytes of compiled grammars kept for reuse; a grammar whose compiled form alone exceeds
    # this is refused. Compiling one may take at most `grammar_compile_timeout_s`.
    grammar_cache_bytes: int = 512 * 1024 * 1024
    grammar_compile_timeout_s: float = 10.0


class ServerConfig(Section):
    # Unix socket path; "" = $XDG_RUNTIME_DIR/mlxrt/mlxrt.sock, else /tmp/mlxrt-<uid>/mlxrt.sock.
    socket: str = ""
    # "0600": owner only; "0660": also the owner's group (the directory becomes 0750).
    socket_mode: Literal["0600", "0660"] = "0600"
    # Peers with these uids may connect besides the server's own uid (Linux SO_PEERCRED).
    allowed_uids: list[int] = msgspec.field(default_factory=list)
    # Largest frame accepted from a client; the length prefix is checked before reading.
    max_frame_bytes: int = 8 * 1024 * 1024
    max_connections: int = 64
    # Seconds a new connection has to send Hello.
    handshake_timeout_s: float = 10.0
    # Seconds a client may leave a frame unread before the server drops the connection.
    client_stall_timeout_s: float = 60.0
    # A connection with no live request that sends no complete frame for this long is closed.
    idle_timeout_s: float = 300.0
    # Once a frame has begun, the rest of it must arrive within this many seconds.
    frame_timeout_s: float = 10.0
    # Frames queued per connection before its requests wait for the client.
    send_buffer_frames: int = 64


class CheckpointConfig(Section):
    # Where checkpoints are written; "" = $MLXRT_HOME/checkpoints (default ~/.cache/mlxrt/checkpoints).
    dir: str = ""
    # Default tokens between checkpoints for requests that do not say; 0 = off.
    every_tokens: int = 0
    # Checkpoints older than this are deleted (at start and hourly).
    max_age_s: float = 86400.0

    def directory(self) -> Path:
        if self.dir:
            return Path(self.dir).expanduser()
        home = env.get("HOME")
        return (Path(home).expanduser() if home else Path.home() / ".cache" / "mlxrt") / "checkpoints"


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    # "auto": human-readable on a terminal, JSON lines otherwise.
    format: Literal["auto", "json", "console"] = "auto"


class RuntimeConfig(Section):
    model: ModelConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    kv: KvConfig = KvConfig()
    generation: GenerationConfig = GenerationConfig()
    limits: LimitsConfig = LimitsConfig()
    logging: LoggingConfig = LoggingConfig()
    server: ServerConfig = ServerConfig()
    checkpoints: CheckpointConfig = CheckpointConfig()

    @classmethod
    def load(
        cls, path: str | Path, *, environ: Mapping[str, str] | None = None, overrides: Mapping[str, object] | None = None
    ) -> RuntimeConfig:
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
            config = msgspec.convert(tree, type=cls, strict=True)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{source}: {exc}") from exc
        config.validate(source)
        return config

    @classmethod
    def for_model(cls, path: str, **sections: Section) -> RuntimeConfig:
        config = cls(model=ModelConfig(path=path), **sections)
        config.validate("<arguments>")
        return config

    def resolve_relative_to(self, base: Path) -> RuntimeConfig:
        """Model paths in a file are relative to the file's directory."""
        path, config = self.model.path, self
        if not path.startswith("builtin:"):
            config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=str(base / Path(path).expanduser())))
        if config.checkpoints.dir:
            resolved = base / Path(config.checkpoints.dir).expanduser()
            config = msgspec.structs.replace(config, checkpoints=msgspec.structs.replace(config.checkpoints, dir=str(resolved)))
        return config

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
        non_negative = {
            "scheduler.step_token_budget": self.scheduler.step_token_budget,
            "kv.budget_bytes": self.kv.budget_bytes,
            "kv.prefix_cache_bytes": self.kv.prefix_cache_bytes,
            "kv.prefix_min_tokens": self.kv.prefix_min_tokens,
        }
        for key, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{source}: `{key}` must be >= 0, got {value}")
        if self.model.max_context is not None and self.model.max_context < 2:
            raise ConfigError(f"{source}: `model.max_context` must be >= 2, got {self.model.max_context}")
        if not self.model.path:
            raise ConfigError(f"{source}: `model.path` must not be empty")
        server = self.server
        for key, value in {"server.max_frame_bytes": server.max_frame_bytes, "server.max_connections": server.max_connections, "server.send_buffer_frames": server.send_buffer_frames}.items():
            if value < 1:
                raise ConfigError(f"{source}: `{key}` must be >= 1, got {value}")
        timeouts = ("handshake_timeout_s", "client_stall_timeout_s", "idle_timeout_s", "frame_timeout_s")
        if any(getattr(server, key) <= 0 for key in timeouts):
            raise ConfigError(f"{source}: server timeouts ({', '.join(timeouts)}) must be > 0")
        if self.scheduler.max_pause_s <= 0:
            raise ConfigError(f"{source}: `scheduler.max_pause_s` must be > 0")
        limits = self.limits
        for key in ("max_stop_strings", "max_stop_bytes", "max_grammar_bytes", "max_grammar_depth", "grammar_cache_bytes"):
            if getattr(limits, key) < 1:
                raise ConfigError(f"{source}: `limits.{key}` must be >= 1, got {getattr(limits, key)}")
        if limits.max_prompt_bytes < 0 or limits.grammar_compile_timeout_s <= 0:
            raise ConfigError(f"{source}: `limits.max_prompt_bytes` must be >= 0 and `limits.grammar_compile_timeout_s` > 0")
        if self.generation.fill_max_span < 2 or self.generation.fill_echo_k < 2:
            raise ConfigError(f"{source}: `generation.fill_max_span` and `generation.fill_echo_k` must be >= 2")
        if self.checkpoints.every_tokens < 0 or self.checkpoints.max_age_s <= 0:
            raise ConfigError(f"{source}: `checkpoints.every_tokens` must be >= 0 and `checkpoints.max_age_s` > 0")

    @property
    def step_token_budget(self) -> int:
        s = self.scheduler
        return s.step_token_budget or 4 * s.prefill_chunk_size + s.max_batch_size


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
