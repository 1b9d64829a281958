"""The one-token decode step as one compiled function of fixed-shape inputs, for any layers.

Each row writes at its own position in the whole buffers and attends over their full capacity
under a mask, so the shapes change only when rows join or leave or a capacity grows; MLX then
traces the step once per such geometry instead of building the model's graph op by op on
every step (a few ms of Python per step, which the CPU backend cannot overlap with compute).

Per layer kind, inside the traced function:
- full attention: keys and values `[rows, heads, capacity, dim]`, position `p` at slot `p`;
- sliding window: the ring of `engine.kv.slots.WindowSlots` (position `p` at slot `p % ring`),
  each slot masked by whether the position it holds is inside the query's window;
- paged full attention (`engine.kv.paged`): the layer's whole pools `[heads, pool positions,
  dim]`; each row writes its position into its block (`blocks`, the rows' block tables cut or
  padded to a width that grows by powers of two, so a row retraces a few times over its life,
  not every block) and attends over its own positions in place with mlxrt's paged attention
  kernel (over a gathered copy without it), as the uncompiled step does;
- recurrent state: the rows' state arrays, as an `ArraysCache` the layer reads and replaces;
- a list: its parts.
The inputs and outputs are the same arrays in the same order (`DecodeBatch.forward_one`).

Each node of the traced graph costs its evaluation on the CPU backend a few microseconds beyond
its kernel (built anew from the trace every step, allocated, queued, and a task holding its
inputs queued after it), on the MLX thread and the stream's thread that runs the kernels. So
while tracing, a llama-style layer's attention over paged KV (`FUSED_ATTENTION`: llama, mistral,
qwen2) runs as three of mlxrt's primitives after its projections (`_FusedAttention`): the rotated
keys and the values written into the pools, then the rotated, scaled queries' paged attention,
in place of ~18 nodes (reshapes, transposes, two RoPEs, the scaling, two slice updates, the
attention), the same operations on the same values: the same bits (SmolLM2's step: 931 -> 481
nodes). Where every product of such a layer (`FUSED_LAYERS`: llama's and qwen2's decoder layers)
is mlxrt's quantized kernel's, the whole layer is four primitives (`_TracedPaged.fused_layer`):
the normed queries, keys and values as one node of three outputs, the two pool writes, and the
rest of the layer (attention, output product, residual, norm, SwiGLU MLP, residual) as one, in
place of sixteen, the same kernels in the same order (SmolLM2 Q4's step: 481 -> 149 nodes, its c1
step 7.1 against 7.8 ms in one process, windows alternating).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import ArraysCache, CacheList

from engine import lanes
from engine.kv.attention import DECLINED, decode_attention, stack_queries, stacked_mask
from engine.kv.paged import heads_first
from engine.kv.pool import flat_index, gather_blocks, scatter_flat
from engine.model.weights import kernel_serves
from policies.layout import ring_capacity
from protocols.model import LayerLayout


def _scatter_one(buffer: mx.array, new: mx.array, slots: mx.array) -> mx.array:
    """`new` (`[rows, heads, 1, dim]`) written at each row's slot of `buffer`: along the
    position axis when the rows are all the buffer's (cheaper), else by a flat scatter."""
    capacity_rows, heads, capacity, dim = buffer.shape
    rows = new.shape[0]
    if rows == capacity_rows:
        return mx.put_along_axis(buffer, slots[:, None, None, None], new, axis=2)
    # (Each (row, head)'s first position as a range, not `capacity` times an index: `_Masks`.)
    index = (mx.arange(0, rows * heads * capacity, capacity, dtype=mx.int32).reshape(rows, heads) + slots[:, None]).reshape(-1)
    flat = buffer.reshape(capacity_rows * heads * capacity, dim)
    flat[index] = new.reshape(rows * heads, dim)
    return flat.reshape(capacity_rows, heads, capacity, dim)


