"""Quantized weights on the CPU backend: kept for mlxrt's kernels, or dequantized at load.

MLX's CPU `quantized_matmul` is ~3x slower than float32 for one row and ~35x slower for 16
rows (shared/PLATFORM.md), while float32 matmul goes through BLAS; `gather_qmm` (experts) is
~4x slower than `gather_mm`. mlxrt's own kernel (`engine/native/quantized.h`) reads affine 4- and
8-bit weights as stored, 4-8x faster than float32 for a decode step's few rows, since a decode
step is bound by the bytes it reads. So on the CPU backend (`model.cpu_dequantize`):
- "auto": where the kernels are loaded and serve every quantized layer (linear and embedding,
  4 or 8 bits, groups of 32/64/128), the layers stay quantized. (A prefill's products of many
  rows dequantize panels of 1,024 features for BLAS: a 512-token prefill of SmolLM2 took 2.32 s
  against 2.41 s from float32 weights, so no float32 copy is kept.) Elsewhere, the layers are
  dequantized to float32 when those take at most `AUTO_MEMORY_SHARE` of physical memory, else kept.
- "always": dequantized to float32 layers (expert layers too). "never": kept.
On other backends quantized weights are kept. (This is the model's weights; quantized KV,
`kv.bits`, is `engine.kv.quantized`.) The float32 weights are exactly `mx.dequantize` of the
stored ones: the model computes the same function as mlx-lm's quantized forward, up to float
rounding in the matrix products.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

AUTO_MEMORY_SHARE = 0.5
KERNEL_BITS = (4, 8)
KERNEL_GROUPS = (32, 64, 128)


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


def parameter_count(model: nn.Module) -> int:
    """The model's weights, a quantized layer's counted as the values it packs (not its packed
    words, scales and biases)."""
    from mlx.utils import tree_flatten

    total = sum(value.size for _, value in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())))
    for _, module in model.named_modules():
        if isinstance(module, _QUANTIZED):
            total += module.weight.size * 32 // module.bits - module.weight.size
            total -= sum(module[name].size for name in ("scales", "biases") if name in module)
    return total


def decode_weight_bytes(model: nn.Module) -> int:
    """The bytes of weights one decode step reads, as the model holds them (quantized or float):
    every parameter once, except an embedding table that is not also the output head (one row of
    it a token). 0 for a mixture of experts: each token reads only the experts it is routed to."""
    from mlx.utils import tree_flatten

    modules = [module for _, module in model.named_modules()]
    if any(isinstance(module, (SwitchLinear, QuantizedSwitchLinear)) for module in modules):
        return 0
    total = sum(value.nbytes for _, value in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())))
    for table in (m for m in modules if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))):
        rows = table.weight.shape[0]
        # (Tied, the table is the head and read whole; untied, a linear layer has its rows as outputs.)
        if any(isinstance(m, (nn.Linear, nn.QuantizedLinear)) and m.weight.shape[0] == rows for m in modules):
            table_bytes = sum(value.nbytes for _, value in cast(list[tuple[str, mx.array]], tree_flatten(table.parameters())))
            total -= table_bytes - table_bytes // rows
    return total


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


def kernels_loaded() -> bool:
    """Whether mlxrt's CPU kernels, with the quantized product, serve in this process."""
    from engine import native

    module = native.loaded()
    return module is not None and hasattr(module, "quantized_matmul") and mx.default_device() == mx.cpu


def kernel_serves(module: nn.Module) -> bool:
    """Whether mlxrt's quantized kernel computes this layer's products."""
    return (
        isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
        and getattr(module, "mode", "affine") == "affine"
        and module.bits in KERNEL_BITS
        and module.group_size in KERNEL_GROUPS
        and "biases" in module
    )


KERNELS_REASON = "kept: mlxrt's quantized kernels decode from the stored weights"


def keeps_quantized(policy: str, float_bytes: int, kernels: bool = True) -> str | None:
    """Why quantized weights whose float32 form takes `float_bytes` stay quantized under
    `policy`, or None when they are dequantized (`kernels`: may mlxrt's kernels serve them)."""
    if mx.default_device() != mx.cpu:
        return "kept: not the CPU backend"
    if policy == "never":
        return "kept: model.cpu_dequantize = never"
    if policy == "auto" and kernels and kernels_loaded():
        return KERNELS_REASON
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
    if policy == "auto" and kernels_loaded() and all(kernel_serves(module) for _, module in modules):
        return QuantizationReport(len(modules), False, KERNELS_REASON, bits, group)
    if (kept := keeps_quantized(policy, need, kernels=False)) is not None:
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
