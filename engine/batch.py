"""The decode batch's KV: one right-padded slot per running request.

Row `r` holds `lengths[r]` valid positions `[0, lengths[r])` of every layer in
preallocated buffers `[rows, kv_heads, capacity, head_dim]`. Each row writes at
its own position, so rows join and leave without touching the others' KV
(joining copies one row in, leaving moves the last row into the hole), unlike a
left-padded batch cache that re-pads every row on each join.

mlx-lm's attention layers call `update_and_fetch`, read `offset` for RoPE and ask
`make_mask`; `SlotLayer` answers them from the batch's per-step geometry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

LEN_STEP = 256


@dataclass(frozen=True)
class LayerGeometry:
    """Shape of one layer's per-token KV, probed from the model at load."""

    num_heads: int
    key_dim: int
    value_dim: int
    dtype: mx.Dtype

    @property
    def bytes_per_token(self) -> int:
        return self.num_heads * (self.key_dim + self.value_dim) * self.dtype.size


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class SlotLayer:
    """The cache object one attention layer sees during a batched forward."""

    def __init__(self, batch: DecodeBatch, index: int):
        self._batch = batch
        self._index = index

    @property
    def offset(self) -> mx.array:
        positions = self._batch.positions
        assert positions is not None, "a forward outside begin_step/end_step"
        return positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._batch.write(self._index, keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported in the decode batch")
        return self._batch.mask


class _TracedSlot:
    """A layer's cache inside the compiled one-token step (see `compile_decode_step`)."""

    def __init__(self, keys: list[mx.array], values: list[mx.array], index: int, positions: mx.array, mask: mx.array):
        self._keys, self._values, self._index = keys, values, index
        self._positions, self._mask = positions, mask

    @property
    def offset(self) -> mx.array:
        return self._positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        i, rows = self._index, keys.shape[0]
        self._keys[i] = _scatter(self._keys[i], keys, self._positions)
        self._values[i] = _scatter(self._values[i], values, self._positions)
        return self._keys[i][:rows], self._values[i][:rows]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported in the decode batch")
        return self._mask


def _scatter(buffer: mx.array, new: mx.array, positions: mx.array) -> mx.array:
    """`new` ([rows, heads, 1, dim]) written at each row's position of `buffer`."""
    capacity_rows, heads, capacity, dim = buffer.shape
    rows = new.shape[0]
    index = ((mx.arange(rows)[:, None] * heads + mx.arange(heads)[None, :]) * capacity + positions[:, None]).reshape(-1)
    flat = buffer.reshape(capacity_rows * heads * capacity, dim)
    flat[index] = new.reshape(rows * heads, dim)
    return flat.reshape(capacity_rows, heads, capacity, dim)


def compile_decode_step(model, num_layers: int):
    """The batch's one-token step as one compiled function of fixed-shape inputs.

    Each row writes at its own position in the whole buffers and attends over their full
    capacity under a mask, so the shapes change only when rows join or leave or the capacity
    grows; MLX then traces the step once per such geometry instead of building the model's
    graph op by op on every step (a few ms of Python per step, which the CPU backend cannot
    overlap with compute).
    """

    def step(tokens: mx.array, positions: mx.array, *buffers: mx.array):
        keys, values = list(buffers[:num_layers]), list(buffers[num_layers:])
        capacity = keys[0].shape[2]
        mask = (mx.arange(capacity)[None, :] <= positions[:, None])[:, None, None, :]
        layers = [_TracedSlot(keys, values, i, positions, mask) for i in range(num_layers)]
        logits = model(tokens[:, None], cache=layers)[:, -1, :]
        return (logits, *keys, *values)

    return mx.compile(step)


class DecodeBatch:
    """Row-major KV slots for the requests being decoded together.

    Owns the buffers; callers own the mapping of rows to requests through
    `row_ids`. `begin_step` must precede a forward and `end_step` follow it.
    """

    def __init__(self, geometry: Sequence[LayerGeometry]):
        self.geometry = list(geometry)
        self.num_layers = num_layers = len(self.geometry)
        self.row_ids: list[str] = []
        self.lengths: list[int] = []
        # Per-layer buffers; empty until the first row joins (and again once the last leaves).
        self._keys: list[mx.array] = []
        self._values: list[mx.array] = []
        self._layers = [SlotLayer(self, i) for i in range(num_layers)]
        # Per-step geometry, set by begin_step.
        self.positions: mx.array | None = None
        self.mask: mx.array | None = None
        self._write_index: mx.array | None = None
        self._uniform_start: int | None = None
        self._counts: list[int] = []
        self._rows: list[int] | None = None
        self._row_index: mx.array | None = None
        self._num_new = 0
        self._width = 0

    def __len__(self) -> int:
        return len(self.row_ids)

    @property
    def layers(self) -> list[SlotLayer]:
        return self._layers

    @property
    def capacity(self) -> tuple[int, int]:
        if not self._keys:
            return 0, 0
        rows, _, length, _ = self._keys[0].shape
        return rows, length

    @property
    def nbytes(self) -> int:
        if not self._keys:
            return 0
        return sum(k.nbytes + v.nbytes for k, v in zip(self._keys, self._values))

    def index(self, request_id: str) -> int:
        return self.row_ids.index(request_id)

    def add_row(self, request_id: str, caches: Sequence, length: int) -> None:
        """Copy the first `length` positions of per-layer `KVCache`s into a new last row."""
        if not self._keys:
            self._allocate()
        row = len(self.row_ids)
        self._reserve(row + 1, length + 1)
        for layer, cache in enumerate(caches):
            if length:
                self._keys[layer][row : row + 1, :, :length] = cache.keys[..., :length, :]
                self._values[layer][row : row + 1, :, :length] = cache.values[..., :length, :]
        self.row_ids.append(request_id)
        self.lengths.append(length)

    def extract(self, request_id: str) -> list[KVCache]:
        """A contiguous copy of one row's KV as per-layer `KVCache`s, evaluated now: a lazy
        copy would keep the batch buffers referenced, and every later write would then copy
        whole buffers instead of updating them in place."""
        row = self.index(request_id)
        length = self.lengths[row]
        caches = []
        for keys, values in zip(self._keys, self._values):
            cache = KVCache()
            cache.keys = mx.contiguous(keys[row : row + 1, :, :length])
            cache.values = mx.contiguous(values[row : row + 1, :, :length])
            cache.offset = length
            caches.append(cache)
        mx.eval([c.state for c in caches])
        return caches

    def remove_row(self, request_id: str) -> list[int]:
        """Drop a row; returns, for each remaining row, the row it used to be."""
        row = self.index(request_id)
        last = len(self.row_ids) - 1
        order = list(range(last))
        if row != last:
            for layer in range(self.num_layers):
                self._keys[layer][row : row + 1] = self._keys[layer][last : last + 1]
                self._values[layer][row : row + 1] = self._values[layer][last : last + 1]
            self.row_ids[row] = self.row_ids[last]
            self.lengths[row] = self.lengths[last]
            order[row] = last
        self.row_ids.pop()
        self.lengths.pop()
        if not self.row_ids:
            self._keys, self._values = [], []
        else:
            self._maybe_shrink()
        return order

    def _maybe_shrink(self) -> None:
        """Give memory back once the batch uses under a quarter of its rows or positions."""
        rows, capacity = self.capacity
        need_rows = _next_power_of_two(len(self.row_ids))
        need_len = _round_up(max(self.lengths) + 1, LEN_STEP)
        if need_rows * 4 > rows and need_len * 4 > capacity:
            return
        new_rows, new_capacity = min(rows, need_rows * 2), min(capacity, need_len * 2)
        self._keys = [mx.contiguous(k[:new_rows, :, :new_capacity]) for k in self._keys]
        self._values = [mx.contiguous(v[:new_rows, :, :new_capacity]) for v in self._values]

    def begin_step(self, counts: list[int], rows: list[int] | None = None) -> None:
        """Prepare positions, mask and write indices for `counts[i]` new tokens in row `rows[i]`
        (every row in order when `rows` is None).

        Every forwarded row takes max(counts) positions; a row's extra positions are padding
        whose KV lands past its length, is never attended to, and is overwritten later.
        A step over some rows reads a gathered copy of their KV: it is for the few rows
        that append several known tokens, while the whole batch decodes one token each.
        """
        all_lengths = self.lengths
        self._rows, self._row_index = rows, None
        lengths = all_lengths if rows is None else [all_lengths[r] for r in rows]
        num_new = max(counts)
        self._counts = counts
        self._reserve(len(all_lengths), max(lengths) + num_new)
        _, num_heads, capacity, _ = self._keys[0].shape
        self._num_new = num_new
        self._width = max(lengths) + num_new
        starts = mx.array(lengths, dtype=mx.int32)
        self.positions = starts
        steps = mx.arange(num_new, dtype=mx.int32)
        # The whole batch at one position takes a plain slice write (one op per layer, as in
        # mlx-lm's KVCache); otherwise a scatter at per-row positions.
        self._uniform_start = lengths[0] if rows is None and min(lengths) == max(lengths) else None
        if self._uniform_start is None:
            index = mx.arange(len(lengths), dtype=mx.int32) if rows is None else mx.array(rows, dtype=mx.int32)
            self._row_index = None if rows is None else index
            index = index[:, None, None]
            heads = mx.arange(num_heads, dtype=mx.int32)[None, :, None]
            self._write_index = ((index * num_heads + heads) * capacity + (starts[:, None] + steps[None, :])[:, None, :]).reshape(-1)
        if num_new == 1 and self._uniform_start is not None:
            self.mask = None
        else:
            key_pos = mx.arange(self._width, dtype=mx.int32)[None, None, :]
            query_pos = starts[:, None, None] + steps[None, :, None]
            self.mask = (key_pos <= query_pos)[:, None]

    def end_step(self) -> None:
        if self._rows is None:
            self.lengths = [n + c for n, c in zip(self.lengths, self._counts)]
        else:
            for row, count in zip(self._rows, self._counts):
                self.lengths[row] += count
        self.positions = self.mask = self._write_index = self._row_index = None
        self._rows = None

    def forward_one(self, step, tokens: mx.array) -> mx.array:
        """Every row forwards one token through `step` (from `compile_decode_step`); returns
        the `[rows, vocab]` logits."""
        lengths = self.lengths
        self._reserve(len(lengths), max(lengths) + 1)
        outputs = step(tokens, mx.array(lengths, dtype=mx.int32), *self._keys, *self._values)
        self._keys = list(outputs[1 : 1 + self.num_layers])
        self._values = list(outputs[1 + self.num_layers :])
        self.lengths = [n + 1 for n in lengths]
        return outputs[0]

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Forget a row's last `num_tokens` positions (a rejected verify tail): they are
        never attended to again and the next write overwrites them."""
        row = self.index(request_id)
        if not 0 <= num_tokens <= self.lengths[row]:
            raise ValueError(f"cannot rewind {num_tokens} of {self.lengths[row]} positions")
        self.lengths[row] -= num_tokens

    def write(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        num_rows, width = len(self.row_ids), self._width
        self._keys[layer] = self._write(self._keys[layer], keys)
        self._values[layer] = self._write(self._values[layer], values)
        if self._row_index is not None:
            return self._keys[layer][self._row_index, :, :width], self._values[layer][self._row_index, :, :width]
        return self._keys[layer][:num_rows, :, :width], self._values[layer][:num_rows, :, :width]

    def _write(self, buffer: mx.array, new: mx.array) -> mx.array:
        start = self._uniform_start
        if start is not None:
            buffer[: new.shape[0], :, start : start + self._num_new] = new
            return buffer
        rows, heads, capacity, dim = buffer.shape
        flat = buffer.reshape(rows * heads * capacity, dim)
        flat[self._write_index] = new.reshape(-1, dim)
        return flat.reshape(rows, heads, capacity, dim)

    def _allocate(self) -> None:
        self._keys = [mx.zeros((1, g.num_heads, LEN_STEP, g.key_dim), g.dtype) for g in self.geometry]
        self._values = [mx.zeros((1, g.num_heads, LEN_STEP, g.value_dim), g.dtype) for g in self.geometry]

    def _reserve(self, num_rows: int, length: int) -> None:
        rows, capacity = self.capacity
        if num_rows <= rows and length <= capacity:
            return
        new_rows, new_capacity = max(rows, _next_power_of_two(num_rows)), max(capacity, _round_up(length, LEN_STEP))
        for layer in range(self.num_layers):
            self._keys[layer] = _grow(self._keys[layer], new_rows, new_capacity)
            self._values[layer] = _grow(self._values[layer], new_rows, new_capacity)


def _grow(buffer: mx.array, rows: int, capacity: int) -> mx.array:
    old_rows, heads, old_capacity, dim = buffer.shape
    grown = mx.zeros((rows, heads, capacity, dim), buffer.dtype)
    grown[:old_rows, :, :old_capacity] = buffer
    return grown