class _Masks:
    """The step's masks, built once per (kind, capacity, window) and shared by the layers, and
    its paged geometry (`blocks`: each row's block ids, row-major, as many per row).

    No Python number that changes with the shapes (a width, a pool's size) goes into the
    elementwise ops: MLX fuses them into one C++ kernel per set of scalar constants, compiled
    with g++ on the CPU backend, so such a constant would compile new kernels at every retrace
    (in a request, not at the load's warm-up). Ranges carry them instead (`mx.arange`'s step)."""

    def __init__(self, positions: mx.array, blocks: mx.array):
        self.positions = positions
        self.blocks = blocks
        self._built: dict[tuple, mx.array] = {}

    def paged_writes(self, block_size: int) -> mx.array:
        """Each row's new position in the pool (`[rows]`)."""
        key = ("paged-writes", block_size)
        if key not in self._built:
            rows = self.positions.shape[0]
            index = self.positions // block_size
            if rows > 1:  # (each row's blocks start `per_row` after the last's)
                per_row = self.blocks.shape[0] // rows
                index = index + mx.arange(0, rows * per_row, per_row, dtype=mx.int32)
            self._built[key] = mx.take(self.blocks, index) * block_size + self.positions % block_size
        return self._built[key]

    def lengths(self) -> mx.array:
        key = ("lengths",)
        if key not in self._built:
            self._built[key] = self.positions + 1
        return self._built[key]

    def full(self, capacity: int, window: int | None) -> mx.array:
        key = ("full", capacity, window)
        if key not in self._built:
            slot = mx.arange(capacity)[None, :]
            query = self.positions[:, None]
            mask = slot <= query
            if window is not None:
                mask = mask & (slot > query - window)
            self._built[key] = mask[:, None, None, :]
        return self._built[key]

    def ring(self, capacity: int, ring: int, window: int) -> mx.array:
        key = ("ring", capacity, ring, window)
        if key not in self._built:
            query = self.positions[:, None]
            held = query - ((query - mx.arange(capacity)[None, :]) % ring)  # the position in each slot
            self._built[key] = ((held >= 0) & (held > query - window))[:, None, None, :]
        return self._built[key]


class _TracedAttention:
    """A full-attention or sliding-window layer's cache inside the compiled step."""

    def __init__(self, keys: mx.array, values: mx.array, masks: _Masks, ring: int | None, window: int | None):
        self.keys, self.values, self._masks = keys, values, masks
        self._ring, self._window = ring, window

    @property
    def offset(self) -> mx.array:
        return self._masks.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        positions = self._masks.positions
        slots = positions if self._ring is None else positions % self._ring
        self.keys = _scatter_one(self.keys, keys, slots)
        self.values = _scatter_one(self.values, values, slots)
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        rows = self._masks.positions.shape[0]
        return self.keys[:rows], self.values[:rows]

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array | None:
        return decode_attention(queries, keys, values, scale, mask)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        capacity = self.keys.shape[2]
        if self._ring is None:
            return self._masks.full(capacity, window_size)
        assert self._window is not None
        return self._masks.ring(capacity, self._ring, window_size or self._window)


