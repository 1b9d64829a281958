"""Built-in random-weight models: their specs and the on-disk cache that builds them.

This module owns `BUILTIN_MODELS`, the cache layout under a root directory (the runtime
passes ``$MLXRT_HOME``, default ``~/.cache/mlxrt``), the lock-then-rename protocol that keeps builds atomic across
processes, deterministic weight initialisation, and the config.json / manifest that
make a directory loadable by ``mlx_lm.utils.load``. The tokenizer itself comes from
``engine.builtin.tokenizer``; here it is only trained on demand and cached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from engine.builtin.tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    EOS_TOKENS,
    TokenizerSpec,
    added_token_ids,
    train_tokenizer,
    write_tokenizer_config,
)

# Bump when weight init, config.json or the directory layout changes.
BUILD_FORMAT = 1
BUILTIN_PREFIX = "builtin:"
MANIFEST = "mlxrt_builtin.json"
MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    MANIFEST,
)
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class BuiltinSpec:
    """Everything that determines a built-in model directory's contents."""

    name: str
    model_type: Literal["llama", "qwen2"]
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    seed: int
    tokenizer: TokenizerSpec
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.model_type not in _ARCHITECTURES:
            raise ValueError(f"{self.name}: unsupported model_type {self.model_type!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{self.name}: hidden_size not divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.name}: num_attention_heads not divisible by kv heads")
        if self.tokenizer.vocab_size > self.vocab_size:
            raise ValueError(f"{self.name}: tokenizer vocab exceeds model vocab_size")

    def digest(self) -> str:
        """sha256 over the spec's fields and every constant that shapes the build."""
        payload = {
            "format": BUILD_FORMAT,
            "spec": dataclasses.asdict(self),
            "tokenizer_digest": self.tokenizer.digest(),
            "chat_template": CHAT_TEMPLATE,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


_TINY_TOKENIZER = TokenizerSpec(vocab_size=1024, corpus_chars=400_000)
_BENCH_TOKENIZER = TokenizerSpec(vocab_size=32768, corpus_chars=4_000_000)

BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    spec.name: spec
    for spec in (
        BuiltinSpec(
            name="tiny",
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            seed=0,
            tokenizer=_TINY_TOKENIZER,
        ),
        BuiltinSpec(
            name="tiny-qwen2",
            model_type="qwen2",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=160,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            max_position_embeddings=2048,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            seed=1,
            tokenizer=_TINY_TOKENIZER,
        ),
        # SmolLM-135M shape.
        BuiltinSpec(
            name="bench",
            model_type="llama",
            hidden_size=576,
            num_hidden_layers=30,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=32768,
            max_position_embeddings=8192,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            seed=2,
            tokenizer=_BENCH_TOKENIZER,
        ),
        BuiltinSpec(
            name="bench-qwen2",
            model_type="qwen2",
            hidden_size=512,
            num_hidden_layers=24,
            intermediate_size=1408,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=32768,
            max_position_embeddings=8192,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            seed=3,
            tokenizer=_BENCH_TOKENIZER,
        ),
    )
}


class UnknownBuiltinModelError(ValueError):
    """Raised for a name that is not a key of `BUILTIN_MODELS`."""

    def __init__(self, name: str) -> None:
        known = ", ".join(sorted(BUILTIN_MODELS))
        super().__init__(f"unknown builtin model {name!r}; known models: {known}")
        self.name = name


def builtin_name(path: str) -> str | None:
    """``"builtin:tiny"`` -> ``"tiny"``; anything else -> None."""
    if path.startswith(BUILTIN_PREFIX) and len(path) > len(BUILTIN_PREFIX):
        return path[len(BUILTIN_PREFIX) :]
    return None


def ensure_builtin(name: str, *, root: Path | str, progress: Progress | None = None) -> Path:
    """Return the directory of built-in model `name` under `root` (the runtime's
    `MLXRT_HOME`), building it first if needed."""
    spec = BUILTIN_MODELS.get(name)
    if spec is None:
        raise UnknownBuiltinModelError(name)
    root = Path(root)
    say = progress or (lambda _message: None)
    target = root / "models" / f"{spec.name}-{spec.digest()[:12]}"
    return _ensure_dir(target, MODEL_FILES, lambda tmp: _build_model(spec, root, tmp, say))


