"""Two CPU lanes: the engine's elementwise-bound pieces split over two MLX streams.

On the CPU backend MLX runs every elementwise kernel (`exp`, the softmax, SiLU, gathers) on its
stream's one thread, ~15-22 ns an element for `exp` here, while matrix products use every core
through BLAS. So in a prefill of 8 prompts the SiLU and the attention's softmax run on one core
of two, and they are most of the forward's time after the matrix products (docs/benchmarks/log.md).

While the engine steps (`parallel()`, on its MLX thread), such a piece is split into two halves
along an axis its computation is independent over (rows, tokens, or KV heads), the second half
queued on a second CPU stream of the thread's own, and the halves joined. Each element is
computed by the same kernel from the same inputs (a matrix product inside a piece keeps its
shape per batch item), so the result is bit for bit the unsplit one (tests/engine/test_lanes.py);
only the wall time changes. Pieces smaller than a few thousand elements are not split (the
join and the streams' handoff cost more than they save), nor anything off the CPU backend (Metal
runs one kernel over the whole array), nor anything outside the engine's step: other users of
mlx-lm's modules in the same process (a baseline measured beside us) see mlx-lm's own code.

What is split: the SwiGLU activation of the model's MLPs (`install` rebinds mlx-lm's `swiglu`
name in the model's modules to `swiglu` here), and the attention (prefill chunks through
`attention`, decode steps through `engine.kv.attention.decode_attention`).

mlxrt's own CPU kernels (`engine.native`: the SwiGLU, the softmax and the attention around it,
eight floats at a time, bit for bit MLX's results) serve the same pieces during the step where
they are loaded, for float32: the SwiGLU then runs whole (10-20x faster, nothing left to split),
the attention still on two lanes (its matrix products and masking are MLX's); the model's
`nn.RMSNorm` and `nn.RoPE` layers (`KernelRMSNorm`, `KernelRoPE`) run as one primitive each in
place of MLX's six and ~20 ops; quantized linear layers and tied quantized embeddings
(`KernelQuantizedLinear`, `KernelQuantizedEmbedding`) multiply by their stored 4- or 8-bit weights
in mlxrt's kernel (same function, another float summation order: not bit for bit). A compiled step traced inside the step uses them too
(`suspended()` stops the splitting only).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations

from engine import native
from engine.model.weights import kernel_serves
from engine.rebind import rebind

_SWIGLU = activations.swiglu
# The fewest elements a piece must have to be split: below it, the join and the second
# stream's handoff (~30-60 us here) cost about what the second core saves.
MIN_ELEMENTS = 8192
# OpenBLAS runs a matrix product on its worker threads once m * n * k exceeds 65,536 x 4
# (`interface/gemm.c`), and two lanes making such calls at once wait on each other's use of its
# workers. Attention halves whose products are that large are not split, unless they are at
# least `LARGE_PRODUCT` (there the split softmax pays for the wait). Measured per layer (9 query
# heads over 3 KV heads, 64 dims; split vs whole, ms): a lone decode row over 2,048 positions
# 2.22 vs 0.47, over 1,024 0.38 vs 0.30, over 512 0.25 vs 0.24 (by KV heads: never split); 16 rows
# over 1,024 2.66 vs 4.06 (products under the threshold); prefill 8 x 127 tokens 9.5 vs 6.9, 1 x 128 over 2,048 12.2 vs 9.1, 1 x 256 over 256
# 8.6 vs 2.8, 1 x 512 over 1,024 20.5 vs 19.5, 1 x 512 over 2,048 44.3 vs 60.6, 1 x 1,024 over
# 1,024 40.3 vs 57.3; 16 x 63 over 63 4.6 vs 6.5.
THREADED_PRODUCT = 65536 * 4
LARGE_PRODUCT = 1 << 26

_local = threading.local()


def enabled() -> bool:
    """Whether this thread is inside `parallel()` (and not `suspended()`), on the CPU backend."""
    return getattr(_local, "on", False)


@contextlib.contextmanager
def parallel(on: bool = True) -> Iterator[None]:
    """Split pieces over two lanes, and use mlxrt's CPU kernels, on this thread while inside
    (the engine's step); `on=False`: neither."""
    previous = enabled(), getattr(_local, "kernels", False)
    _local.on = _local.kernels = on and mx.default_device() == mx.cpu
    try:
        yield
    finally:
        _local.on, _local.kernels = previous


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Nothing split while inside (a traced, compiled function: one graph, one stream); the
    kernels stay."""
    previous = enabled()
    _local.on = False
    try:
        yield
    finally:
        _local.on = previous


def kernels(*arrays: mx.array) -> ModuleType | None:
    """mlxrt's CPU kernels (`engine.native`) where this thread's step may use them on `arrays`
    (loaded, inside `parallel()`, all float32); None: MLX's ops."""
    if not getattr(_local, "kernels", False):
        return None
    module = native.loaded()
    if module is None or any(a.dtype != mx.float32 for a in arrays):
        return None
    return module


def second() -> mx.Stream:
    """This thread's second CPU stream (MLX's streams are the thread's own)."""
    stream = getattr(_local, "second", None)
    if stream is None:
        stream = _local.second = mx.new_stream(mx.cpu)
    return stream


def halves(fn: Callable[..., mx.array], first: Sequence, rest: Sequence, axis: int) -> mx.array:
    """`fn(*first)` on this thread's stream and `fn(*rest)` on the second, joined along `axis`
    (nothing inside either half is split again)."""
    with suspended():
        a = fn(*first)
        with mx.stream(second()):
            b = fn(*rest)
    return mx.concatenate([a, b], axis=axis)


def split_at(x, axis: int, at: int, size: int) -> tuple:
    """`x`'s two halves along `axis` (of length `size` in the pieces split), where `x` has that
    axis at full length; `x` itself twice where it broadcasts there (length 1) or is not an
    array (a mask given by name, None)."""
    if not isinstance(x, mx.array) or x.ndim <= axis or x.shape[axis] != size:
        return x, x
    index = [slice(None)] * x.ndim
    first, rest = list(index), list(index)
    first[axis], rest[axis] = slice(0, at), slice(at, None)
    return x[tuple(first)], x[tuple(rest)]


def split_mask(mask, axis: int, at: int, size: int) -> tuple:
    """An attention mask's two halves along `axis` of the `[rows, heads, queries, keys]` it
    broadcasts against (a mask of fewer dimensions aligns to the right, as in broadcasting)."""
    if isinstance(mask, mx.array) and mask.ndim < 4:
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    return split_at(mask, axis, at, size)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu` (SiLU of the gate times the up projection): mlxrt's kernel, else split
    by tokens."""
    module = kernels(gate, x)
    if module is not None and gate.shape == x.shape:
        return module.swiglu(gate, x)
    if not enabled() or gate.size < MIN_ELEMENTS or gate.shape != x.shape or gate.ndim < 2:
        return _SWIGLU(gate, x)
    width = gate.shape[-1]
    tokens = gate.size // width
    if tokens < 2:
        return _SWIGLU(gate, x)
    flat_gate, flat_x = gate.reshape(tokens, width), x.reshape(tokens, width)
    at = tokens // 2
    joined = halves(_SWIGLU, (flat_gate[:at], flat_x[:at]), (flat_gate[at:], flat_x[at:]), axis=0)
    return joined.reshape(gate.shape)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array | None:
    """`mx.fast.scaled_dot_product_attention` split by rows (several) or else by KV heads (a
    lone row's chunk); None where nothing is split (the caller attends as it would have)."""
    if not enabled() or not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        return None
    rows, heads, num_queries, _ = queries.shape
    if rows * heads * num_queries * keys.shape[2] < MIN_ELEMENTS:
        return None

    def half(q, k, v, m):
        return sdpa(q, k, v, scale, m)

    return split_attention(half, queries, keys, values, mask)


def sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` (no sinks): mlxrt's kernel where `kernels` allows
    (a mask by name, none, or a boolean or float32 array), else MLX's."""
    module = kernels(queries, keys, values)
    if module is not None:
        if mask is None or (isinstance(mask, str) and mask == "causal"):
            return module.scaled_dot_product_attention(queries, keys, values, scale=scale, mask_mode=mask or "")
        if isinstance(mask, mx.array) and mask.ndim <= 4 and mask.dtype in (mx.bool_, mx.float32):
            return module.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def softmax(x: mx.array) -> mx.array:
    """`mx.softmax(x, axis=-1, precise=True)`: mlxrt's kernel where `kernels` allows."""
    module = kernels(x)
    return module.softmax(x) if module is not None else mx.softmax(x, axis=-1, precise=True)


def split_attention(fn: Callable[..., mx.array], queries: mx.array, keys: mx.array, values: mx.array, mask) -> mx.array | None:
    """`fn(queries, keys, values, mask)` over two halves of the rows, or of the KV heads (with
    their query heads) for a lone row's prefill chunk; None where neither has two parts, for a
    lone decode row, and where the halves' matrix products are ones OpenBLAS threads but not
    large (`THREADED_PRODUCT`)."""
    rows, heads, num_queries = queries.shape[:3]
    kv_heads = keys.shape[1]
    # Each product's m (a row's queries; a decode row's query heads per KV head, stacked) x n x k.
    product = (num_queries if num_queries > 1 else max(1, heads // kv_heads)) * keys.shape[2] * keys.shape[3]
    if THREADED_PRODUCT < product < LARGE_PRODUCT or (rows == 1 and num_queries == 1):
        return None  # (a lone decode row's KV heads: level at 512 positions, slower past)
    if rows >= 2:
        at = rows // 2
        parts = [split_at(x, 0, at, rows) for x in (queries, keys, values)]
        masks = split_mask(mask, 0, at, rows)
        return halves(fn, [p[0] for p in parts] + [masks[0]], [p[1] for p in parts] + [masks[1]], axis=0)
    if kv_heads >= 2 and heads % kv_heads == 0:
        at_kv = kv_heads // 2
        at_q = at_kv * (heads // kv_heads)
        q_parts = split_at(queries, 1, at_q, heads)
        k_parts, v_parts = split_at(keys, 1, at_kv, kv_heads), split_at(values, 1, at_kv, kv_heads)
        masks = split_mask(mask, 1, at_q, heads)
        return halves(fn, (q_parts[0], k_parts[0], v_parts[0], masks[0]), (q_parts[1], k_parts[1], v_parts[1], masks[1]), axis=1)
    return None


class KernelRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` whose calls inside the engine's step use mlxrt's kernel (`kernels`: one
    primitive for the six ops of MLX's CPU `rms_norm`, the same bits); elsewhere its own."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        module = kernels(x, weight)
        if module is not None:
            return module.rms_norm(x, weight, self.eps)
        return super().__call__(x)


class KernelRoPE(nn.RoPE):
    """`nn.RoPE` whose calls inside the engine's step use mlxrt's kernel (`kernels`: one
    primitive for MLX's ~20-op CPU `rope`, the same bits); elsewhere its own."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        module = kernels(x)
        if module is not None and self.base is not None:
            positions = offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
            return module.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=positions)
        # (MLX's `rope` takes an array of offsets too; nn.RoPE's annotation says int)
        return super().__call__(x, offset)  # type: ignore[arg-type]


def _quantized_product(layer: nn.Module, x: mx.array) -> mx.array | None:
    """`x` times a quantized layer's weight (transposed) by mlxrt's kernel where `kernels` allows
    and the kernel serves the layer (`engine.model.weights`); None: MLX's `quantized_matmul`."""
    module = kernels(x, layer["scales"], layer["biases"]) if "biases" in layer else None
    if module is None or not kernel_serves(layer):
        return None
    ratio = getattr(layer, BIAS_RATIO, 0.0)
    return module.quantized_matmul(x, layer["weight"], layer["scales"], layer["biases"], group_size=layer.group_size, bits=layer.bits, bias_ratio=ratio)


# A kernel-served layer's attribute: the power of two its biases are exactly its scales times, or 0.
BIAS_RATIO = "_mlxrt_bias_ratio"


def bias_ratio(layer: nn.Module) -> float:
    """`-2^(bits - 1)` where a quantized layer's biases are exactly its scales times it (GGUF's Q4_0
    and Q8_0: `-8 d`, `-128 d`), else 0. The kernel then takes a lone row's biases' term from the
    scales it has just read instead of reading the biases (the same value: a power of two's scaling
    is exact): a Q8_0 output layer, memory-bound at c1, reads 36 bytes a 32 weights, not 40."""
    if "biases" not in layer or "scales" not in layer or getattr(layer, "mode", "affine") != "affine":
        return 0.0
    ratio = -float(2 ** (layer.bits - 1))
    return ratio if bool(mx.array_equal(layer["biases"], layer["scales"] * ratio).item()) else 0.0


class KernelQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose products inside the engine's step use mlxrt's quantized kernel
    (`_quantized_product`); elsewhere its own."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _quantized_product(self, x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose products as the output layer (tied embeddings) inside the
    engine's step use mlxrt's quantized kernel; its lookups are MLX's own."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _quantized_product(self, x)
        return super().as_linear(x) if y is None else y


_KERNEL_CLASSES: dict[type, type] = {
    nn.RMSNorm: KernelRMSNorm,
    nn.RoPE: KernelRoPE,
    nn.QuantizedLinear: KernelQuantizedLinear,
    nn.QuantizedEmbedding: KernelQuantizedEmbedding,
}


def install(model) -> list[str]:
    """Rebind mlx-lm's `swiglu` to `swiglu` here in the modules the model's layers come from,
    and make the model's `nn.RMSNorm` and `nn.RoPE` layers `KernelRMSNorm`s and `KernelRoPE`s (its
    quantized layers the `Kernel*` ones, each with its `bias_ratio` on the CPU); returns the modules
    rebound.
    Outside `parallel()` both are mlx-lm's and MLX's own code."""
    for _, layer in model.named_modules():
        kind = _KERNEL_CLASSES.get(type(layer))
        if kind is not None:
            layer.__class__ = kind
        if kind in (KernelQuantizedLinear, KernelQuantizedEmbedding) and mx.default_device() == mx.cpu:
            setattr(layer, BIAS_RATIO, bias_ratio(layer))
    return rebind(model, "swiglu", _SWIGLU, swiglu)
