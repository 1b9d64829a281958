"""Quantized KV for full-attention layers (`kv.bits`): in the decode batch and outside it.

A quantized layer (`LayerLayout.kv_bits`) stores every position's keys and values as MLX's
affine quantization along the head dim (`mx.quantize`: packed uint32 words, a scale and a
bias per `kv_group_size` elements, exactly mlx-lm's `QuantizedKVCache` format), written
once, when the position is forwarded. Positions below `kv_start` are also kept in full
precision, and attention reads those instead. So a position's stored form depends only on
its own keys and values and its index: a row never converts, prefix entries and checkpoints
hold the same arrays the batch does, and a resumed or prefix-seeded request sees exactly
what an uninterrupted one saw. (Quantization is not idempotent in MLX, so re-quantizing
dequantized values would not be.)

Attention: with `kv_start = 0` the packed arrays go to mlx-lm's quantized SDPA (the layers
choose it for a cache with `bits`, as for `QuantizedKVCache`), the rows' masks included;
with a float head, each row's positions are read as one float array (the head, then the rest
dequantized: `mx.dequantize` is bitwise the same for a slice as for the whole) through the
model's own attention. Measured on the CPU backend, quantized matmul is the faster of the two
(docs/benchmarks/log.md).

- `QuantizedKV`: a request's cache outside the batch (prefill, prefix entries, parked rows,
  checkpoints), answering mlx-lm's layers as a `KVCache` does.
- `QuantizedSlots`: the batch's rows of such a layer (`engine.kv.slots.FullSlots` geometry).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, CacheList, KVCache, make_prompt_cache

from engine.kv.layout import DTYPES
from engine.kv.offsets import OffsetCache
from engine.kv.slots import FullSlots, grow, scatter, write_index
from engine.step import Step, round_up
from policies.layout import leaves, packed_dim
from protocols.model import LayerLayout

Packed = list[mx.array]  # packed words, scales, biases: `[rows, heads, positions, *]`
STEP = 256


def quantize(x: mx.array, layer: LayerLayout) -> Packed:
    return list(mx.quantize(x, group_size=layer.kv_group_size, bits=layer.kv_bits))


def read(packed: Packed, head: mx.array | None, layer: LayerLayout, width: int) -> mx.array:
    """Positions `[0, width)` in full precision: the kept float head below `kv_start`, the
    dequantized packed positions from there on."""
    start = min(layer.kv_start, width)
    parts = [head[:, :, :start]] if start and head is not None else []
    if width > start:
        words, scales, biases = (a[:, :, start:width] for a in packed)
        parts.append(mx.dequantize(words, scales, biases, group_size=layer.kv_group_size, bits=layer.kv_bits))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def attend_quantized(cache: Any, layer: LayerLayout) -> None:
    """Without a float head, attention runs on the packed arrays: mlx-lm's quantized SDPA
    (`quantized_matmul`), which its layers pick for a cache with `bits` and `group_size` and
    which is faster than dequantizing first (docs/benchmarks/log.md, KV memory). With a float head,
    the two parts are read as one float array (`read`) through the model's float attention."""
    if not layer.kv_start:
        cache.bits, cache.group_size = layer.kv_bits, layer.kv_group_size


def quantized_attention(cache: Any) -> bool:
    return hasattr(cache, "bits")


def _zeros(layer: LayerLayout, rows: int, capacity: int, dim: int) -> Packed:
    dtype = DTYPES[layer.dtype]
    groups = dim // layer.kv_group_size
    shape = (rows, layer.heads, capacity)
    return [mx.zeros((*shape, packed_dim(dim, layer.kv_bits)), mx.uint32), mx.zeros((*shape, groups), dtype), mx.zeros((*shape, groups), dtype)]