class _TracedPaged:
    """A paged layer's pools inside the compiled step (`engine.kv.paged.PagedSlots`' decode
    step, traced)."""

    def __init__(self, keys: mx.array, values: mx.array, masks: _Masks, block_size: int):
        self.keys, self.values, self._masks = keys, values, masks
        self._block_size = block_size
        self._fetched: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> mx.array:
        return self._masks.positions

    @property
    def _width(self) -> int:
        masks = self._masks
        return masks.blocks.shape[0] // masks.positions.shape[0] * self._block_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        writes = self._masks.paged_writes(self._block_size)
        if keys.shape[0] == 1:  # a lone row: a slice update (0.40 vs 0.53 ms a step on `tiny`)
            # (The row by a reshape, a view: `keys[0]` is a gather and a squeeze, two more nodes.)
            self.keys = mx.slice_update(self.keys, keys.reshape(keys.shape[1:]), writes, (1,))
            self.values = mx.slice_update(self.values, values.reshape(values.shape[1:]), writes, (1,))
        else:
            index = flat_index(writes, *self.keys.shape[:2])
            self.keys = scatter_flat(self.keys, heads_first(keys), index)
            self.values = scatter_flat(self.values, heads_first(values), index)
        self._fetched = None
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The rows' positions as a gathered batch (unused, so never computed, where the
        kernel attends in place)."""
        if self._fetched is None:
            rows, blocks, width = self._masks.positions.shape[0], self._masks.blocks, self._width
            self._fetched = (gather_blocks(self.keys, blocks, rows, width, self._block_size), gather_blocks(self.values, blocks, rows, width, self._block_size))
        return self._fetched

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array | None:
        """mlxrt's paged attention over each row's own positions where it applies (the keys
        and mask this layer gave), else `decode_attention` over the gathered batch."""
        own = self._fetched is not None and keys is self._fetched[0] and values is self._fetched[1]
        if own and queries.shape[2] == 1 and mask is self.make_mask(1):
            module = lanes.kernels(queries, self.keys, self.values)
            kv_heads = self.keys.shape[0]
            if module is not None and stacked_mask(queries, kv_heads, None) is not DECLINED:
                out = module.paged_attention(
                    stack_queries(queries, kv_heads, scale), self.keys, self.values, self._masks.blocks,
                    width=self._width, block_size=self._block_size, lengths=self._masks.lengths(),
                )  # fmt: skip
                return out.reshape(*queries.shape[:2], 1, -1)
        return decode_attention(queries, keys, values, scale, mask)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self._masks.full(self._width, window_size)

    def _fusable(self, attention: llama.Attention | qwen2.Attention, x: mx.array, mask) -> tuple[Any, dict[str, Any]] | None:
        """mlxrt's kernels and the attention's rotation where `fused` applies: one token a row,
        this layer's own mask, mlxrt's RoPE, grouped heads; else None."""
        rope, heads, kv_heads = attention.rope, attention.n_heads, int(attention.n_kv_heads or 0)
        if x.shape[1] != 1 or mask is not self.make_mask(1) or not isinstance(rope, lanes.KernelRoPE) or rope.base is None:
            return None
        module = lanes.kernels(x, self.keys, self.values)
        if module is None or not kv_heads or kv_heads == heads or heads % kv_heads:
            return None
        return module, {"rope_dims": rope.dims, "traditional": rope.traditional, "base": rope.base, "rope_scale": rope.scale}

    def fused(self, attention: llama.Attention | qwen2.Attention, x: mx.array, mask) -> mx.array | None:
        """mlx-lm's llama (or qwen2: the same operations) attention of one token a row, after its
        projections, as three of mlxrt's primitives (`pool_write` for the keys and the values,
        `decode_attention`) in place of ~18 nodes (reshapes, transposes, RoPEs, scaling, slice
        updates, the paged attention: a node's cost to build and run is most of a small one's),
        the same bits; None where `attend` would not take the paged kernel or the RoPE is not
        mlxrt's (`_fusable`)."""
        found = self._fusable(attention, x, mask)
        if found is None:
            return None
        module, rotation = found
        masks = self._masks
        positions, writes = masks.positions, masks.paged_writes(self._block_size)
        self.keys = module.pool_write(self.keys, attention.k_proj(x), positions, writes, **rotation)
        self.values = module.pool_write(self.values, attention.v_proj(x), positions, writes)
        out = module.decode_attention(
            attention.q_proj(x), self.keys, self.values, masks.blocks, positions, masks.lengths(), heads=attention.n_heads, scale=attention.scale,
            width=self._width, block_size=self._block_size, **rotation,
        )  # fmt: skip
        self._fetched = None
        return attention.o_proj(out)

    def fused_layer(self, block: nn.Module, attention: llama.Attention | qwen2.Attention, x: mx.array, mask) -> mx.array | None:
        """A llama decoder layer of one token a row (`x + attention(norm(x))`, then `h +
        mlp(norm(h))`) as four of mlxrt's primitives where `fused` applies and every product is
        mlxrt's quantized kernel's (`_layer_products`): the normed queries, keys and values
        (`normed_products`), the keys' and the values' `pool_write`, and the rest (`layer_tail`:
        attention, output product, residual, norm, SwiGLU MLP, residual), in place of sixteen
        nodes, the same kernels on the same values: the same bits. None otherwise."""
        found = self._fusable(attention, x, mask)
        products = _layer_products(block, attention)
        if found is None or products is None:
            return None
        module, rotation = found
        masks = self._masks
        positions, writes = masks.positions, masks.paged_writes(self._block_size)
        first, second = block.input_layernorm, block.post_attention_layernorm
        queries, keys, values = module.normed_products(x, first["weight"], first.eps, products[:3])
        self.keys = module.pool_write(self.keys, keys, positions, writes, **rotation)
        self.values = module.pool_write(self.values, values, positions, writes)
        self._fetched = None
        return module.layer_tail(
            x, queries, self.keys, self.values, masks.blocks, positions, masks.lengths(), second["weight"], products[3:], heads=attention.n_heads,
            scale=attention.scale, width=self._width, block_size=self._block_size, eps=second.eps, **rotation,
        )  # fmt: skip


