"""Tiny GGUF files written from mlx-lm model directories, as llama.cpp's converter writes them.

`write_gguf(model_dir, path, qtype=...)` writes the model's metadata, its tokenizer (vocabulary,
merges, token kinds, special ids, chat template) and its weights with the `gguf` package's
writer: 2-D weights quantized to `qtype` with the package's reference quantizers (1-D tensors
stay F32, as llama.cpp keeps them), llama's Q and K rows permuted the way
`convert_hf_to_gguf.py` permutes them. Nothing is downloaded.
`gguf_header(...)` writes a header byte by byte, with whatever counts, lengths and offsets a
hostile file claims.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize
from safetensors.numpy import load_file

# mlx-lm parameter paths -> llama.cpp names (the inverse of engine.model.gguf.arch's table).
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_BLOCK[rest]}"


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf.py's `LlamaModel.permute`)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_gguf(
    model_dir: Path,
    path: Path,
    *,
    qtype: str = "Q8_0",
    pre: str = "gpt2",
    architecture: str | None = None,
    metadata: dict[str, Any] | None = None,
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    drop: tuple[str, ...] = (),
    without_rope_factors: bool = False,
) -> Path:
    """Write `model_dir` (an mlx-lm llama/qwen2/qwen3 directory) as a GGUF file at `path`.
    `metadata` adds or overrides keys (a value of None removes one), `tensors` adds raw ones,
    `drop` leaves tensors out: for files that are wrong on purpose."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = architecture or config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    keys: dict[str, Any] = {
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config.get("max_position_embeddings", 2048),
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.rope.freq_base": float(config.get("rope_theta", 10000.0)),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        **_tokenizer_keys(model_dir, pre),
        **(metadata or {}),
    }
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(model_dir.name)
    for key, value in keys.items():
        if value is not None:
            _add(writer, key, value)
    weights = {k: v for k, v in load_file(str(model_dir / "model.safetensors")).items() if k not in drop}
    for name, array in sorted(weights.items()):
        array = array.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = permute(array, heads, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = permute(array, heads, kv_heads)
        target = GGMLQuantizationType[qtype] if array.ndim == 2 else GGMLQuantizationType.F32
        data = quantize(array, target) if target not in (GGMLQuantizationType.F32,) else array
        writer.add_tensor(gguf_name(name), data, raw_dtype=target)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3" and not without_rope_factors:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(scaling, float(config.get("rope_theta", 10000.0)), head_dim))
    for name, (data, kind) in (tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_factors(scaling: dict[str, Any], base: float, dim: int) -> np.ndarray:
    """Llama 3.1's long-context frequency factors as llama.cpp's converter stores them."""
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _tokenizer_keys(model_dir: Path, pre: str) -> dict[str, Any]:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    added = {t["content"]: t for t in spec["added_tokens"]}
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "ids must be dense"
    kinds = [(3 if added[t]["special"] else 4) if t in added else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    eos = config["eos_token"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": vocab[eos if isinstance(eos, str) else eos["content"]],
        "tokenizer.ggml.padding_token_id": vocab[eos if isinstance(eos, str) else eos["content"]],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": config["chat_template"],
    }


def _add(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        (writer.add_uint32 if value < 1 << 32 else writer.add_uint64)(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)  # lists of ints are written as INT32, of strings as STRING


def gguf_header(
    *,
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    kvs: tuple[tuple[str | bytes, int, bytes], ...] = (),
    tensors: tuple[tuple[str | bytes, tuple[int, ...], int, int], ...] = (),
    magic: bytes = b"GGUF",
) -> bytes:
    """A GGUF header written byte by byte, counts and lengths as given (true or not): metadata
    `(key, value type, encoded value)` and tensors `(name, dims innermost first, ggml type, offset)`."""
    out = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    for key, kind, payload in kvs:
        out += gguf_string(key) + struct.pack("<I", kind) + payload
    for name, dims, kind, offset in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind, offset)
    return out


def gguf_string(text: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string: its length (the true one unless `length` says otherwise), then its bytes."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw
