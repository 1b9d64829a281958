"""A GGUF file loaded as an mlx-lm model, on the MLX thread.

The header is read and checked (`format`), the architecture's config derived and every
tensor's shape checked against it (`arch`), then mlx-lm's own model class is built, its
layers with affine-quantized tensors made quantized with those tensors' bits, and the
weights loaded strictly under mlx-lm's parameter names, Q/K rows un-permuted where llama.cpp
permuted them. The result is the same `nn.Module` an mlx-lm directory of these weights gives.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from engine.model.gguf.arch import ROPE_FREQS, Architecture, architecture, check_shapes, expected_shapes, model_config, weight_name
from engine.model.gguf.format import GGUFFile
from engine.model.gguf.tensors import AFFINE_TYPES, FLOAT_TYPES, GROUP, is_supported, read_affine, read_float, unpermute_rows
from engine.model.gguf.tokenizer import load_tokenizer, tokenizer_digest
from protocols.errors import ModelLoadError

# Bits that tensors of a type MLX cannot hold as they are get when requantized.
REQUANTIZED_BITS = 8


@dataclass
class GGUFModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict[str, Any]  # as mlx-lm's config.json
    model_id: str
    tokenizer_id: str
    # What the load did with tensor types MLX does not hold (logged by the caller).
    notes: list[str] = field(default_factory=list)


class FactorRoPE(nn.Module):
    """Rotary embedding with per-dimension frequency factors, as llama.cpp applies a file's
    `rope_freqs` (Llama 3.1+ long-context scaling): period `base^(2i/d) * factor[i]`."""

    def __init__(self, dims: int, base: float, factors: mx.array):
        super().__init__()
        self.dims = dims
        self._freqs = (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)) * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


def load_gguf(
    path: Path,
    *,
    cache_root: Path,
    keeps_quantized: Callable[[int], str | None],
    progress: Callable[[str], None] | None = None,
) -> GGUFModel:
    """The model in the GGUF file at `path`. `keeps_quantized(float_bytes)` says whether its
    quantized tensors stay quantized (then types MLX cannot hold are requantized to 8 bits)
    or not (then they are dequantized to float32, exactly the file's values)."""
    with GGUFFile.open(path) as file:
        arch = architecture(file)
        config = model_config(file, arch)
        check_shapes(file, expected_shapes(config, arch, file))
        unsupported = sorted({t.qtype.name for t in file.tensors.values() if not is_supported(t.qtype)})
        if unsupported:
            raise ModelLoadError(f"{path}: GGUF tensor types {', '.join(unsupported)} cannot be read (no dequantizer)")
        module = importlib.import_module(f"mlx_lm.models.{arch.model_type}")
        model = module.Model(module.ModelArgs.from_dict(config))
        keep = keeps_quantized(sum(4 * _elements(t.shape) for t in file.tensors.values() if t.qtype not in FLOAT_TYPES))
        weights, bits, notes = _read_weights(file, arch, config, keep is not None, progress)
        layers = {name.removesuffix(".weight"): b for name, b in bits.items()}
        nn.quantize(model, class_predicate=lambda path, _: {"group_size": GROUP, "bits": layers[path]} if path in layers else False)
        model.eval()
        try:
            model.load_weights(list(weights.items()), strict=True)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: its tensors do not fit mlx-lm's {arch.model_type!r} model: {exc}") from exc
        if ROPE_FREQS in file.tensors:
            _apply_rope_factors(model, read_float(file, file.tensors[ROPE_FREQS]), config)
        mx.eval(model.parameters())
        eos = [
            file.metadata[k]
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if isinstance(file.metadata.get(k), int) and not isinstance(file.metadata.get(k), bool)
        ]
        defaults = getattr(module, "TOKENIZER_DEFAULTS", None)
        tokenizer = load_tokenizer(file, cache_root, eos_token_ids=eos, defaults=defaults, progress=progress)
        return GGUFModel(model, tokenizer, config, file.digest(), tokenizer_digest(file), notes)


def _elements(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _read_weights(
    file: GGUFFile, arch: Architecture, config: dict[str, Any], keep_quantized: bool, progress: Callable[[str], None] | None
) -> tuple[dict[str, mx.array], dict[str, int], list[str]]:
    """mlx-lm's weights by parameter path, the bits of each quantized one, and notes on types
    that were converted."""
    weights: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    converted: dict[str, int] = {}
    names = [n for n in file.tensors if n != ROPE_FREQS]
    for i, name in enumerate(names):
        info = file.tensors[name]
        target = weight_name(name)
        heads = _permuted_heads(name, arch, config)
        if info.qtype in AFFINE_TYPES:
            weight, scales, biases, bits[target] = read_affine(file, info)
            arrays = {"": weight, "scales": scales, "biases": biases}
        else:
            value = read_float(file, info)
            if info.qtype not in FLOAT_TYPES:
                converted[info.qtype.name] = converted.get(info.qtype.name, 0) + 1
                if keep_quantized and value.ndim >= 2:
                    weight, scales, biases = mx.quantize(value, group_size=GROUP, bits=REQUANTIZED_BITS)
                    arrays, bits[target] = {"": weight, "scales": scales, "biases": biases}, REQUANTIZED_BITS
                else:
                    arrays = {"": value}
            else:
                arrays = {"": value}
        base = target.removesuffix(".weight")
        for suffix, array in arrays.items():
            key = f"{base}.{suffix}" if suffix else target
            weights[key] = unpermute_rows(array, heads) if heads else array
            mx.eval(weights[key])  # one tensor at a time: the numpy copies go right away
        if progress and (i + 1) % max(1, len(names) // 10) == 0:
            progress(f"loading {file.path.name}: {i + 1}/{len(names)} tensors")
    notes = []
    if converted:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(converted.items()))
        what = (
            f"requantized to {REQUANTIZED_BITS}-bit affine (group {GROUP}): not the file's exact values"
            if keep_quantized
            else "dequantized to float32 (the file's exact values)"
        )
        notes.append(f"{kinds} tensors {what}")
    return weights, bits, notes


def _permuted_heads(name: str, arch: Architecture, config: dict[str, Any]) -> int:
    """Heads whose rows llama.cpp permuted in this tensor (0: none)."""
    if not arch.permutes_qk:
        return 0
    if name.endswith((".attn_q.weight", ".attn_q.bias")):
        return int(config["num_attention_heads"])
    if name.endswith((".attn_k.weight", ".attn_k.bias")):
        return int(config["num_key_value_heads"])
    return 0


def _apply_rope_factors(model: nn.Module, factors: mx.array, config: dict[str, Any]) -> None:
    rope = FactorRoPE(int(config["head_dim"]), float(config["rope_theta"]), factors)
    for layer in model.layers:
        layer.self_attn.rope = rope