def _product(layer: nn.Module) -> tuple | None:
    """A linear layer's operands for mlxrt's fused primitives where its step's product is
    mlxrt's quantized kernel's (`lanes.KernelQuantizedLinear`, float32 scales), else None."""
    if type(layer) is not lanes.KernelQuantizedLinear or not kernel_serves(layer):
        return None
    bias = layer.get("bias")
    if any(a is not None and a.dtype != mx.float32 for a in (layer["scales"], layer["biases"], bias)):
        return None
    return (layer["weight"], layer["scales"], layer["biases"], bias, layer.group_size, layer.bits, getattr(layer, lanes.BIAS_RATIO, 0.0))


def _layer_products(block: nn.Module, attention: llama.Attention | qwen2.Attention) -> list[tuple] | None:
    """The layer's seven products (queries, keys, values, output, gate, up, down) where the
    whole layer's step is mlxrt's kernels (`_product`, `lanes.KernelRMSNorm`, mlx-lm's
    `swiglu` rebound to `lanes.swiglu`), else None."""
    mlp = block.mlp
    if type(mlp) not in FUSED_MLP or getattr(sys.modules[type(mlp).__module__], "swiglu", None) is not lanes.swiglu:
        return None
    norms = (block.input_layernorm, block.post_attention_layernorm)
    if any(type(norm) is not lanes.KernelRMSNorm or norm["weight"].dtype != mx.float32 for norm in norms):
        return None
    layers = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    products = [_product(layer) for layer in layers]
    return None if any(p is None for p in products) else cast(list[tuple], products)


# mlx-lm's attention classes whose `__call__` is llama's, operation for operation (mistral is llama),
# and the decoder layers and MLPs likewise.
FUSED_ATTENTION = (llama.Attention, qwen2.Attention)
FUSED_LAYERS = (llama.TransformerBlock, qwen2.TransformerBlock)
FUSED_MLP = (llama.MLP, qwen2.MLP)


class _FusedAttention(nn.Module):
    """A llama layer's attention while the step is traced: `_TracedPaged.fused` where it
    applies, else the layer's own."""

    def __init__(self, attention: llama.Attention | qwen2.Attention):
        super().__init__()
        self.attention = attention

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        out = cache.fused(self.attention, x, mask) if isinstance(cache, _TracedPaged) else None
        return self.attention(x, mask, cache) if out is None else out