class QuantizedKV(OffsetCache):
    """One request's quantized layer outside the batch, as mlx-lm's layers use a `KVCache`:
    `update_and_fetch` stores the new positions and returns every position in full precision."""

    def __init__(self, layer: LayerLayout):
        self.layer = layer
        attend_quantized(self, layer)
        self.keys: Packed | None = None
        self.values: Packed | None = None
        self.head_keys: mx.array | None = None  # positions below kv_start, full precision
        self.head_values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        layer, prev = self.layer, self.offset
        end = prev + keys.shape[2]
        if self.keys is None or self.values is None or end > self.keys[0].shape[2]:
            self._grow(keys.shape[0], round_up(end, STEP))
        assert self.keys is not None and self.values is not None
        for stored, new in ((self.keys, quantize(keys, layer)), (self.values, quantize(values, layer))):
            for array, part in zip(stored, new):
                array[:, :, prev:end] = part
        if prev < layer.kv_start:
            if self.head_keys is None or self.head_values is None:
                self.head_keys = mx.zeros((keys.shape[0], layer.heads, layer.kv_start, layer.key_dim), keys.dtype)
                self.head_values = mx.zeros((keys.shape[0], layer.heads, layer.kv_start, layer.value_dim), values.dtype)
            kept = min(end, layer.kv_start)
            self.head_keys[:, :, prev:kept] = keys[:, :, : kept - prev]
            self.head_values[:, :, prev:kept] = values[:, :, : kept - prev]
        self.offset = end
        return self.fetch(end)

    def _grow(self, rows: int, capacity: int) -> None:
        layer, old = self.layer, self.offset
        keys, values = _zeros(layer, rows, capacity, layer.key_dim), _zeros(layer, rows, capacity, layer.value_dim)
        if self.keys is not None and self.values is not None and old:
            for new, stored in zip(keys + values, self.keys + self.values):
                new[:, :, :old] = stored[:, :, :old]
        self.keys, self.values = keys, values

    def fetch(self, width: int) -> tuple[mx.array, mx.array]:
        assert self.keys is not None and self.values is not None
        if quantized_attention(self):
            return tuple(a[:, :, :width] for a in self.keys), tuple(a[:, :, :width] for a in self.values)  # type: ignore[return-value]
        return read(self.keys, self.head_keys, self.layer, width), read(self.values, self.head_values, self.layer, width)

    @property
    def state(self) -> list[mx.array]:
        arrays = (self.keys or []) + (self.values or [])
        return arrays + [a for a in (self.head_keys, self.head_values) if a is not None]

    @state.setter
    def state(self, value) -> None:
        raise AttributeError("a quantized layer's state is set by its writes")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    @property
    def packed_nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys or []) + (self.values or []))

    def empty(self) -> bool:
        return self.keys is None

    def cut(self, length: int, copy: bool) -> QuantizedKV:
        """The first `length` positions (sliced views, or contiguous copies)."""
        out = QuantizedKV(self.layer)
        take = mx.contiguous if copy else (lambda a: a)
        if self.keys is not None and self.values is not None:
            out.keys = [take(a[:, :, :length]) for a in self.keys]
            out.values = [take(a[:, :, :length]) for a in self.values]
        if self.head_keys is not None and self.head_values is not None:
            out.head_keys, out.head_values = take(self.head_keys), take(self.head_values)
        out.offset = length
        return out

    @classmethod
    def from_float(cls, cache: Any, layer: LayerLayout, length: int) -> QuantizedKV:
        """A float `KVCache`'s first `length` positions, quantized (each position alone: the
        same arrays its incremental writes would have made)."""
        out = cls(layer)
        if length and cache is not None and cache.keys is not None:
            out.update_and_fetch(cache.keys[:, :, :length], cache.values[:, :, :length])
        return out


class BatchQuantizedKV(BatchKVCache):
    """First prompt chunks of several requests in one forward, left-padded as mlx-lm's
    `BatchKVCache` (its masks), each position stored quantized as a `QuantizedKV` row would
    store it; `extract` gives each request its own. Without a float head only (`kv_start` 0)."""

    def __init__(self, left_padding: list[int], layer: LayerLayout):
        super().__init__(left_padding)
        assert not layer.kv_start
        self._rows = QuantizedKV(layer)
        attend_quantized(self, layer)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self._rows.update_and_fetch(keys, values)

    @property
    def state(self) -> list[mx.array]:
        return self._rows.state

    @state.setter
    def state(self, value) -> None:
        raise AttributeError("a quantized batch's state is set by its writes")

    def extract(self, idx: int) -> QuantizedKV:
        rows, pad = self._rows, int(self.left_padding[idx].item())  # type: ignore[arg-type]
        assert rows.keys is not None and rows.values is not None
        out = QuantizedKV(rows.layer)
        out.keys = [mx.contiguous(a[idx : idx + 1, :, pad : self._idx]) for a in rows.keys]
        out.values = [mx.contiguous(a[idx : idx + 1, :, pad : self._idx]) for a in rows.values]
        out.offset = self._idx - pad
        return out


def batch_prefill_caches(layout: Sequence[LayerLayout], padding: list[int]) -> list:
    """The caches of a left-padded batched first chunk (`engine.prefill.prefill_together`):
    quantized without a float head, else float (chunks below the head, quantized at extraction)."""
    return [BatchQuantizedKV(padding, layer) if layer.kv_bits and not layer.kv_start else BatchKVCache(padding) for layer in layout]


