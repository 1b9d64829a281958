"""The decode batch: one row per running request, in every layer's slots.

Row `r` holds `lengths[r]` positions of its request; each layer keeps them in the slots of
its kind (`engine.kv.slots`). Each row writes at its own position, so rows join and leave
without touching the others (joining copies one row in, leaving moves the last row into
the hole), unlike a left-padded batch cache that re-pads every row on each join.

mlx-lm's layers are given the slots themselves as their caches: attention layers call
`update_and_fetch`, read `offset` for RoPE and ask `make_mask`; recurrent layers index the
state and read `lengths`. All of them answer from the step's geometry (`begin_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from engine.kv.factory import make_slots
from engine.kv.pool import BlockPool
from engine.kv.slots import FullSlots, ListSlots, Slots, StateSlots
from engine.step import LEN_STEP, Step, round_up
from policies.blocks import blocks_for
from policies.layout import RING_MARGIN, is_trimmable
from protocols.model import LayerLayout

# The fewest blocks per row the compiled step attends over (`DecodeBatch._traced_blocks`).
MIN_TRACED_BLOCKS = 8


class _BlockIds(NamedTuple):
    key: tuple
    lengths: list[int]
    ids: np.ndarray
    array: mx.array


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeBatch:
    """Rows of the requests being decoded together, in every layer's slots.

    Owns the slots; callers own the mapping of rows to requests through `row_ids`.
    `begin_step` must precede a forward and `end_step` follow it.
    """

    def __init__(self, layers: Sequence[LayerLayout], pool: BlockPool | None = None):
        self.layout = list(layers)
        self.row_ids: list[str] = []
        self.lengths: list[int] = []
        # What each row's rotary positions add to its cache positions (`Step.shifts`).
        self.shifts: list[int] = []
        # Paged layers (`engine.kv.paged`): each row's block table, its request's own list (the
        # request holds the blocks; the batch extends the table as the row grows).
        self.pool = pool
        self.tables: list[list[int]] = []
        self._num_paged = 0
        self.slots: list[Slots] = [make_slots(self, layer) for layer in self.layout]
        self.paged = self._num_paged > 0
        # Full attention everywhere: the compiled lone-row step applies, and any prefix of a
        # row's KV is a valid cache (windows forget, states cannot be rewound).
        self.all_full = is_trimmable(self.layout) and all(isinstance(s, FullSlots) for s in self.slots)
        self.has_state = any(isinstance(s, StateSlots | ListSlots) for s in self.slots)
        self.step: Step | None = None
        self._rows_capacity = 0
        # The last `block_ids` made, and what it was made from (rows joining or leaving bump
        # `_rows_version`; tables only grow while their row is in the batch).
        self._rows_version = 0
        self._block_ids: _BlockIds | None = None

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

    def next_paged_ordinal(self) -> int:
        """The pool index of the next paged layer's slots (made in `leaves` order)."""
        self._num_paged += 1
        return self._num_paged - 1

    def add_row(self, request_id: str, caches: Sequence | None, length: int, table: list[int] | None = None, shift: int = 0) -> None:
        """Copy a request's per-layer mlx-lm caches (their first `length` positions) into a
        new last row; None: nothing yet (a one-token prompt). Paged layers read the request's
        `table` (required with a pool), where its positions already are."""
        row = len(self.row_ids)
        if self.paged:
            assert self.pool is not None and table is not None, "a paged batch row needs its request's block table"
            self.pool.ensure(table, length + 1)
            self.tables.append(table)
        self._reserve(row + 1, length + 1)
        self._rows_version += 1
        for layer, slots in enumerate(self.slots):
            slots.join_row(row, caches[layer] if caches else None, length)
        self.row_ids.append(request_id)
        self.lengths.append(length)
        self.shifts.append(shift)

    def extract(self, request_id: str) -> list:
        """One row as mlx-lm caches (contiguous copies, evaluated now: a lazy copy would keep
        the batch buffers referenced, and every later write would copy whole buffers). Paged
        layers are `engine.kv.paged.PagedKV`s over the row's table (no copy)."""
        row = self.index(request_id)
        caches = [slots.extract_row(row, self.lengths[row]) for slots in self.slots]
        mx.eval([c.state for c in caches])
        return caches

    def remove_row(self, request_id: str) -> list[int]:
        """Drop a row; returns, for each remaining row, the row it used to be."""
        row = self.index(request_id)
        last = len(self.row_ids) - 1
        order = list(range(last))
        self._rows_version += 1
        if self.paged:  # (the request keeps its table and its blocks)
            self.tables[row] = self.tables[last]
            self.tables.pop()
        if row != last:
            for slots in self.slots:
                slots.move_row(last, row)
            self.row_ids[row] = self.row_ids[last]
            self.lengths[row] = self.lengths[last]
            self.shifts[row] = self.shifts[last]
            order[row] = last
        self.row_ids.pop()
        self.lengths.pop()
        self.shifts.pop()
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
        if self.paged:
            self._extend_tables(rows if rows is not None else range(len(starts)), starts, counts)
        uniform = rows is None and min(starts) == max(starts)
        shifts = self.shifts if rows is None else [self.shifts[r] for r in rows]
        self.step = Step(
            num_rows=len(self.lengths),
            rows=rows,
            starts=list(starts),
            counts=list(counts),
            num_new=num_new,
            positions=mx.array(starts, dtype=mx.int32),
            row_index=None if rows is None else mx.array(rows, dtype=mx.int32),
            uniform_start=starts[0] if uniform else None,
            shifts=mx.array(shifts, dtype=mx.int32) if any(shifts) else None,
        )

    def _extend_tables(self, rows, starts: list[int], counts: list[int]) -> None:
        """Blocks for every real position the step writes (padding goes to the pool's scratch block)."""
        assert self.pool is not None
        for row, start, count in zip(rows, starts, counts):
            self.pool.ensure(self.tables[row], start + count)

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
        """Every row forwards one token through `compiled` (from `engine.compiled`); returns
        the `[rows, vocab]` logits."""
        lengths = self.lengths
        rows = len(lengths)
        self._reserve(rows, max(lengths) + 1)
        positions = mx.array(lengths, dtype=mx.int32)
        blocks = self._traced_blocks(lengths) if self.paged else positions  # (unread without paged layers)
        outputs = compiled(tokens, positions, blocks, *(a for slots in self.slots for a in slots.traced_inputs(rows)))
        remaining = iter(outputs[1:])
        for slots in self.slots:
            slots.take_traced(remaining, rows)
        self.lengths = [n + 1 for n in lengths]
        return outputs[0]

    def _traced_blocks(self, lengths: list[int]) -> mx.array:
        """The rows' block ids for the compiled step, each row's table with blocks for its new
        position, cut or padded (block 0, never read: past the row's length) to a count that
        grows by powers of two (from `MIN_TRACED_BLOCKS`), so that the step's shapes, and so its
        traces, change a few times over a row's life rather than at every block."""
        assert self.pool is not None
        self._extend_tables(range(len(lengths)), lengths, [1] * len(lengths))
        size = self.pool.block_size
        return self.block_ids(None, max(MIN_TRACED_BLOCKS, _next_power_of_two(blocks_for(max(lengths) + 1, size))))

    def block_ids(self, rows: Sequence[int] | None, per_row: int) -> mx.array:
        """`rows`' (every row's: None) first `per_row` blocks, row-major, a row with fewer padded
        with block 0 (read by no step: past the row's end). Kept while the rows and their
        tables' lengths stay (a block is added every `block_size` steps)."""
        tables = self.tables if rows is None else [self.tables[row] for row in rows]
        key, lengths = (self._rows_version, None if rows is None else tuple(rows), per_row), [len(t) for t in tables]
        kept = self._block_ids
        if kept is not None and kept.key == key:
            if kept.lengths == lengths:
                return kept.array
            changed = [i for i, (n, before) in enumerate(zip(lengths, kept.lengths)) if n != before]
            ids = kept.ids  # (only rows whose tables grew are written again)
        else:
            changed, ids = list(range(len(tables))), np.zeros((len(tables), per_row), dtype=np.int32)
        for i in changed:
            own = tables[i][:per_row]
            ids[i, : len(own)] = own
        self._block_ids = _BlockIds(key, lengths, ids, mx.array(ids.reshape(-1)))
        return self._block_ids.array

    def unpadded_groups(self, lengths: list[int]) -> list[list[int]]:
        """Indices of inputs that may share a forward. Padding is masked out of attention, but
        a recurrent layer leaves its state untouched by padding only when the model's code
        honours the caches' lengths (not every mlx-lm model does: nemotron_h's SSM ignores
        them), so with recurrent layers only inputs of one length go together."""
        if not self.has_state:
            return [list(range(len(lengths)))] if lengths else []
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(n, []).append(i)
        return list(groups.values())

    def forward_rows(self, model, rows: list[int], inputs: list[list[int]]) -> mx.array:
        """Forward each of `rows`' tokens in steps over just those rows; returns `[rows, width,
        vocab]` logits (a row's past its own tokens are not meaningful). With sliding windows,
        in pieces a ring can take; with recurrent layers, rows of one count at a time."""
        width = max(len(tokens) for tokens in inputs)
        piece = width if self.all_full else RING_MARGIN
        logits = []
        for start in range(0, width, piece):
            counts = [max(0, min(piece, len(tokens) - start)) for tokens in inputs]
            rest = [tokens[start:] for tokens in inputs]
            groups = [group for group in self.unpadded_groups(counts) if max(counts[i] for i in group) > 0]
            if len(groups) == 1 and len(groups[0]) == len(rows):
                logits.append(self._forward_piece(model, rows, rest, counts))
                continue
            size, per_row = max(counts), {}
            for group in groups:
                out = self._forward_piece(model, [rows[i] for i in group], [rest[i] for i in group], [counts[i] for i in group])
                for j, i in enumerate(group):
                    per_row[i] = mx.pad(out[j : j + 1], [(0, 0), (0, size - out.shape[1]), (0, 0)])
            sample = next(iter(per_row.values()))  # rows with no tokens left: zeros nobody reads
            logits.append(mx.concatenate([per_row.get(i, mx.zeros_like(sample)) for i in range(len(rows))]))
        return logits[0] if len(logits) == 1 else mx.concatenate(logits, axis=1)

    def _forward_piece(self, model, rows: list[int], inputs: list[list[int]], counts: list[int]) -> mx.array:
        """One forward of `rows`, each its first `counts` tokens of `inputs` (right-padded)."""
        size = max(counts)
        padded = [tokens[:count] + [0] * (size - count) for tokens, count in zip(inputs, counts)]
        self.begin_step(counts, rows=rows)
        try:
            return model(mx.array(padded, dtype=mx.uint32), cache=self.layers)
        finally:
            self.end_step()

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Forget a row's last `num_tokens` positions (a rejected verify tail): attention never
        reads them again and the next write overwrites them. (A recurrent state cannot be
        rewound: the engine restores a snapshot and replays instead.)"""
        row = self.index(request_id)
        if not 0 <= num_tokens <= self.lengths[row]:
            raise ValueError(f"cannot rewind {num_tokens} of {self.lengths[row]} positions")
        self.lengths[row] -= num_tokens