def _fused_block(kind: type) -> type:
    """`kind` (a llama decoder layer's class) whose call while the step is traced is
    `_TracedPaged.fused_layer` where that applies, else its own (its attention a
    `_FusedAttention`)."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        attention = self.self_attn
        out = None
        if isinstance(cache, _TracedPaged) and isinstance(attention, _FusedAttention):
            out = cache.fused_layer(self, attention.attention, x, mask)
        return kind.__call__(self, x, mask, cache) if out is None else out

    return type(f"Fused{kind.__name__}", (kind,), {"__call__": __call__})


# (A layer's class is swapped, not its place in the model's list: some models' `layers` is a new list.)
_FUSED_BLOCKS = {kind: _fused_block(kind) for kind in FUSED_LAYERS}


@contextlib.contextmanager
def _fused_attention(model, caches: list) -> Iterator[None]:
    """The model's llama-style attention layers (`FUSED_ATTENTION`) over paged KV as
    `_FusedAttention`, and their layers (`FUSED_LAYERS`) of `_FUSED_BLOCKS`' classes, while
    inside (the step's trace: its modules are the model's own again after)."""
    layers = getattr(model, "layers", None)
    swapped = []
    if isinstance(layers, list) and len(layers) == len(caches):
        for layer, cache in zip(layers, caches):
            attention = getattr(layer, "self_attn", None)
            if type(attention) in FUSED_ATTENTION and isinstance(cache, _TracedPaged):  # (not a subclass: its own call)
                layer.self_attn = _FusedAttention(cast(llama.Attention, attention))
                swapped.append((layer, attention, type(layer)))
                layer.__class__ = _FUSED_BLOCKS.get(type(layer), type(layer))
    try:
        yield
    finally:
        for layer, attention, kind in swapped:
            layer.__class__ = kind
            layer.self_attn = attention


class _TracedState(ArraysCache):
    """A recurrent layer's state inside the compiled step (no padding: no lengths, no mask)."""

    def __init__(self, arrays: list[mx.array | None]):  # no super().__init__: the state is given
        self.cache = arrays  # type: ignore[assignment]  # mlx-lm annotates it by its initial value
        self.left_padding = None
        self.lengths = None


def _trace(layer: LayerLayout, buffers: Iterator[mx.array], masks: _Masks) -> Any:
    match layer.kind:
        case "full" if layer.kv_block:
            return _TracedPaged(next(buffers), next(buffers), masks, layer.kv_block)
        case "full":
            return _TracedAttention(next(buffers), next(buffers), masks, None, None)
        case "window":
            return _TracedAttention(next(buffers), next(buffers), masks, ring_capacity(layer), layer.window)
        case "state":
            return _TracedState([next(buffers) if array.dtype else None for array in layer.states])
        case _:
            return CacheList(*(_trace(part, buffers, masks) for part in layer.parts))


def _outputs(layer: LayerLayout, cache: Any) -> list[mx.array]:
    match layer.kind:
        case "full" | "window":
            return [cache.keys, cache.values]  # (a paged layer's: its pools)
        case "state":
            arrays = []
            for spec, array in zip(layer.states, cache.cache):
                if bool(spec.dtype) != (array is not None):
                    raise RuntimeError("a recurrent layer set a state array its probe did not")
                if array is not None:
                    arrays.append(array)
            return arrays
        case _:
            return [array for part, child in zip(layer.parts, cache.caches) for array in _outputs(part, child)]


def compile_decode_step(model, layout: Sequence[LayerLayout]):
    """`step(tokens, positions, blocks, *buffers) -> (logits, *buffers)`, compiled: every row
    forwards one token at its position; `blocks` are the rows' block ids for paged layers (the
    same number per row; anything without them); `buffers` are each layer's arrays in layout
    order."""

    def step(tokens: mx.array, positions: mx.array, blocks: mx.array, *buffers: mx.array):
        masks, remaining = _Masks(positions, blocks), iter(buffers)
        caches = [_trace(layer, remaining, masks) for layer in layout]
        with lanes.suspended(), _fused_attention(model, caches):  # one traced graph on one stream
            logits = model(tokens[:, None], cache=caches)[:, -1, :]
        return (logits, *(array for layer, cache in zip(layout, caches) for array in _outputs(layer, cache)))

    return mx.compile(step)