def new_caches(model, layout: Sequence[LayerLayout]) -> list:
    """The model's prompt cache, each quantized layer's `KVCache` a `QuantizedKV`."""
    return quantized_caches(make_prompt_cache(model), layout)


def quantized_caches(caches: list, layout: Sequence[LayerLayout]) -> list:
    """Float caches of quantized layers (a batched prefill's, which forwards no position at or
    past `kv_start`) as `QuantizedKV`."""
    return [_convert(cache, layer) for cache, layer in zip(caches, layout)]


def _convert(cache: Any, layer: LayerLayout) -> Any:
    if layer.kind == "list":
        return type(cache)(*(_convert(child, part) for child, part in zip(cache.caches, layer.parts)))
    if layer.kind == "full" and layer.kv_bits and type(cache) is KVCache:
        return QuantizedKV.from_float(cache, layer, cache.offset)
    return cache


def packed_nbytes(items: Iterable[Any]) -> int:
    """Bytes of quantized KV (packed words, scales, biases) in caches or batch slots, lists
    of them included; everything else they hold is float."""
    total = 0
    for item in items:
        if isinstance(item, QuantizedKV | QuantizedSlots):
            total += item.packed_nbytes
        elif isinstance(item, CacheList):
            total += packed_nbytes(item.caches)
        elif hasattr(item, "parts"):  # engine.kv.slots.ListSlots
            total += packed_nbytes(item.parts)
    return total


def is_quantized(layout: Sequence[LayerLayout]) -> bool:
    return any(layer.kind == "full" and layer.kv_bits for _, layer in leaves(layout))


def quantized_start(layout: Sequence[LayerLayout]) -> int:
    """Positions kept in full precision (every quantized layer shares `kv.quantized_start`)."""
    return min((layer.kv_start for _, layer in leaves(layout) if layer.kind == "full" and layer.kv_bits), default=0)


