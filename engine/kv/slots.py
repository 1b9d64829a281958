"""The decode batch's per-layer storage, one slot kind per layer kind.

Every running request owns a row; each layer keeps that row's share in the layout its kind
needs, and answers the calls mlx-lm's layers make on their caches during a forward:

- `FullSlots` (full attention, mlx-lm `KVCache`): right-padded rows `[rows, heads, capacity,
  dim]`, each row writing at its own position; a row's keys are its first `length` positions.
- `WindowSlots` (sliding windows, `RotatingKVCache`): a ring per row of `window + RING_MARGIN`
  positions, position `p` at slot `p % capacity`; masks select each query's window, so the
  keys attended are exactly mlx-lm's, and a row's bytes are bounded by its window.
- `StateSlots` (recurrent and convolution state, `ArraysCache`): one state per row. A forward
  over some rows with different token counts is right-padded and passes mlx-lm's own
  `lengths`, which the recurrent layers honour, so padding never enters a state.
- `ListSlots` (`CacheList`): several of the above in one layer.
(Quantized or paged full layers build on `FullSlots`: `engine.kv.quantized`, `engine.kv.paged`,
sharing its buffer helpers `write_index`, `scatter` and `grow`; which kind a layer gets is
`engine.kv.factory.make_slots`.) The batch (`engine.batch.DecodeBatch`) owns the rows and each
step's geometry (`engine.step`); slots own their buffers, and convert a row to and from
mlx-lm's cache of its kind (`join`, `extract`) for prefill, prefixes and checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from engine.kv.attention import decode_attention
from engine.kv.layout import DTYPES
from engine.step import LEN_STEP, Step, round_up
from policies.layout import ring_capacity
from protocols.model import LayerLayout


def write_index(step: Step, heads: int, capacity: int, slots: mx.array) -> mx.array:
    """Flat `[rows * heads * capacity]` indices of each forwarded row's new positions, where
    `slots` (`[forwarded, num_new]`) says the slot of each new position."""
    index = mx.arange(len(step.starts), dtype=mx.int32) if step.row_index is None else step.row_index
    index = index[:, None, None]
    head = mx.arange(heads, dtype=mx.int32)[None, :, None]
    return ((index * heads + head) * capacity + slots[:, None, :]).reshape(-1)


def scatter(buffer: mx.array, new: mx.array, index: mx.array) -> mx.array:
    rows, heads, capacity, dim = buffer.shape
    flat = buffer.reshape(rows * heads * capacity, dim)
    flat[index] = new.reshape(-1, dim)
    return flat.reshape(rows, heads, capacity, dim)


def grow(buffer: mx.array, rows: int, capacity: int) -> mx.array:
    old_rows, heads, old_capacity, dim = buffer.shape
    grown = mx.zeros((rows, heads, capacity, dim), buffer.dtype)
    grown[:old_rows, :, :old_capacity] = buffer
    return grown


class _AttentionSlots:
    """Keys and values per row; subclasses decide where positions go."""

    def __init__(self, batch, layout: LayerLayout):
        self._batch = batch
        self.layout = layout
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        step = self._batch.step
        assert step is not None, "a forward outside begin_step/end_step"
        return step.positions

    @property
    def position_shifts(self) -> mx.array | None:
        """What each forwarded row's rotary positions add to `offset` (`Step.shifts`)."""
        step = self._batch.step
        assert step is not None, "a forward outside begin_step/end_step"
        return step.shifts

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None or self.values is None else self.keys.nbytes + self.values.nbytes

    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve(self, rows: int, length: int) -> None:
        layout, wanted = self.layout, self.wanted_capacity(length)
        if self.keys is None or self.values is None:
            dtype = DTYPES[layout.dtype]
            self.keys = mx.zeros((rows, layout.heads, wanted, layout.key_dim), dtype)
            self.values = mx.zeros((rows, layout.heads, wanted, layout.value_dim), dtype)
            return
        old_rows, _, old_capacity, _ = self.keys.shape
        if rows > old_rows or wanted > old_capacity:
            rows, wanted = max(rows, old_rows), max(wanted, old_capacity)
            self.keys, self.values = grow(self.keys, rows, wanted), grow(self.values, rows, wanted)

    def shrink(self, rows: int, length: int) -> None:
        if self.keys is None or self.values is None:
            return
        capacity = min(self.keys.shape[2], self.wanted_capacity(length))
        self.keys = mx.contiguous(self.keys[:rows, :, :capacity])
        self.values = mx.contiguous(self.values[:rows, :, :capacity])

    def clear(self) -> None:
        self.keys = self.values = None

    def traced_inputs(self, rows: int) -> list[mx.array]:
        """This layer's arrays for the compiled step (`engine.compiled`)."""
        assert self.keys is not None and self.values is not None
        return [self.keys, self.values]

    def take_traced(self, outputs: Iterator[mx.array], rows: int) -> None:
        self.keys, self.values = next(outputs), next(outputs)

    def move_row(self, source: int, target: int) -> None:
        assert self.keys is not None and self.values is not None
        self.keys[target : target + 1] = self.keys[source : source + 1]
        self.values[target : target + 1] = self.values[source : source + 1]

    def wanted_capacity(self, length: int) -> int:
        raise NotImplementedError

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array | None:
        """A decode step's attention with grouped heads stacked (`engine.kv.attention`)."""
        return decode_attention(queries, keys, values, scale, mask)


