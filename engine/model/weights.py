"""Quantized weights on the CPU backend: dequantize at load when it fits.

MLX's CPU `quantized_matmul` is ~3x slower than float32 for one row and ~35x slower for 16
rows (shared/PLATFORM.md), while float32 matmul goes through BLAS; `gather_qmm` (experts) is
~4x slower than `gather_mm`. So on the CPU backend a quantized model's linear, embedding and
expert (switch) layers are turned back into float32 ones at load (`model.cpu_dequantize`):
"always", "never", or "auto" = when the float32 weights take at most `AUTO_MEMORY_SHARE` of
physical memory. On other backends quantized weights are kept. (This is the model's weights;
quantized KV, `kv.bits`, is `engine.kv.quantized`.)
The dequantized weights are exactly `mx.dequantize` of the stored ones: the model computes
the same function as mlx-lm's quantized forward, up to float rounding in the matmuls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

AUTO_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class QuantizationReport:
    """What the load did with quantized weights (for `ModelInfo` and the load log)."""

    quantized_modules: int
    dequantized: bool
    reason: str
    bits: int | None = None
    group_size: int | None = None


_QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)


def _quantized(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The quantized layers `mx.dequantize` can undo (not those with a global scale)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _QUANTIZED) and getattr(m, "global_scale", None) is None]


def _float_bytes(modules: list[tuple[str, nn.Module]]) -> int:
    total = 0
    for _, module in modules:
        *outer, packed = module.weight.shape
        count = packed * 32 // module.bits
        for size in outer:
            count *= size
        total += count * 4
    return total


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def keeps_quantized(policy: str, float_bytes: int) -> str | None:
    """Why quantized weights whose float32 form takes `float_bytes` stay quantized under
    `policy`, or None when they are dequantized."""
    if mx.default_device() != mx.cpu:
        return "kept: not the CPU backend"
    if policy == "never":
        return "kept: model.cpu_dequantize = never"
    memory = _physical_memory()
    if policy == "auto" and memory and float_bytes > AUTO_MEMORY_SHARE * memory:
        return f"kept: float32 weights need {float_bytes / 2**30:.1f} GiB, over {AUTO_MEMORY_SHARE:.0%} of {memory / 2**30:.1f} GiB"
    return None


def apply_cpu_policy(model: nn.Module, policy: str, dtype: mx.Dtype = mx.float32) -> QuantizationReport:
    """Dequantize a quantized model's layers in place per `policy` ("auto", "always", "never")."""
    modules = _quantized(model)
    if not modules:
        return QuantizationReport(0, False, "not quantized")
    bits, group = modules[0][1].bits, modules[0][1].group_size
    need = _float_bytes(modules)
    if (kept := keeps_quantized(policy, need)) is not None:
        return QuantizationReport(len(modules), False, kept, bits, group)
    model.update_modules(tree_unflatten([(name, _dequantized(module, dtype)) for name, module in modules]))
    mx.eval(model.parameters())
    return QuantizationReport(len(modules), True, f"dequantized to float32 ({need / 2**20:.0f} MiB) for the CPU backend", bits, group)


def _dequantized(module: nn.Module, dtype: mx.Dtype) -> nn.Module:
    biases = getattr(module, "biases", None)
    mode = getattr(module, "mode", "affine")
    weight = mx.dequantize(module.weight, module.scales, biases, module.group_size, module.bits, mode=mode).astype(dtype)
    has_bias = "bias" in module
    if isinstance(module, nn.QuantizedEmbedding):
        embedding = nn.Embedding(weight.shape[0], weight.shape[1])
        embedding.weight = weight
        return embedding
    layer: nn.Module
    if isinstance(module, QuantizedSwitchLinear):  # experts: [num_experts, out, in]
        num_experts, out_dims, in_dims = weight.shape
        layer = SwitchLinear(in_dims, out_dims, num_experts, bias=has_bias)
    else:
        out_dims, in_dims = weight.shape
        layer = nn.Linear(in_dims, out_dims, bias=has_bias)
    layer.weight = weight
    if has_bias:
        layer.bias = module.bias.astype(dtype)
    return layer