class QuantizedSlots(FullSlots):
    """The batch's rows of a quantized layer: `[rows, heads, capacity, *]` packed words,
    scales and biases (position `p` at slot `p`), and with `kv_start` a float head
    `[rows, heads, kv_start + 1, dim]` whose last slot takes the writes of later positions."""

    def __init__(self, batch, layout: LayerLayout):
        super().__init__(batch, layout)
        attend_quantized(self, layout)
        self.packed_keys: Packed | None = None
        self.packed_values: Packed | None = None

    def _arrays(self) -> list[mx.array]:
        packed = (self.packed_keys or []) + (self.packed_values or [])
        return packed + [a for a in (self.keys, self.values) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays())

    @property
    def packed_nbytes(self) -> int:
        return sum(a.nbytes for a in (self.packed_keys or []) + (self.packed_values or []))

    def capacity(self) -> int:
        return 0 if self.packed_keys is None else self.packed_keys[0].shape[2]

    def reserve(self, rows: int, length: int) -> None:
        layer, wanted = self.layout, self.wanted_capacity(length)
        if self.packed_keys is None or self.packed_values is None:
            self.packed_keys = _zeros(layer, rows, wanted, layer.key_dim)
            self.packed_values = _zeros(layer, rows, wanted, layer.value_dim)
        else:
            old_rows, _, old_capacity, _ = self.packed_keys[0].shape
            if rows > old_rows or wanted > old_capacity:
                rows, wanted = max(rows, old_rows), max(wanted, old_capacity)
                self.packed_keys = [grow(a, rows, wanted) for a in self.packed_keys]
                self.packed_values = [grow(a, rows, wanted) for a in self.packed_values]
        if layer.kv_start:
            dtype, head = DTYPES[layer.dtype], layer.kv_start + 1
            if self.keys is None or self.values is None:
                self.keys = mx.zeros((rows, layer.heads, head, layer.key_dim), dtype)
                self.values = mx.zeros((rows, layer.heads, head, layer.value_dim), dtype)
            elif rows > self.keys.shape[0]:
                self.keys, self.values = grow(self.keys, rows, head), grow(self.values, rows, head)

    def shrink(self, rows: int, length: int) -> None:
        if self.packed_keys is None or self.packed_values is None:
            return
        capacity = min(self.capacity(), self.wanted_capacity(length))
        self.packed_keys = [mx.contiguous(a[:rows, :, :capacity]) for a in self.packed_keys]
        self.packed_values = [mx.contiguous(a[:rows, :, :capacity]) for a in self.packed_values]
        if self.keys is not None and self.values is not None:
            self.keys, self.values = mx.contiguous(self.keys[:rows]), mx.contiguous(self.values[:rows])

    def clear(self) -> None:
        self.packed_keys = self.packed_values = self.keys = self.values = None

    def traced_inputs(self, rows: int) -> list[mx.array]:
        raise NotImplementedError("quantized KV layers are not traced: the batch decodes them uncompiled")

    def move_row(self, source: int, target: int) -> None:
        for array in self._arrays():
            array[target : target + 1] = array[source : source + 1]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        step, layer = self._batch.step, self.layout
        assert step is not None and self.packed_keys is not None and self.packed_values is not None
        start, n = step.uniform_start, step.num_new
        new = [(self.packed_keys, quantize(keys, layer)), (self.packed_values, quantize(values, layer))]
        if start is not None:
            rows = keys.shape[0]
            for stored, parts in new:
                for array, part in zip(stored, parts):
                    array[:rows, :, start : start + n] = part
            if start < layer.kv_start and self.keys is not None and self.values is not None:
                kept = min(start + n, layer.kv_start) - start
                self.keys[:rows, :, start : start + kept] = keys[:, :, :kept]
                self.values[:rows, :, start : start + kept] = values[:, :, :kept]
        else:
            self._scatter_rows(step, keys, values, new)
        return self.keys_and_values()

    def _scatter_rows(self, step: Step, keys: mx.array, values: mx.array, new: list[tuple[Packed, Packed]]) -> None:
        layer = self.layout
        assert self.packed_keys is not None
        heads, capacity = layer.heads, self.packed_keys[0].shape[2]
        index = step.derive(("full", heads, capacity), lambda: write_index(step, heads, capacity, self._positions(step)))
        self.packed_keys, self.packed_values = ([scatter(a, part, index) for a, part in zip(stored, parts)] for stored, parts in new)
        if layer.kv_start and self.keys is not None and self.values is not None:
            head = layer.kv_start + 1
            slots = lambda: mx.minimum(self._positions(step), layer.kv_start)  # noqa: E731 (later positions: the spare slot)
            head_index = step.derive(("head", heads, head), lambda: write_index(step, heads, head, slots()))
            self.keys, self.values = scatter(self.keys, keys, head_index), scatter(self.values, values, head_index)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        step, layer = self._batch.step, self.layout
        assert step is not None and self.packed_keys is not None and self.packed_values is not None
        width = step.width

        def rows(arrays: Packed) -> Packed:
            return [step.select(a[:, :, :width]) for a in arrays]

        if quantized_attention(self):
            return tuple(rows(self.packed_keys)), tuple(rows(self.packed_values))  # type: ignore[return-value]
        head_keys = step.select(self.keys) if self.keys is not None else None
        head_values = step.select(self.values) if self.values is not None else None
        return read(rows(self.packed_keys), head_keys, layer, width), read(rows(self.packed_values), head_values, layer, width)

    def join_row(self, row: int, cache: Any, length: int) -> None:
        assert self.packed_keys is not None and self.packed_values is not None
        if not length or cache is None:
            return
        source = cache if isinstance(cache, QuantizedKV) else QuantizedKV.from_float(cache, self.layout, length)
        assert source.keys is not None and source.values is not None
        for stored, parts in ((self.packed_keys, source.keys), (self.packed_values, source.values)):
            for array, part in zip(stored, parts):
                array[row : row + 1, :, :length] = part[:, :, :length]
        kept = min(length, self.layout.kv_start)
        if kept and self.keys is not None and self.values is not None:
            assert source.head_keys is not None and source.head_values is not None
            self.keys[row : row + 1, :, :kept] = source.head_keys[:, :, :kept]
            self.values[row : row + 1, :, :kept] = source.head_values[:, :, :kept]

    def extract_row(self, row: int, length: int) -> QuantizedKV:  # type: ignore[override]
        assert self.packed_keys is not None and self.packed_values is not None
        cache = QuantizedKV(self.layout)
        cache.keys = [mx.contiguous(a[row : row + 1, :, :length]) for a in self.packed_keys]
        cache.values = [mx.contiguous(a[row : row + 1, :, :length]) for a in self.packed_values]
        if self.keys is not None and self.values is not None:
            cache.head_keys = mx.contiguous(self.keys[row : row + 1, :, : self.layout.kv_start])
            cache.head_values = mx.contiguous(self.values[row : row + 1, :, : self.layout.kv_start])
        cache.offset = length
        return cache
