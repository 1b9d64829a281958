"""The decode batch: one row per running request, in every layer's slots.

Row `r` holds `lengths[r]` positions of its request; each layer keeps them in the slots of
its kind (`engine.slots`). Each row writes at its own position, so rows join and leave
without touching the others (joining copies one row in, leaving moves the last row into
the hole), unlike a left-padded batch cache that re-pads every row on each join.

mlx-lm's layers are given the slots themselves as their caches: attention layers call
`update_and_fetch`, read `offset` for RoPE and ask `make_mask`; recurrent layers index the
state and read `lengths`. All of them answer from the step's geometry (`begin_step`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.slots import LEN_STEP, FullSlots, ListSlots, Slots, StateSlots, Step, make_slots, round_up
from policies.layout import is_trimmable
from protocols.model import LayerLayout


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _TracedSlot:
    """A full-attention layer's cache inside the compiled one-token step."""

    def __init__(self, keys: list[mx.array], values: list[mx.array], index: int, positions: mx.array, mask: mx.array):
        self._keys, self._values, self._index = keys, values, index
        self._positions, self._mask = positions, mask

    @property
    def offset(self) -> mx.array:
        return self._positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        i = self._index
        self._keys[i] = _scatter_one(self._keys[i], keys, self._positions)
        self._values[i] = _scatter_one(self._values[i], values, self._positions)
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        i, rows = self._index, self._positions.shape[0]
        return self._keys[i][:rows], self._values[i][:rows]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise NotImplementedError("the compiled step is for full-attention models only")
        return self._mask


def _scatter_one(buffer: mx.array, new: mx.array, positions: mx.array) -> mx.array:
    """`new` ([rows, heads, 1, dim]) written at each row's position of `buffer`."""
    capacity_rows, heads, capacity, dim = buffer.shape
    rows = new.shape[0]
    index = ((mx.arange(rows)[:, None] * heads + mx.arange(heads)[None, :]) * capacity + positions[:, None]).reshape(-1)
    flat = buffer.reshape(capacity_rows * heads * capacity, dim)
    flat[index] = new.reshape(rows * heads, dim)
    return flat.reshape(capacity_rows, heads, capacity, dim)