class FullSlots(_AttentionSlots):
    def wanted_capacity(self, length: int) -> int:
        return round_up(max(length, 1), LEN_STEP)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        step = self._batch.step
        assert self.keys is not None and self.values is not None and step is not None
        start, n = step.uniform_start, step.num_new
        if start is not None:
            self.keys[: keys.shape[0], :, start : start + n] = keys
            self.values[: values.shape[0], :, start : start + n] = values
        elif step.rows is None and keys.shape[0] == self.keys.shape[0]:
            # Every row of the buffers, each at its own positions: written along the position
            # axis (on the CPU 2-3x cheaper than the flat scatter below, which indexes every
            # head and element: 60 writes of 16 rows, 5.6 against 3.1 ms).
            slots = step.derive(("full-along",), lambda: self._positions(step)[:, None, :, None])
            self.keys = mx.put_along_axis(self.keys, slots, keys, axis=2)
            self.values = mx.put_along_axis(self.values, slots, values, axis=2)
        else:
            heads, capacity = self.keys.shape[1], self.keys.shape[2]
            index = step.derive(("full", heads, capacity), lambda: write_index(step, heads, capacity, self._positions(step)))
            self.keys = scatter(self.keys, keys, index)
            self.values = scatter(self.values, values, index)
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What the last `update_and_fetch` returned (layers that share another's KV read it)."""
        step = self._batch.step
        assert self.keys is not None and self.values is not None and step is not None
        width = step.width
        return step.select(self.keys)[:, :, :width], step.select(self.values)[:, :, :width]

    @staticmethod
    def _positions(step: Step) -> mx.array:
        return mx.array(step.starts, dtype=mx.int32)[:, None] + mx.arange(step.num_new, dtype=mx.int32)[None, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        step = self._batch.step
        assert step is not None
        if N == 1 and step.uniform_start is not None and window_size is None:
            return None  # every row sees all its positions, and only those exist
        return step.derive(("full-mask", window_size), lambda: _full_mask(step, window_size))

    def join_row(self, row: int, cache: Any, length: int) -> None:
        assert self.keys is not None and self.values is not None
        if length and cache is not None:
            self.keys[row : row + 1, :, :length] = cache.keys[..., :length, :]
            self.values[row : row + 1, :, :length] = cache.values[..., :length, :]

    def extract_row(self, row: int, length: int) -> KVCache:
        assert self.keys is not None and self.values is not None
        cache = KVCache()
        cache.keys = mx.contiguous(self.keys[row : row + 1, :, :length])
        cache.values = mx.contiguous(self.values[row : row + 1, :, :length])
        cache.offset = length
        return cache


def _full_mask(step: Step, window_size: int | None) -> mx.array:
    key_pos = mx.arange(step.width, dtype=mx.int32)[None, None, :]
    query_pos = mx.array(step.starts, dtype=mx.int32)[:, None, None] + mx.arange(step.num_new, dtype=mx.int32)[None, :, None]
    mask = key_pos <= query_pos
    if window_size is not None:
        mask = mask & (key_pos > query_pos - window_size)
    return mask[:, None]


class WindowSlots(_AttentionSlots):
    """A ring per row: position `p` lives at slot `p % ring`, the ring holding the window plus
    the longest append (`RING_MARGIN`), so a forward of several tokens still finds every key
    each of them needs."""

    def __init__(self, batch, layout: LayerLayout):
        super().__init__(batch, layout)
        self.window = layout.window
        self.ring = ring_capacity(layout)

    def wanted_capacity(self, length: int) -> int:
        return min(self.ring, round_up(max(length, 1), LEN_STEP))

    def _slots(self, positions: mx.array) -> mx.array:
        return positions % self.ring

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        step = self._batch.step
        assert self.keys is not None and self.values is not None and step is not None
        heads, capacity = self.keys.shape[1], self.keys.shape[2]
        index = step.derive(("window", self.ring, heads, capacity), lambda: write_index(step, heads, capacity, self._slots(FullSlots._positions(step))))
        self.keys = scatter(self.keys, keys, index)
        self.values = scatter(self.values, values, index)
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What the last `update_and_fetch` returned (layers that share another's KV read it)."""
        step = self._batch.step
        assert self.keys is not None and self.values is not None and step is not None
        fetched = min(self.keys.shape[2], step.width)
        return step.select(self.keys)[:, :, :fetched], step.select(self.values)[:, :, :fetched]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        step = self._batch.step
        assert step is not None and self.keys is not None
        fetched = min(self.keys.shape[2], step.width)
        window = window_size or self.window
        return step.derive(("window-mask", self.ring, fetched, window), lambda: self._mask(step, fetched, window))

    def _mask(self, step: Step, fetched: int, window: int) -> mx.array:
        """Each slot's position (the latest written there), then each query's window of them.
        A padding query looks like its row's last real one, so no query attends to nothing."""
        ends = mx.array([s + c for s, c in zip(step.starts, step.counts)], dtype=mx.int32)[:, None]
        slot = mx.arange(fetched, dtype=mx.int32)[None, :]
        position = ends - 1 - ((ends - 1 - slot) % self.ring)
        query = mx.array(step.starts, dtype=mx.int32)[:, None] + mx.arange(step.num_new, dtype=mx.int32)[None, :]
        query = mx.minimum(query, ends - 1)[:, :, None]
        position = position[:, None, :]
        mask = (position >= 0) & (position <= query) & (position > query - window)
        return mask[:, None]

    def join_row(self, row: int, cache: RotatingKVCache | KVCache | None, length: int) -> None:
        assert self.keys is not None and self.values is not None
        if not length or cache is None:
            return
        keys, values = _temporal(cache)
        kept = min(length, self.window, keys.shape[2])
        index = self._row_slots(row, length, kept)
        self.keys = scatter(self.keys, keys[0, :, keys.shape[2] - kept :], index)
        self.values = scatter(self.values, values[0, :, values.shape[2] - kept :], index)

    def extract_row(self, row: int, length: int) -> RotatingKVCache:
        """mlx-lm's cache for the row: its last `window` positions in temporal order."""
        assert self.keys is not None and self.values is not None
        kept = min(length, self.window)
        cache = RotatingKVCache(max_size=self.window, keep=0)
        if kept:
            index = self._row_slots(row, length, kept)
            heads = self.keys.shape[1]
            cache.keys = mx.contiguous(self.keys.reshape(-1, self.keys.shape[3])[index].reshape(1, heads, kept, -1))
            cache.values = mx.contiguous(self.values.reshape(-1, self.values.shape[3])[index].reshape(1, heads, kept, -1))
        cache.offset, cache._idx = length, kept
        return cache

    def _row_slots(self, row: int, length: int, kept: int) -> mx.array:
        """Flat indices (head-major) of one row's slots holding positions `[length - kept, length)`."""
        assert self.keys is not None
        heads, capacity = self.keys.shape[1], self.keys.shape[2]
        slots = self._slots(mx.arange(length - kept, length, dtype=mx.int32))
        return ((row * heads + mx.arange(heads, dtype=mx.int32)[:, None]) * capacity + slots[None, :]).reshape(-1)


def _temporal(cache: Any) -> tuple[mx.array, mx.array]:
    """A cache's keys and values in position order, ending at its last position."""
    if type(cache) is RotatingKVCache:
        return cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


class StateSlots(ArraysCache):
    """One recurrent state per row. An `ArraysCache` to the layers (some check), answering
    for the forwarded rows; a forward of unequal counts passes them as mlx-lm's `lengths`."""

    def __init__(self, batch, layout: LayerLayout):  # no super().__init__: the state is ours
        self._batch = batch
        self.layout = layout
        self.arrays: list[mx.array | None] = [None] * len(layout.states)
        self.left_padding = None

    @property  # type: ignore[override]
    def cache(self) -> list[mx.array | None]:
        return [self[j] for j in range(len(self.arrays))]

    @cache.setter
    def cache(self, value) -> None:
        raise AttributeError("the batch's state is set per array")

    @property  # type: ignore[override]
    def lengths(self) -> mx.array | None:
        step = self._batch.step
        if step is None or (step.num_new == 1 and step.rows is None):
            return None
        return step.derive("state-lengths", lambda: mx.array(step.counts, dtype=mx.int32))

    @lengths.setter
    def lengths(self, value) -> None:
        pass  # mlx-lm's prepare/finalize: our lengths come from the step

    def __getitem__(self, index: int):
        array, step = self.arrays[index], self._batch.step
        if array is None or step is None:
            return array
        return step.select(array)

    def __setitem__(self, index: int, value) -> None:
        step = self._batch.step
        assert step is not None and self.arrays[index] is not None, "state written outside a step"
        array = self.arrays[index]
        assert array is not None
        if step.row_index is None:
            array[: step.num_rows] = value
        else:
            array[step.row_index] = value

    def advance(self, N: int) -> None:
        pass  # lengths are per step here, never carried over

    def make_mask(self, N: int):
        lengths = self.lengths
        return None if lengths is None else mx.arange(N)[None, :] < lengths[:, None]

    def empty(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)

    def capacity(self) -> int:
        return 0

    def reserve(self, rows: int, length: int) -> None:
        for j, spec in enumerate(self.layout.states):
            if not spec.dtype:
                continue
            array = self.arrays[j]
            if array is None:
                self.arrays[j] = mx.zeros((rows, *spec.shape), DTYPES[spec.dtype])
            elif array.shape[0] < rows:
                grown = mx.zeros((rows, *spec.shape), array.dtype)
                grown[: array.shape[0]] = array
                self.arrays[j] = grown

    def shrink(self, rows: int, length: int) -> None:
        self.arrays = [mx.contiguous(a[:rows]) if a is not None else None for a in self.arrays]

    def traced_inputs(self, rows: int) -> list[mx.array]:
        """The rows' state arrays for the compiled step (`engine.compiled`)."""
        return [a if a.shape[0] == rows else a[:rows] for a in self.arrays if a is not None]

    def take_traced(self, outputs: Iterator[mx.array], rows: int) -> None:
        for j, array in enumerate(self.arrays):
            if array is None:
                continue
            state = next(outputs)
            if array.shape[0] == rows:
                self.arrays[j] = state
            else:
                array[:rows] = state

    def clear(self) -> None:
        self.arrays = [None] * len(self.layout.states)

    def move_row(self, source: int, target: int) -> None:
        for array in self.arrays:
            if array is not None:
                array[target : target + 1] = array[source : source + 1]

    def join_row(self, row: int, cache: ArraysCache | None, length: int) -> None:
        for j, array in enumerate(self.arrays):
            if array is not None:
                state = cache[j] if cache is not None else None
                array[row : row + 1] = state if state is not None else mx.zeros_like(array[row : row + 1])

    def extract_row(self, row: int, length: int) -> ArraysCache:
        cache = ArraysCache(len(self.arrays))
        for j, array in enumerate(self.arrays):
            if array is not None:
                cache[j] = mx.contiguous(array[row : row + 1])
        return cache

    def snapshot_row(self, row: int) -> list[mx.array | None]:
        return [mx.contiguous(a[row : row + 1]) if a is not None else None for a in self.arrays]

    def restore_row(self, row: int, saved: list[mx.array | None]) -> None:
        for array, state in zip(self.arrays, saved):
            if array is not None and state is not None:
                array[row : row + 1] = state


class ListSlots:
    """A layer with several caches (`CacheList`): one slot per part (made by
    `engine.kv.factory.make_slots`, one per part of `layout`)."""

    def __init__(self, layout: LayerLayout, parts: list[Slots]):
        self.layout = layout
        self.parts = parts

    def __getitem__(self, index: int):
        return self.parts[index]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def capacity(self) -> int:
        return max((part.capacity() for part in self.parts), default=0)

    def reserve(self, rows: int, length: int) -> None:
        for part in self.parts:
            part.reserve(rows, length)

    def shrink(self, rows: int, length: int) -> None:
        for part in self.parts:
            part.shrink(rows, length)

    def traced_inputs(self, rows: int) -> list[mx.array]:
        return [a for part in self.parts for a in part.traced_inputs(rows)]

    def take_traced(self, outputs: Iterator[mx.array], rows: int) -> None:
        for part in self.parts:
            part.take_traced(outputs, rows)

    def clear(self) -> None:
        for part in self.parts:
            part.clear()

    def move_row(self, source: int, target: int) -> None:
        for part in self.parts:
            part.move_row(source, target)

    def join_row(self, row: int, cache: CacheList | None, length: int) -> None:
        for i, part in enumerate(self.parts):
            part.join_row(row, cache[i] if cache is not None else None, length)

    def extract_row(self, row: int, length: int) -> CacheList:
        return CacheList(*(part.extract_row(row, length) for part in self.parts))

    def snapshot_row(self, row: int) -> list:
        return [part.snapshot_row(row) if isinstance(part, StateSlots | ListSlots) else None for part in self.parts]

    def restore_row(self, row: int, saved: list) -> None:
        for part, state in zip(self.parts, saved):
            if state is not None and isinstance(part, StateSlots | ListSlots):
                part.restore_row(row, state)


Slots = FullSlots | WindowSlots | StateSlots | ListSlots
