"""Built-in random-weight models: their specs and the on-disk cache that builds them.

This module owns the spec of a built-in model (`BuiltinSpec`; the named ones are in
`catalog.py`), the cache layout under a root directory (the runtime
passes ``$MLXRT_HOME``, default ``~/.cache/mlxrt``), the lock-then-rename protocol that keeps builds atomic across
processes, deterministic weight initialisation, and the config.json / manifest that
make a directory loadable by ``mlx_lm.utils.load``. A `BuiltinSpec` describes a model
of any mlx-lm model type (its family's own config fields in `extra`), optionally
quantized; `ensure_model` builds any spec. The
tokenizer itself comes from ``engine.builtin.tokenizer``; here it is only trained on
demand and cached, once per vocabulary size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from engine.builtin.copying import build_copy_weights
from engine.builtin.diffusion import DIFFUSION_FILES, DiffusionSpec, build_diffusion_model
from engine.builtin.fields import ConfigFields, freeze, thaw
from engine.builtin.tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    EOS_TOKENS,
    TokenizerSpec,
    added_token_ids,
    train_tokenizer,
    write_tokenizer_config,
)
from engine.builtin.vision import VISION_FILES, VisionSpec, build_vision_model

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
# Hugging Face class names for config.json's "architectures"; other types get
# "<CamelCase model_type>ForCausalLM" unless a spec's `extra` names one.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "mistral3": "Mistral3ForConditionalGeneration",
    "ministral3": "Ministral3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
}
# Config entries that stay at the top level of a "text_config" layout; the rest of
# the language model's fields move into config["text_config"].
_TOP_LEVEL_KEYS = ("architectures", "model_type", "eos_token_id", "pad_token_id", "torch_dtype")
# Affine quantization as mlx supports it.
_QUANT_BITS = (2, 3, 4, 5, 6, 8)
_QUANT_GROUP_SIZES = (32, 64, 128)
# Circuits a spec can write over its initialised weights (`BuiltinSpec.construct`).
CONSTRUCTIONS: dict[str, Callable[[dict[str, Any], dict[str, np.ndarray], int], dict[str, np.ndarray]]] = {"copy": build_copy_weights}

Progress = Callable[[str], None]
Layout = Literal["flat", "text_config"]


@dataclasses.dataclass(frozen=True)
class BuiltinSpec:
    """Everything that determines a built-in model directory's contents.

    The named fields are the ones every decoder has, written into config.json under
    their Hugging Face names (with ``head_dim = hidden_size // num_attention_heads``).
    `extra` is merged over them (nested dicts merge key by key), so a family's own
    fields (sliding windows, layer types, SSM and MoE sizes, ``rope_parameters``...)
    go there; read the family's ``mlx_lm.models.<model_type>.ModelArgs`` for them.
    With ``layout="text_config"`` the language model's fields sit only inside
    ``config["text_config"]`` (as in multimodal checkpoints such as Mistral 3);
    `extra` then names ``text_config`` itself for the entries that belong there.
    `omit_weights` names modules (e.g. ``"lm_head"``) left out of the weights file,
    for families whose loader ties the head to the embeddings when it is missing.
    `quantize` is ``(bits, group_size)``: the initialised model is quantized (affine,
    as ``mlx_lm.utils.quantize_model`` does) and config.json records it.
    `scale` multiplies the initialised weights whose names match a regular expression
    (``(pattern, factor)`` pairs; damped layers make a model whose first layers decide
    most of its output, so a model cut after them drafts well for it). `keep_layers`
    cuts the initialised model after its first layers (the same weights as the full
    spec's for those layers): a draft model for the spec it was cut from.
    """

    name: str
    model_type: str
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
    extra: ConfigFields = ()
    layout: Layout = "flat"
    omit_weights: tuple[str, ...] = ()
    quantize: tuple[int, int] | None = None
    scale: tuple[tuple[str, float], ...] = ()
    keep_layers: int | None = None
    construct: str | None = None

    def __post_init__(self) -> None:
        extra = self.extra if isinstance(self.extra, Mapping) else dict(self.extra)
        object.__setattr__(self, "extra", freeze(extra))
        object.__setattr__(self, "omit_weights", tuple(self.omit_weights))
        if not _model_module_exists(self.model_type):
            raise ValueError(f"{self.name}: unsupported model_type {self.model_type!r} (no mlx_lm.models.{self.model_type})")
        if self.layout not in ("flat", "text_config"):
            raise ValueError(f"{self.name}: unknown layout {self.layout!r}")
        extra_dict = thaw(self.extra)
        text_extra = extra_dict.get("text_config", {}) if self.layout == "text_config" else extra_dict
        if "head_dim" not in text_extra and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{self.name}: hidden_size not divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.name}: num_attention_heads not divisible by kv heads")
        if self.tokenizer.vocab_size > self.vocab_size:
            raise ValueError(f"{self.name}: tokenizer vocab exceeds model vocab_size")
        if self.quantize is not None:
            bits, group_size = self.quantize
            if bits not in _QUANT_BITS or group_size not in _QUANT_GROUP_SIZES:
                raise ValueError(f"{self.name}: unsupported quantization {self.quantize!r} (bits {_QUANT_BITS}, group sizes {_QUANT_GROUP_SIZES})")
            object.__setattr__(self, "quantize", (int(bits), int(group_size)))
        object.__setattr__(self, "scale", tuple((str(pattern), float(factor)) for pattern, factor in self.scale))
        if self.keep_layers is not None and not 0 < self.keep_layers <= self.num_hidden_layers:
            raise ValueError(f"{self.name}: keep_layers must be in 1..{self.num_hidden_layers}")
        if self.construct is not None and self.construct not in CONSTRUCTIONS:
            raise ValueError(f"{self.name}: unknown construct {self.construct!r} (known: {', '.join(CONSTRUCTIONS)})")

    def fields(self) -> dict[str, Any]:
        """The spec as JSON data. Fields added after the first built-in models are left
        out at their defaults, so those models keep their digests and directories."""
        data = dataclasses.asdict(self)
        data["extra"] = thaw(self.extra)
        data["omit_weights"] = list(self.omit_weights)
        data["quantize"] = list(self.quantize) if self.quantize is not None else None
        data["scale"] = [list(pair) for pair in self.scale]
        for name, default in (
            ("extra", {}),
            ("layout", "flat"),
            ("omit_weights", []),
            ("quantize", None),
            ("scale", []),
            ("keep_layers", None),
            ("construct", None),
        ):
            if data[name] == default:
                del data[name]
        return data

    def digest(self) -> str:
        """sha256 over the spec's fields and every constant that shapes the build."""
        payload = {
            "format": BUILD_FORMAT,
            "spec": self.fields(),
            "tokenizer_digest": self.tokenizer.digest(),
            "chat_template": CHAT_TEMPLATE,
        }
        if self.construct is not None:
            payload["construct"] = hashlib.sha256(inspect.getsource(sys.modules[CONSTRUCTIONS[self.construct].__module__]).encode()).hexdigest()
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def directory_name(self) -> str:
        """The model's directory under ``<root>/models``."""
        return f"{self.name}-{self.digest()[:12]}"


def _model_module_exists(model_type: str) -> bool:
    """Whether ``mlx_lm.models.<model_type>`` exists, found without importing MLX."""
    if not model_type.isidentifier():
        return False
    package = importlib.util.find_spec("mlx_lm")
    if package is None or not package.submodule_search_locations:
        return False
    return any((Path(location) / "models" / f"{model_type}.py").is_file() for location in package.submodule_search_locations)


# Every model of a vocabulary size shares its tokenizer (trained once per root).
def ensure_model(spec: BuiltinSpec, *, root: Path | str, progress: Progress | None = None) -> Path:
    """Return the directory of any `spec` under `root` (``<root>/models/<name>-<digest>``),
    building it first if needed; the catalog need not list it."""
    root = Path(root)
    say = progress or (lambda _message: None)
    target = root / "models" / spec.directory_name()
    return _ensure_dir(target, MODEL_FILES, lambda tmp: _build_model(spec, root, tmp, say))


def ensure_vision_model(spec: VisionSpec, *, root: Path | str, progress: Progress | None = None) -> Path:
    """Return the directory of the vision-language built-in `spec` under `root`, building it
    first if needed (`engine.builtin.vision`)."""
    root = Path(root)
    say = progress or (lambda _message: None)
    target = root / "models" / spec.directory_name()
    return _ensure_dir(target, VISION_FILES, lambda tmp: build_vision_model(spec, _ensure_tokenizer(spec.tokenizer, root, say), tmp, say))


def ensure_diffusion_model(spec: DiffusionSpec, *, root: Path | str, progress: Progress | None = None) -> Path:
    """Return the directory of the diffusion built-in `spec` under `root`, building it first if
    needed (`engine.builtin.diffusion`)."""
    root = Path(root)
    say = progress or (lambda _message: None)
    target = root / "models" / spec.directory_name()
    return _ensure_dir(target, DIFFUSION_FILES, lambda tmp: build_diffusion_model(spec, _ensure_tokenizer(spec.tokenizer, root, say), tmp, say))


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
    num_parameters, quantization = _write_weights(spec, config, out / "model.safetensors", say)
    if spec.keep_layers is not None:
        _set_layers(config, spec, spec.keep_layers)
    if quantization is not None:
        # Where mlx-lm's loader looks (and what mlx_lm.convert writes).
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    _write_json(out / "config.json", config)
    manifest: dict[str, object] = {
        "format": BUILD_FORMAT,
        "name": spec.name,
        "spec_digest": spec.digest(),
        "spec": spec.fields(),
        "num_parameters": num_parameters,
        "tokenizer_sha256": _sha256(out / "tokenizer.json"),
        "weights_sha256": _sha256(out / "model.safetensors"),
    }
    if quantization is not None:
        manifest["quantization"] = quantization
    _write_json(out / MANIFEST, manifest)
    say(f"built {spec.name!r} ({num_parameters / 1e6:.1f}M params) in {time.perf_counter() - started:.1f}s")


def _hf_config(spec: BuiltinSpec, eos_ids: list[int], pad_id: int) -> dict[str, Any]:
    """HF-style config.json; also the source of the mlx-lm ModelArgs used to build."""
    config: dict[str, Any] = {
        "architectures": [_architecture(spec.model_type)],
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
    elif spec.model_type == "qwen2":
        config.update(use_sliding_window=False)
    else:
        # Families take their own defaults (transformers >= 5 also warns about a
        # `rope_scaling` entry where it expects `rope_parameters`); the tokenizer has
        # no BOS token, which transformers would otherwise default per family.
        del config["rope_scaling"], config["hidden_act"]
        config["bos_token_id"] = None
    if spec.layout == "text_config":
        text_config = {key: value for key, value in config.items() if key not in _TOP_LEVEL_KEYS}
        config = {key: config[key] for key in _TOP_LEVEL_KEYS}
        config["text_config"] = text_config
    _merge(config, thaw(spec.extra))
    return config


def _architecture(model_type: str) -> str:
    camel = "".join(part[:1].upper() + part[1:] for part in model_type.split("_"))
    return _ARCHITECTURES.get(model_type, f"{camel}ForCausalLM")


def _merge(target: dict[str, Any], updates: dict[str, Any]) -> None:
    """Merge `updates` into `target` in place, dicts key by key."""
    for key, value in updates.items():
        current = target.get(key)
        if isinstance(current, dict) and isinstance(value, dict):
            _merge(current, value)
        else:
            target[key] = value


def parameter_count(spec: BuiltinSpec) -> int:
    """Parameters the built model has (before quantization), counted on a lazily
    initialised, never evaluated model."""
    from mlx.utils import tree_flatten

    model = _instantiate(spec, _hf_config(spec, eos_ids=[0], pad_id=0))
    shapes = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return sum(int(np.prod(p.shape)) for name, p in shapes if not _omitted(spec, name))


def _instantiate(spec: BuiltinSpec, config: dict[str, Any]) -> Any:
    # Imported here so that `import engine.builtin` (e.g. to parse a model name)
    # stays cheap and does not load MLX.
    import mlx.core as mx

    module = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    mx.random.seed(spec.seed)
    return module.Model(module.ModelArgs.from_dict(config))


def _omitted(spec: BuiltinSpec, name: str) -> bool:
    if spec.keep_layers is not None and (layer := re.match(r"(?:model\.)?layers\.(\d+)\.", name)) and int(layer.group(1)) >= spec.keep_layers:
        return True
    return any(name == module or name.startswith(module + ".") for module in spec.omit_weights)


def _set_layers(config: dict[str, Any], spec: BuiltinSpec, num_layers: int) -> None:
    """config.json for the first `num_layers` layers (per-layer lists cut to them)."""
    target = config["text_config"] if spec.layout == "text_config" else config
    target["num_hidden_layers"] = num_layers
    for key, value in list(target.items()):
        if isinstance(value, list) and len(value) == spec.num_hidden_layers:
            target[key] = value[:num_layers]


def _scaled(spec: BuiltinSpec, name: str, value: np.ndarray) -> np.ndarray:
    for pattern, factor in spec.scale:
        if re.fullmatch(pattern, name):
            value = value * np.asarray(factor, dtype=value.dtype)
    return value


def _write_weights(spec: BuiltinSpec, config: dict[str, Any], path: Path, say: Progress) -> tuple[int, dict[str, Any] | None]:
    """Initialise the model's parameters deterministically (then quantize them if the
    spec says so) and save them; return the parameter count and the quantization
    entry for config.json (None when not quantized)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model = _instantiate(spec, config)
    shapes = {name: tuple(p.shape) for name, p in cast(list[tuple[str, Any]], tree_flatten(model.parameters()))}
    num_parameters = sum(int(np.prod(shape)) for name, shape in shapes.items() if not _omitted(spec, name))
    say(f"initializing {num_parameters / 1e6:.1f}M weights")
    rng = np.random.default_rng(spec.seed)
    if spec.quantize is not None and spec.construct is None:
        streamed, entry = _quantized_weights(spec, config, model, shapes, rng, say)
        say("writing weights")
        mx.save_safetensors(str(path), streamed, metadata={"format": "mlx"})
        return num_parameters, entry
    arrays = {name: _scaled(spec, name, _init_param(rng, name, shapes[name])) for name in sorted(shapes)}
    if spec.construct is not None:
        arrays = CONSTRUCTIONS[spec.construct](config, arrays, spec.seed)
    weights = {name: mx.array(value) for name, value in arrays.items()}
    quantization = None
    if spec.quantize is not None:
        bits, group_size = spec.quantize
        say(f"quantizing to {bits} bits (group size {group_size})")
        model.load_weights(list(weights.items()))
        quantization = _quantize(model, bits, group_size)
        weights = dict(cast(list[tuple[str, Any]], tree_flatten(model.parameters())))
    weights = {name: weights[name] for name in sorted(weights) if not _omitted(spec, name)}
    say("writing weights")
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return num_parameters, quantization


def _quantized_weights(
    spec: BuiltinSpec, config: dict[str, Any], model: Any, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator, say: Progress
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A quantized spec's weights, each matrix quantized as soon as it is drawn: the same bytes
    as initialising the whole float model and quantizing it (`_quantize` over loaded weights:
    the same draws in the same order, each layer through its own `to_quantized` with the same
    settings), in a fraction of the memory (a 3B model's float32 weights alone are ~12 GB)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    bits, group_size = cast(tuple[int, int], spec.quantize)
    layers = dict(model.named_modules())
    # Which layers `_quantize` turns into quantized ones, and with which settings: asked of a
    # second lazily initialised copy (nothing of it is ever evaluated).
    shadow = _instantiate(spec, config)
    quantization = _quantize(shadow, bits, group_size)
    settings = {
        path: quantization[path] if isinstance(quantization.get(path), dict) else {"group_size": group_size, "bits": bits, "mode": "affine"}
        for path, module in shadow.named_modules()
        if path in layers and type(module) is not type(layers[path])
    }
    weights: dict[str, Any] = {}
    total, done, reported = sum(int(np.prod(shape)) for shape in shapes.values()), 0, 0
    for name in sorted(shapes):
        value = mx.array(_scaled(spec, name, _init_param(rng, name, shapes[name])))
        path, _, leaf = name.rpartition(".")
        if path in settings and leaf == "weight":
            layer = layers[path]
            layer.weight = value
            converted = layer.to_quantized(**settings[path])
            # (its other parameters, a bias, are drawn and kept on their own, as loaded)
            flat = cast(list[tuple[str, Any]], tree_flatten(converted.parameters()))
            produced = {f"{path}.{key}": array for key, array in flat if key == "weight" or f"{path}.{key}" not in shapes}
            mx.eval(list(produced.values()))
            weights.update(produced)
            layer.pop("weight")  # (the float matrix goes: only its quantized form is kept)
        else:
            weights[name] = value
            mx.eval(value)
        done += int(np.prod(shapes[name]))
        if done * 10 // total > reported:
            reported = done * 10 // total
            say(f"initialized and quantized {done / 1e6:.0f}M of {total / 1e6:.0f}M weights")
    return {name: weights[name] for name in sorted(weights) if not _omitted(spec, name)}, quantization


def _quantize(model: Any, bits: int, group_size: int) -> dict[str, Any]:
    """Affine-quantize `model` in place as ``mlx_lm.utils.quantize_model`` does (every
    layer that can be, honouring the model's own ``quant_predicate``), without its
    printing; return the ``quantization`` entry for config.json."""
    import mlx.nn as nn

    quantization: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    model_predicate = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        verdict: bool | dict[str, Any] = model_predicate(path, module) if model_predicate is not None else True
        if isinstance(verdict, dict):
            quantization[path] = verdict
        return verdict

    nn.quantize(model, group_size, bits, mode="affine", class_predicate=predicate)
    return quantization


def _init_param(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Biases 0, other vectors (norm scales...) 1, matrices (embeddings included)
    N(0, 1/fan_in), fan_in being the last dimension (the input of a linear layer,
    also of stacked experts) or, for convolutions, kernel size x input channels.

    Embeddings get std 1/sqrt(hidden) rather than 1: a large embedding dominates the
    residual stream and, with a tied head, greedy decoding just echoes its input.
    Query/key matrices get twice the std: with flat attention a deep random model
    averages its context into a near-constant state and greedy decoding collapses
    into repeating one token; sharper attention keeps the output varied.
    """
    if len(shape) == 1:
        return np.zeros(shape, np.float32) if name.endswith("bias") else np.ones(shape, np.float32)
    gain = 2.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
    fan_in = int(np.prod(shape[1:])) if len(shape) == 3 and "conv" in name else shape[-1]
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(gain * fan_in**-0.5)


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