def compile_decode_step(model, num_layers: int):
    """The batch's one-token step as one compiled function of fixed-shape inputs (models whose
    layers are all full attention).

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
    """Rows of the requests being decoded together, in every layer's slots.

    Owns the slots; callers own the mapping of rows to requests through `row_ids`.
    `begin_step` must precede a forward and `end_step` follow it.
    """

    def __init__(self, layers: Sequence[LayerLayout]):
        self.layout = list(layers)
        self.row_ids: list[str] = []
        self.lengths: list[int] = []
        self.slots: list[Slots] = [make_slots(self, layer) for layer in self.layout]
        # Full attention everywhere: the compiled lone-row step applies, and any prefix of a
        # row's KV is a valid cache (windows forget, states cannot be rewound).
        self.all_full = is_trimmable(self.layout) and all(isinstance(s, FullSlots) for s in self.slots)
        self.has_state = any(isinstance(s, StateSlots | ListSlots) for s in self.slots)
        self.step: Step | None = None
        self._rows_capacity = 0

    def __len__(self) -> int:
        return len(self.row_ids)

    @property
    def layers(self) -> list[Slots]:
        return self.slots

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @property
    def capacity(self) -> tuple[int, int]:
        """Rows allocated, and the most positions any layer's slots hold per row."""
        return self._rows_capacity, max((s.capacity() for s in self.slots), default=0)

    def index(self, request_id: str) -> int:
        return self.row_ids.index(request_id)

    def add_row(self, request_id: str, caches: Sequence | None, length: int) -> None:
        """Copy a request's per-layer mlx-lm caches (their first `length` positions) into a
        new last row; None: nothing yet (a one-token prompt)."""
        row = len(self.row_ids)
        self._reserve(row + 1, length + 1)
        for layer, slots in enumerate(self.slots):
            slots.join_row(row, caches[layer] if caches else None, length)
        self.row_ids.append(request_id)
        self.lengths.append(length)

    def extract(self, request_id: str) -> list:
        """One row as mlx-lm caches (contiguous copies, evaluated now: a lazy copy would keep
        the batch buffers referenced, and every later write would copy whole buffers)."""
        row = self.index(request_id)
        caches = [slots.extract_row(row, self.lengths[row]) for slots in self.slots]
        mx.eval([c.state for c in caches])
        return caches

    def remove_row(self, request_id: str) -> list[int]:
        """Drop a row; returns, for each remaining row, the row it used to be."""
        row = self.index(request_id)
        last = len(self.row_ids) - 1
        order = list(range(last))
        if row != last:
            for slots in self.slots:
                slots.move_row(last, row)
            self.row_ids[row] = self.row_ids[last]
            self.lengths[row] = self.lengths[last]
            order[row] = last
        self.row_ids.pop()
        self.lengths.pop()
        if not self.row_ids:
            for slots in self.slots:
                slots.clear()
            self._rows_capacity = 0
        else:
            self._maybe_shrink()
        return order

    def snapshot(self, request_id: str) -> list:
        """A row's recurrent state (to restore if positions forwarded after it are rejected)."""
        row = self.index(request_id)
        return [s.snapshot_row(row) if isinstance(s, StateSlots | ListSlots) else None for s in self.slots]

    def restore(self, request_id: str, saved: list) -> None:
        row = self.index(request_id)
        for slots, state in zip(self.slots, saved):
            if state is not None and isinstance(slots, StateSlots | ListSlots):
                slots.restore_row(row, state)

    def _maybe_shrink(self) -> None:
        """Give memory back once the batch uses under a quarter of its rows or positions."""
        need_rows = _next_power_of_two(len(self.row_ids))
        need_len = round_up(max(self.lengths) + 1, LEN_STEP)
        capacity = max((s.capacity() for s in self.slots), default=0)
        if need_rows * 4 > self._rows_capacity and need_len * 4 > capacity:
            return
        self._rows_capacity = min(self._rows_capacity, need_rows * 2)
        for slots in self.slots:
            slots.shrink(self._rows_capacity, need_len * 2)

    def _reserve(self, num_rows: int, length: int) -> None:
        rows = max(self._rows_capacity, _next_power_of_two(num_rows))
        self._rows_capacity = rows
        for slots in self.slots:
            slots.reserve(rows, length)

    def begin_step(self, counts: list[int], rows: list[int] | None = None) -> None:
        """Prepare positions, masks and write indices for `counts[i]` new tokens in row
        `rows[i]` (every row in order when `rows` is None).

        Every forwarded row takes max(counts) positions; a row's extra positions are padding,
        written past its length and never attended to (recurrent layers skip them: `lengths`).
        A step over some rows reads a gathered copy of their state: it is for the few rows
        that append several known tokens, while the whole batch decodes one token each.
        """
        starts = self.lengths if rows is None else [self.lengths[r] for r in rows]
        num_new = max(counts)
        self._reserve(len(self.lengths), max(starts) + num_new)
        uniform = rows is None and min(starts) == max(starts)
        self.step = Step(
            num_rows=len(self.lengths),
            rows=rows,
            starts=list(starts),
            counts=list(counts),
            num_new=num_new,
            positions=mx.array(starts, dtype=mx.int32),
            row_index=None if rows is None else mx.array(rows, dtype=mx.int32),
            uniform_start=starts[0] if uniform else None,
        )

    def end_step(self) -> None:
        step = self.step
        assert step is not None
        if step.rows is None:
            self.lengths = [n + c for n, c in zip(self.lengths, step.counts)]
        else:
            for row, count in zip(step.rows, step.counts):
                self.lengths[row] += count
        self.step = None

    def forward_one(self, compiled, tokens: mx.array) -> mx.array:
        """Every row forwards one token through `compiled` (from `compile_decode_step`, for
        full-attention models); returns the `[rows, vocab]` logits."""
        full = [s for s in self.slots if isinstance(s, FullSlots)]
        if len(full) != len(self.slots):
            raise NotImplementedError("the compiled step is for full-attention models only")
        lengths = self.lengths
        self._reserve(len(lengths), max(lengths) + 1)
        keys = [s.keys for s in full]
        values = [s.values for s in full]
        outputs = compiled(tokens, mx.array(lengths, dtype=mx.int32), *keys, *values)
        for i, slots in enumerate(full):
            slots.keys, slots.values = outputs[1 + i], outputs[1 + len(full) + i]
        self.lengths = [n + 1 for n in lengths]
        return outputs[0]

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Forget a row's last `num_tokens` positions (a rejected verify tail): attention never
        reads them again and the next write overwrites them. (A recurrent state cannot be
        rewound: the engine restores a snapshot and replays instead.)"""
        row = self.index(request_id)
        if not 0 <= num_tokens <= self.lengths[row]:
            raise ValueError(f"cannot rewind {num_tokens} of {self.lengths[row]} positions")
        self.lengths[row] -= num_tokens