def _ensure_dir(target: Path, required: tuple[str, ...], build: Callable[[Path], None]) -> Path:
    """Make `target` exist with `required` files; `build` fills a fresh temp dir."""
    if _is_complete(target, required):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_name(target.name + ".lock")):
        if _is_complete(target, required):
            return target
        prefix = f".{target.name}.tmp-"
        # Holding the lock, any temp dir with our prefix is a crashed build's leftover.
        for stale in target.parent.glob(prefix + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _is_complete(directory: Path, required: tuple[str, ...]) -> bool:
    return all((directory / name).is_file() for name in required)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ensure_tokenizer(spec: TokenizerSpec, root: Path, say: Progress) -> Path:
    """Path of the cached tokenizer.json for `spec`, training it if missing."""

    def build(tmp: Path) -> None:
        say(f"training tokenizer (byte-level BPE, vocab {spec.vocab_size})")
        started = time.perf_counter()
        train_tokenizer(spec).save(str(tmp / "tokenizer.json"))
        say(f"trained tokenizer in {time.perf_counter() - started:.1f}s")

    target = root / "tokenizers" / f"bpe{spec.vocab_size}-{spec.digest()[:12]}"
    return _ensure_dir(target, ("tokenizer.json",), build) / "tokenizer.json"


def _build_model(spec: BuiltinSpec, root: Path, out: Path, say: Progress) -> None:
    """Write a complete model directory for `spec` into the empty directory `out`."""
    started = time.perf_counter()
    say(f"building builtin model {spec.name!r}")
    shutil.copyfile(_ensure_tokenizer(spec.tokenizer, root, say), out / "tokenizer.json")
    write_tokenizer_config(out, out / "tokenizer.json", spec.max_position_embeddings)
    ids = added_token_ids(out / "tokenizer.json")
    if max(ids.values()) >= spec.vocab_size:
        raise ValueError(f"{spec.name}: tokenizer ids exceed vocab_size {spec.vocab_size}")
    config = _hf_config(spec, eos_ids=[ids[t] for t in EOS_TOKENS], pad_id=ids[ENDOFTEXT])
    _write_json(out / "config.json", config)
    num_parameters = _write_weights(spec, config, out / "model.safetensors", say)
    _write_json(
        out / MANIFEST,
        {
            "format": BUILD_FORMAT,
            "name": spec.name,
            "spec_digest": spec.digest(),
            "spec": dataclasses.asdict(spec),
            "num_parameters": num_parameters,
            "tokenizer_sha256": _sha256(out / "tokenizer.json"),
            "weights_sha256": _sha256(out / "model.safetensors"),
        },
    )
    say(f"built {spec.name!r} ({num_parameters / 1e6:.1f}M params) in {time.perf_counter() - started:.1f}s")


def _hf_config(spec: BuiltinSpec, eos_ids: list[int], pad_id: int) -> dict[str, object]:
    """HF-style config.json; also the source of the mlx-lm ModelArgs used to build."""
    config: dict[str, object] = {
        "architectures": [_ARCHITECTURES[spec.model_type]],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_word_embeddings,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }
    if spec.model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False)
    return config


def _write_weights(spec: BuiltinSpec, config: dict[str, object], path: Path, say: Progress) -> int:
    """Initialise the model's parameters deterministically, save them, return the count."""
    # Imported here so that `import engine.builtin` (e.g. to parse a model name)
    # stays cheap and does not load MLX.
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    mx.random.seed(spec.seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    shapes = {name: tuple(p.shape) for name, p in cast(list[tuple[str, Any]], tree_flatten(model.parameters()))}
    num_parameters = sum(int(np.prod(shape)) for shape in shapes.values())
    say(f"initializing {num_parameters / 1e6:.1f}M weights")
    rng = np.random.default_rng(spec.seed)
    weights = {name: mx.array(_init_param(rng, name, shapes[name])) for name in sorted(shapes)}
    say("writing weights")
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return num_parameters


def _init_param(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Biases 0, norm scales 1, matrices (embeddings included) N(0, 1/fan_in).

    Embeddings get std 1/sqrt(hidden) rather than 1: a large embedding dominates the
    residual stream and, with a tied head, greedy decoding just echoes its input.
    Query/key matrices get twice the std: with flat attention a deep random model
    averages its context into a near-constant state and greedy decoding collapses
    into repeating one token; sharper attention keeps the output varied.
    """
    if len(shape) == 1:
        return np.zeros(shape, np.float32) if name.endswith("bias") else np.ones(shape, np.float32)
    gain = 2.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(gain * shape[-1] ** -0.5)


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
