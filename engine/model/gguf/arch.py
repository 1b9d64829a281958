"""GGUF architectures mapped onto mlx-lm's model classes: config, tensor names, shapes.

Pure data and checks (no MLX): `model_config(file)` turns a file's metadata into the
`config.json` dict mlx-lm's `ModelArgs` takes, `weight_name` maps llama.cpp's tensor names onto
mlx-lm's parameter paths, and `check_shapes` compares every tensor against the shape that
config implies, so a file whose metadata and tensors disagree (or that names dimensions its
tensors do not have) is refused before a model is built.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, cast

from engine.model.gguf.format import GGUFFile
from protocols.errors import ModelLoadError

DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class Architecture:
    """What mlx-lm class serves a GGUF `general.architecture`, and how its file differs."""

    model_type: str  # mlx-lm's
    # llama.cpp's converter permutes Q and K rows of these (for its interleaved rotary layout).
    permutes_qk: bool
    has_qk_norm: bool = False
    # Bias on q/k/v projections: always (qwen2), never, or read from the file (None).
    qkv_bias: bool | None = None


ARCHITECTURES = {
    "llama": Architecture("llama", permutes_qk=True),
    "qwen2": Architecture("qwen2", permutes_qk=False, qkv_bias=True),
    "qwen3": Architecture("qwen3", permutes_qk=False, has_qk_norm=True, qkv_bias=False),
}

# llama.cpp block tensor names -> mlx-lm module paths under `model.layers.N.`.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_GLOBAL = re.compile(r"([a-z_]+)\.(weight|bias)")
# Precomputed rotary frequency factors (Llama 3.1+ long-context scaling): not a parameter.
ROPE_FREQS = "rope_freqs.weight"


def architecture(file: GGUFFile) -> Architecture:
    name = file.metadata.get("general.architecture")
    if not isinstance(name, str):
        raise ModelLoadError(f"{file.path}: no general.architecture in the GGUF metadata")
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ModelLoadError(f"{file.path}: GGUF architecture {name!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return arch


def weight_name(gguf_name: str) -> str:
    """mlx-lm's parameter path for a llama.cpp tensor name."""
    if m := _BLOCK.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif (m := _GLOBAL.fullmatch(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no counterpart in mlx-lm's model")


class _Metadata:
    """Typed reads of `<arch>.*` keys, each failure a `ModelLoadError` naming the key."""

    def __init__(self, file: GGUFFile):
        self.file, self.prefix = file, file.metadata["general.architecture"]

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        full = f"{self.prefix}.{key}"
        value: Any = self.file.metadata.get(full, default)
        if value is None:
            raise ModelLoadError(f"{self.file.path}: GGUF metadata {full!r} is missing")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) is not (kind is bool):
            raise ModelLoadError(f"{self.file.path}: GGUF metadata {full!r} is {type(value).__name__} {value!r}, expected one {kind.__name__}")
        if kind is int and not 0 < cast(int, value) < 1 << 40:
            raise ModelLoadError(f"{self.file.path}: GGUF metadata {full!r} = {value} is out of range")
        if kind is float and not math.isfinite(cast(float, value)):
            raise ModelLoadError(f"{self.file.path}: GGUF metadata {full!r} = {value} is not a finite number")
        return value

    def positive(self, key: str, default: Any = None) -> float:
        """A float that must be > 0 (an epsilon, a rotary base): 0 or less makes every output NaN."""
        value = self.get(key, float, default)
        if value <= 0:
            raise ModelLoadError(f"{self.file.path}: GGUF metadata {self.prefix}.{key!s} = {value} must be positive")
        return cast(float, value)


def model_config(file: GGUFFile, arch: Architecture) -> dict[str, Any]:
    """mlx-lm's config for the file (as a `config.json` would have it)."""
    meta = _Metadata(file)
    heads = meta.get("attention.head_count", int)
    kv_heads = meta.get("attention.head_count_kv", int, heads)
    hidden = meta.get("embedding_length", int)
    head_dim = meta.get("attention.key_length", int, hidden // heads)
    if meta.get("attention.value_length", int, head_dim) != head_dim:
        raise ModelLoadError(f"{file.path}: keys and values of different head sizes are not supported")
    if meta.get("rope.dimension_count", int, head_dim) != head_dim:
        raise ModelLoadError(f"{file.path}: rotary embedding over part of each head is not supported for GGUF {meta.prefix!r}")
    if head_dim % 2:  # rotary embeddings turn pairs of dimensions (and llama.cpp's Q/K permutation needs them)
        raise ModelLoadError(f"{file.path}: GGUF head size {head_dim} is odd; rotary embeddings need an even one")
    if heads % kv_heads:
        raise ModelLoadError(f"{file.path}: {heads} attention heads do not group into {kv_heads} key-value heads")
    embeddings = file.tensors.get("token_embd.weight")
    if embeddings is None:
        raise ModelLoadError(f"{file.path}: no token_embd.weight tensor")
    layers = meta.get("block_count", int)
    found = {int(m.group(1)) for name in file.tensors if (m := _BLOCK.fullmatch(name))}
    if len(found) != layers or found != set(range(layers)):
        raise ModelLoadError(f"{file.path}: GGUF metadata says {layers} blocks, its tensors hold {len(found)}")
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > embeddings.shape[0]:
        raise ModelLoadError(f"{file.path}: {len(tokens)} tokens but {embeddings.shape[0]} embedding rows")
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": meta.get("feed_forward_length", int),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.positive("attention.layer_norm_rms_epsilon"),
        "vocab_size": embeddings.shape[0],
        "max_position_embeddings": meta.get("context_length", int, DEFAULT_CONTEXT),
        "rope_theta": meta.positive("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    if arch.qkv_bias is None:
        config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in file.tensors
    if scaling := rope_scaling(meta):
        config["rope_scaling"] = scaling
    return config


def rope_scaling(meta: _Metadata) -> dict[str, Any] | None:
    """mlx-lm's `rope_scaling` for linear scaling; None without scaling. Frequency factors
    stored as a tensor (Llama 3.x) are applied by the loader, not through the config."""
    kind = meta.get("rope.scaling.type", str, "none")
    factor = meta.get("rope.scaling.factor", float, 0.0) or meta.get("rope.scale_linear", float, 0.0)
    if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    raise ModelLoadError(f"{meta.file.path}: rope scaling {kind!r} is not supported for GGUF files (linear and Llama 3 frequency factors are)")


def expected_shapes(config: dict[str, Any], arch: Architecture, file: GGUFFile) -> dict[str, tuple[int, ...]]:
    """Every tensor the file must hold for `config` (llama.cpp names), with its shape."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    q_rows, kv_rows = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (config["vocab_size"], hidden), "output_norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (config["vocab_size"], hidden)
    qkv_bias = arch.qkv_bias if arch.qkv_bias is not None else config["attention_bias"]
    for i in range(config["num_hidden_layers"]):
        block = {
            "attn_norm.weight": (hidden,),
            "ffn_norm.weight": (hidden,),
            "attn_q.weight": (q_rows, hidden),
            "attn_k.weight": (kv_rows, hidden),
            "attn_v.weight": (kv_rows, hidden),
            "attn_output.weight": (hidden, q_rows),
            "ffn_gate.weight": (ffn, hidden),
            "ffn_up.weight": (ffn, hidden),
            "ffn_down.weight": (hidden, ffn),
        }
        if qkv_bias:
            block.update({"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)})
        if arch.qkv_bias is None and config["attention_bias"]:
            block["attn_output.bias"] = (hidden,)
        if arch.qkv_bias is None and config["mlp_bias"]:
            block.update({"ffn_gate.bias": (ffn,), "ffn_up.bias": (ffn,), "ffn_down.bias": (hidden,)})
        if arch.has_qk_norm:
            block.update({"attn_q_norm.weight": (config["head_dim"],), "attn_k_norm.weight": (config["head_dim"],)})
        shapes.update({f"blk.{i}.{name}": shape for name, shape in block.items()})
    if ROPE_FREQS in file.tensors:
        shapes[ROPE_FREQS] = (config["head_dim"] // 2,)
    return shapes


def check_shapes(file: GGUFFile, expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse a file whose tensors are not exactly the expected ones, with the expected shapes."""
    names = set(file.tensors)
    if missing := sorted(set(expected) - names):
        raise ModelLoadError(f"{file.path}: GGUF tensors missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra := sorted(names - set(expected)):
        raise ModelLoadError(f"{file.path}: GGUF tensors this architecture does not use: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    for name, shape in expected.items():
        if file.tensors[name].shape != shape:
            raise ModelLoadError(f"{file.path}: GGUF tensor {name!r} has shape {file.tensors[name].shape}, the metadata implies {shape}")
