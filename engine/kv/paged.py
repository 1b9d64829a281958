"""Paged KV (`kv.block_size`): float full-attention layers keep positions in one block pool.

Each paged layer (a float full-attention `LayerLayout` with `kv_block`) has one pool per
array, `[heads, blocks * block_size, dim]`; block `b` is positions `[b * block_size, (b + 1) *
block_size)` of every paged layer's pool. A request owns a block table from admission to
release (`engine.sequence.Sequence.table`): its position `p` lives at pool position
`table[p // block_size] * block_size + p % block_size`, while it prefills (`PagedKV`), decodes
(`PagedSlots`, the batch row holding the same table) and parks, so no step copies its KV.
Blocks are counted by `policies.blocks.BlockAllocator`: a request, a prefix entry, and every
request seeded from that entry hold the entry's full blocks at once (shared). A block is
written only by the request that allocated it, at positions past every other holder's end:
a seeded request copies the entry's last partial block into one of its own (copy on write).

A forward writes each new position into its block (one scatter per array) and reads the
positions `[0, width)` back: a slice of the pool when they are one contiguous run of blocks
(a lone request, usually), otherwise one gather per array (MLX has no paged attention kernel
on this backend; BENCHMARKS.md has what the gather costs). Masks and RoPE offsets are
`FullSlots`' geometry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import msgspec
import structlog
from mlx_lm.models.cache import CacheList, KVCache, _BaseCache, create_attention_mask

from engine import lanes
from engine.kv.attention import DECLINED, decode_attention, stack_queries, stacked_mask
from engine.kv.layout import DTYPES
from engine.kv.slots import FullSlots
from engine.step import Step
from policies.blocks import BlockAllocator, blocks_for
from policies.layout import leaves, paged_block_bytes
from protocols.model import KvPool, LayerLayout

log = structlog.get_logger(actor="engine")

MIN_GROWTH = 64  # blocks added at least when the pool grows
# A new table is placed with room to grow by up to this many positions past its first chunk.
ROOM_POSITIONS = 512
# Without mlxrt's CPU kernels, a decode step whose rows hold at least this many positions in all
# attends row by row over slices of the pool rather than over one gathered copy
# (`PagedSlots.attend`): measured on `bench`, 16 rows of 1,024 positions 52 vs 21 tok/s, of 256
# positions 85 vs 92. (With the kernels every row reads its own positions in place.)
ROW_ATTENTION_MIN_POSITIONS = 8192


def paged_layers(layout: Sequence[LayerLayout]) -> list[LayerLayout]:
    """The paged layers, in the order the batch makes their slots (`policies.layout.leaves`)."""
    return [layer for _, layer in leaves(layout) if layer.kind == "full" and layer.kv_block]


def positions_of(table: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    """Pool positions of sequence positions `[start, stop)` of a request with `table`."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def contiguous_run(table: Sequence[int], num_blocks: int) -> int | None:
    """The first block of the table's first `num_blocks` blocks when they are consecutive."""
    first = table[0] if table else 0
    return first if all(table[i] == first + i for i in range(num_blocks)) else None


def map_paged(caches: Sequence[Any], layout: Sequence[LayerLayout], fn) -> list:
    """The caches with each paged layer's replaced by `fn(cache, ordinal)` (lists walked)."""
    ordinals = iter(range(1 << 30))

    def walk(cache: Any, layer: LayerLayout) -> Any:
        if layer.kind == "list":
            return CacheList(*(walk(child, part) for child, part in zip(cache.caches, layer.parts)))
        if layer.kind == "full" and layer.kv_block:
            return fn(cache, next(ordinals))
        return cache

    return [walk(cache, layer) for cache, layer in zip(caches, layout)]


class BlockPool:
    """The pools of every paged layer and their allocator. Outlives the decode batch (prefix
    entries hold blocks too). Grows by whole blocks, at most to `max_blocks` (the KV budget's
    worth) unless more are held already: then it logs, since the ledger should prevent it."""

    def __init__(self, layout: Sequence[LayerLayout], max_blocks: int = 0):
        self.layers = paged_layers(layout)
        self.block_size = self.layers[0].kv_block
        self.allocator = BlockAllocator(self.block_size)
        self.max_blocks = max_blocks
        self.keys: list[mx.array | None] = [None] * len(self.layers)
        self.values: list[mx.array | None] = [None] * len(self.layers)
        self.block_bytes = paged_block_bytes(layout)
        # A block of the pool's own: a forward's padding positions are written there (never
        # read), so a row holds blocks for its real positions only.
        self._scratch: int | None = None

    @property
    def positions(self) -> int:
        return self.allocator.capacity * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the pool (free blocks included)."""
        return self.allocator.capacity * self.block_bytes

    @property
    def num_held(self) -> int:
        """Blocks held by requests and prefix entries (not the scratch block)."""
        return self.allocator.num_used - (self._scratch is not None)

    @property
    def used_bytes(self) -> int:
        return self.num_held * self.block_bytes

    def stats(self, holders: Sequence[tuple[int, int]] = ()) -> KvPool:
        figures = self.allocator.stats(holders, self.block_bytes)
        return msgspec.structs.replace(figures, used=self.num_held)

    # -- blocks ------------------------------------------------------------------------------

    def ensure(self, table: list[int], num_positions: int, expected: int = 0, shared: int = 0) -> None:
        """Extend `table` (in place) with new blocks until it covers `num_positions`. A table
        with no blocks of its own yet (past its `shared` ones) starts a run placed with room
        to grow to `expected` positions (`BlockAllocator.place`)."""
        missing = blocks_for(num_positions, self.block_size) - len(table)
        if missing <= 0:
            return
        if len(table) > shared:
            table += self.allocate(missing, after=table[-1])
            return
        room = max(0, blocks_for(min(expected, num_positions + ROOM_POSITIONS), self.block_size) - len(table) - missing)
        table += self.allocate(missing, room=room)

    def allocate(self, count: int, after: int | None = None, room: int = 0) -> list[int]:
        allocator = self.allocator
        missing = count - allocator.num_free
        if after is not None and missing <= 0:
            # A table's run that reaches the pool's end grows the pool (within the budget) rather
            # than continuing in free blocks elsewhere: its positions stay one run (read in place).
            free = allocator.free_after(after)
            grown = allocator.capacity + count - free
            if free < count and after + 1 + free == allocator.capacity and (not self.max_blocks or grown <= self.max_blocks):
                missing = count - free
        if missing > 0:
            self._grow(self.allocator.capacity + missing)
        elif room and self.allocator.largest_free_run()[1] < count + room and not self._full():
            self._grow(self.allocator.capacity + count + room)  # a run with room (doubling, up to the budget)
        return self.allocator.allocate(count, after=after, room=room)

    def _full(self) -> bool:
        return bool(self.max_blocks) and self.allocator.capacity >= self.max_blocks

    def scratch(self) -> int:
        """The first pool position of the scratch block."""
        if self._scratch is None:
            self._scratch = self.allocate(1)[0]
        return self._scratch * self.block_size

    def release(self, table: list[int]) -> None:
        """Give a table's blocks back and empty it."""
        self.allocator.release(table)
        table.clear()

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.allocator.capacity, MIN_GROWTH)
        if self.max_blocks:
            if needed > self.max_blocks:
                log.warning("kv_pool_over_budget", blocks=needed, max_blocks=self.max_blocks)
            capacity = max(needed, min(capacity, self.max_blocks))
        old = self.positions
        self.allocator.grow(capacity)
        for i, layer in enumerate(self.layers):
            self.keys[i] = _resized(self.keys[i], layer, layer.key_dim, old, self.positions)
            self.values[i] = _resized(self.values[i], layer, layer.value_dim, old, self.positions)
        self.evaluate()

    def shrink(self) -> None:
        """Give back the free blocks past the last held one once they are most of the pool
        (blocks are handed out lowest first, so the held ones gather at the start)."""
        capacity = self.allocator.capacity
        keep = max(MIN_GROWTH, 2 * self.allocator.highest_held() + 2)
        if capacity < 4 * keep:
            return
        old = self.positions
        self.allocator.truncate(keep)
        for i, layer in enumerate(self.layers):
            self.keys[i] = _resized(self.keys[i], layer, layer.key_dim, old, self.positions)
            self.values[i] = _resized(self.values[i], layer, layer.value_dim, old, self.positions)
        self.evaluate()

    def evaluate(self) -> None:
        mx.eval([a for a in (*self.keys, *self.values) if a is not None])

    # -- positions ---------------------------------------------------------------------------

    def arrays(self, ordinal: int) -> tuple[mx.array, mx.array]:
        keys, values = self.keys[ordinal], self.values[ordinal]
        assert keys is not None and values is not None, "a paged layer read before any block was allocated"
        return keys, values

    def flat_index(self, positions: mx.array, heads: int) -> mx.array:
        return flat_index(positions, heads, self.positions)

    def write(self, ordinal: int, keys: mx.array, values: mx.array, index: mx.array) -> None:
        """`keys`/`values` `[heads, n, dim]` at flat `[heads * n]` `index`."""
        pool_keys, pool_values = self.arrays(ordinal)
        self.keys[ordinal] = scatter_flat(pool_keys, keys, index)
        self.values[ordinal] = scatter_flat(pool_values, values, index)

    def write_positions(self, ordinal: int, table: Sequence[int], keys: mx.array, values: mx.array, start: int) -> None:
        """One request's `[1, heads, n, dim]` keys and values as its positions `[start, start + n)`."""
        n = keys.shape[2]
        if not n:
            return
        positions = mx.array(positions_of(table, start, start + n, self.block_size), dtype=mx.int32)
        index = self.flat_index(positions, self.layers[ordinal].heads)
        self.write(ordinal, keys[0], values[0], index)

    def read(self, ordinal: int, table: Sequence[int], width: int) -> tuple[mx.array, mx.array]:
        """One request's positions `[0, width)` as `[1, heads, width, dim]`: a slice of the pool
        when its blocks there run contiguously, else a gathered copy."""
        keys, values = self.arrays(ordinal)
        first = contiguous_run(table, blocks_for(width, self.block_size))
        if first is not None:
            start = first * self.block_size
            return keys[None, :, start : start + width], values[None, :, start : start + width]
        index = mx.array(list(table[: blocks_for(width, self.block_size)]), dtype=mx.int32)
        return gather_blocks(keys, index, 1, width, self.block_size), gather_blocks(values, index, 1, width, self.block_size)

    def copy_positions(self, source: Sequence[int], target: Sequence[int], start: int, stop: int) -> None:
        """Positions `[start, stop)` of a sequence in `source` blocks into `target` blocks, in
        every paged layer (a seeded request's copy of an entry's last partial block)."""
        if stop <= start:
            return
        size = self.block_size
        read = mx.array(positions_of(source, start, stop, size), dtype=mx.int32)
        written = mx.array(positions_of(target, start, stop, size), dtype=mx.int32)
        for ordinal, layer in enumerate(self.layers):
            keys, values = self.arrays(ordinal)
            self.write(ordinal, keys[:, read], values[:, read], self.flat_index(written, layer.heads))
        self.evaluate()


def _resized(array: mx.array | None, layer: LayerLayout, dim: int, old: int, positions: int) -> mx.array:
    if array is not None and positions <= old:
        return mx.contiguous(array[:, :positions])
    resized = mx.zeros((layer.heads, positions, dim), DTYPES[layer.dtype])
    if array is not None and old:
        resized[:, :old] = array
    return resized


def flat_index(positions: mx.array, heads: int, pool_positions: int) -> mx.array:
    """`[heads * n]` flat indices of pool positions `positions` (`[n]`) in every head of a pool
    of `pool_positions`. (Each head's start as a range, not the pool's size times an index: no
    size-dependent constant in a compiled step's fused ops, `engine.compiled._Masks`.)"""
    starts = mx.arange(0, heads * pool_positions, pool_positions, dtype=mx.int32)
    return (starts[:, None] + positions[None, :]).reshape(-1)


def scatter_flat(pool: mx.array, new: mx.array, index: mx.array) -> mx.array:
    heads, positions, dim = pool.shape
    flat = pool.reshape(heads * positions, dim)
    flat[index] = new.reshape(-1, dim)
    return flat.reshape(heads, positions, dim)


def heads_first(x: mx.array) -> mx.array:
    """`[rows, heads, n, dim]` as `[heads, rows * n, dim]` (row-major over rows, then n)."""
    rows, heads, n, dim = x.shape
    return x.transpose(1, 0, 2, 3).reshape(heads, rows * n, dim)


class PagedKV(_BaseCache):
    """One request's paged layer outside the decode batch (prefilling, parked), as mlx-lm's
    layers use a `KVCache`: new positions go into the request's blocks (`table`, the
    request's own list, extended in place), and every position is read back from them."""

    def __init__(self, pool: BlockPool, ordinal: int, table: list[int], offset: int = 0):
        self.pool = pool
        self.ordinal = ordinal
        self.table = table
        self.offset = offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self.offset
        self.pool.ensure(self.table, start + keys.shape[2])
        self.pool.write_positions(self.ordinal, self.table, keys, values, start)
        self.offset = start + keys.shape[2]
        return self.pool.read(self.ordinal, self.table, self.offset)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What the last `update_and_fetch` returned (layers that share another's KV read it)."""
        return self.pool.read(self.ordinal, self.table, self.offset)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    @property
    def keys(self) -> mx.array:
        """Its positions as one contiguous array (checkpoints)."""
        return mx.contiguous(self.pool.read(self.ordinal, self.table, self.offset)[0])

    @property
    def values(self) -> mx.array:
        return mx.contiguous(self.pool.read(self.ordinal, self.table, self.offset)[1])

    @property
    def state(self) -> list[mx.array]:
        return list(self.pool.arrays(self.ordinal)) if self.table else []

    @state.setter
    def state(self, value) -> None:
        raise AttributeError("a paged layer's state is its blocks")

    @property
    def nbytes(self) -> int:
        return 0  # its blocks are the pool's bytes, counted once

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.offset == 0


class PagedRef:
    """A paged layer's place in a prefix entry's caches: its positions are in the entry's
    blocks (`engine.kv.prefixes`), read out when the entry seeds a request."""

    nbytes = 0

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.state: list = []


class PagedSlots(FullSlots):
    """A paged full-attention layer's view of the batch: each row's positions are in the
    blocks of its table (`DecodeBatch.tables`, the row's request's own list)."""

    def __init__(self, batch, layout: LayerLayout, ordinal: int):
        super().__init__(batch, layout)
        self.ordinal = ordinal
        self._fetched: tuple[mx.array, mx.array] | None = None

    @property
    def pool(self) -> BlockPool:
        return self._batch.pool

    @property
    def nbytes(self) -> int:
        return 0  # the pool's bytes are the engine's to count, once

    def capacity(self) -> int:
        return 0

    def reserve(self, rows: int, length: int) -> None:
        pass  # blocks are allocated per row (`DecodeBatch`)

    def shrink(self, rows: int, length: int) -> None:
        pass

    def clear(self) -> None:
        self._fetched = None

    def move_row(self, source: int, target: int) -> None:
        pass  # the batch moves the row's table

    def traced_inputs(self, rows: int) -> list[mx.array]:
        """The layer's pools for the compiled step (`engine.compiled`), which writes them and
        returns them (`take_traced`). Nothing else keeps them meanwhile, so that the write
        reuses their memory rather than copying the pool."""
        self._fetched = None
        return list(self.pool.arrays(self.ordinal))

    def take_traced(self, outputs: Iterator[mx.array], rows: int) -> None:
        pool = self.pool
        pool.keys[self.ordinal], pool.values[self.ordinal] = next(outputs), next(outputs)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        step = self._batch.step
        assert step is not None
        pool = self.pool
        heads = self.layout.heads
        index = step.derive(("paged-write", pool.positions, heads), lambda: pool.flat_index(self._write_positions(step), heads))
        # (The last step's read holds the pool's last arrays: dropped first, so that a write
        # evaluated on its own, as the step profiler does, still scatters in place.)
        self._fetched = None
        pool.write(self.ordinal, heads_first(keys), heads_first(values), index)
        self._fetched = self._read(step)
        return self._fetched

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        assert self._fetched is not None
        return self._fetched

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array | None:
        """A decode step (one token per row) reads the rows' blocks where they are. With mlxrt's
        CPU kernels: their paged attention, each row over its own positions only (rows of mixed
        lengths do no padded work), several rows split over two CPU lanes (`engine.lanes`).
        Without them (a lone row attends over its slice of the pool or a gathered copy), several
        rows attend row by row over slices of the pool (gathered where a row's blocks do not run
        contiguously) once they hold `ROW_ATTENTION_MIN_POSITIONS`, as mlx-lm's one-sequence
        attention; below that, split over the lanes, each half of the rows attending over a
        gathered copy of its own blocks. The gathered batch the layer was
        given is then never evaluated. Anything else (a step of several tokens, keys the layer
        changed, a mask this layer did not make) attends over the keys given, as every slot
        does (`engine.kv.attention.decode_attention`, None where that declines)."""
        step = self._batch.step
        if (
            step is None
            or self._fetched is None
            or keys is not self._fetched[0]
            or values is not self._fetched[1]
            or step.num_new != 1
            or step.rows is not None
            or (mask is not None and mask is not step.derived.get(("full-mask", None)))
        ):
            return super().attend(queries, keys, values, scale, mask)
        read = step.derived.get(self._read_key)
        if lanes.kernels(queries) is not None:
            blocks = read if isinstance(read, mx.array) else step.derive(("paged-blocks", self.pool.positions), lambda: self._blocks(step, step.width))
            out = self._attend_native(step, blocks, queries, scale, mask)
            if out is not None:
                return out
        if step.num_rows < 2:
            return super().attend(queries, keys, values, scale, mask)
        if step.num_rows * step.width >= ROW_ATTENTION_MIN_POSITIONS:
            return self._attend_rows(step, queries, scale)
        if lanes.enabled() and isinstance(read, mx.array):
            return self._attend_halves(step, read, queries, scale, mask)
        return super().attend(queries, keys, values, scale, mask)

    def _attend_rows(self, step: Step, queries: mx.array, scale: float) -> mx.array:
        reads = step.derive(("paged-rows", self.pool.positions), lambda: self._row_reads(step))
        pool_keys, pool_values = self.pool.arrays(self.ordinal)
        outputs, split = [], lanes.enabled()  # odd rows on the second lane
        for row, read in enumerate(reads):
            if isinstance(read, int):
                end = read + step.starts[row] + 1
                row_keys, row_values = pool_keys[None, :, read:end], pool_values[None, :, read:end]
            else:
                size, length = self.pool.block_size, step.starts[row] + 1
                row_keys, row_values = gather_blocks(pool_keys, read, 1, length, size), gather_blocks(pool_values, read, 1, length, size)
            with lanes.suspended(), mx.stream(lanes.second()) if split and row % 2 else contextlib.nullcontext():
                outputs.append(_attention(queries[row : row + 1], row_keys, row_values, scale, None))
        return mx.concatenate(outputs, axis=0)

    def _attend_native(self, step: Step, blocks: mx.array, queries: mx.array, scale: float, mask) -> mx.array | None:
        """mlxrt's paged attention kernel over each row's own positions (the step's mask says
        only where each row ends: `lengths`), in halves of the rows on two lanes when they split;
        bit for bit `decode_attention` over each row alone, as `_attend_rows` runs it. None where
        the kernel does not apply."""
        pool_keys, pool_values = self.pool.arrays(self.ordinal)
        module = lanes.kernels(queries, pool_keys, pool_values)
        kv_heads = pool_keys.shape[0]
        if module is None or stacked_mask(queries, kv_heads, None) is DECLINED:
            return None
        rows, width, size = step.num_rows, step.width, self.pool.block_size
        lengths = None if mask is None else step.derive(("paged-lengths",), lambda: mx.array(step.starts, dtype=mx.int32) + 1)
        stacked = stack_queries(queries, kv_heads, scale)

        def attend(q: mx.array, own: mx.array, n: mx.array | None) -> mx.array:
            return module.paged_attention(q, pool_keys, pool_values, own, width=width, block_size=size, lengths=n)

        if lanes.enabled() and rows >= 2:
            at, per_row = rows // 2, blocks.shape[0] // rows
            parts = (lengths[:at], lengths[at:]) if lengths is not None else (None, None)
            out = lanes.halves(attend, (stacked[:at], blocks[: at * per_row], parts[0]), (stacked[at:], blocks[at * per_row :], parts[1]), axis=0)
        else:
            out = attend(stacked, blocks, lengths)
        return out.reshape(*queries.shape[:2], 1, -1)

    def _attend_halves(self, step: Step, blocks: mx.array, queries: mx.array, scale: float, mask) -> mx.array:
        pool_keys, pool_values = self.pool.arrays(self.ordinal)
        rows, width, size = step.num_rows, step.width, self.pool.block_size
        per_row = blocks.shape[0] // rows
        at = rows // 2

        def half(q: mx.array, own: mx.array, m) -> mx.array:
            n = q.shape[0]
            return _attention(q, gather_blocks(pool_keys, own, n, width, size), gather_blocks(pool_values, own, n, width, size), scale, m)

        masks = lanes.split_mask(mask, 0, at, rows)
        return lanes.halves(half, (queries[:at], blocks[: at * per_row], masks[0]), (queries[at:], blocks[at * per_row :], masks[1]), axis=0)

    def _row_reads(self, step: Step) -> list[int | mx.array]:
        """Each row's positions `[0, length]`: the pool position they start at (contiguous
        blocks), or its blocks."""
        tables, size = self._batch.tables, self.pool.block_size
        reads: list[int | mx.array] = []
        for row, start in enumerate(step.starts):
            first = contiguous_run(tables[row], blocks_for(start + 1, size))
            reads.append(first * size if first is not None else mx.array(tables[row][: blocks_for(start + 1, size)], dtype=mx.int32))
        return reads

    def _write_positions(self, step: Step) -> mx.array:
        """Each forwarded row's new positions in its blocks, its padding in the scratch block."""
        rows = step.rows if step.rows is not None else range(step.num_rows)
        tables, size, n = self._batch.tables, self.pool.block_size, step.num_new
        padding = [self.pool.scratch() + j % size for j in range(n - min(step.counts))] if min(step.counts) < n else []
        flat = []
        for row, start, count in zip(rows, step.starts, step.counts):
            flat += positions_of(tables[row], start, start + count, size) + padding[: n - count]
        return mx.array(flat, dtype=mx.int32)

    @property
    def _read_key(self) -> tuple:
        """Where a step keeps its read plan (`_read_plan`), for as long as the pool's size holds."""
        return ("paged-read", self.pool.positions)

    def _read(self, step: Step) -> tuple[mx.array, mx.array]:
        keys, values = self.pool.arrays(self.ordinal)
        width = step.width
        read = step.derive(self._read_key, lambda: self._read_plan(step, width))
        if isinstance(read, int):
            return keys[None, :, read : read + width], values[None, :, read : read + width]
        rows = len(step.starts)
        size = self.pool.block_size
        return gather_blocks(keys, read, rows, width, size), gather_blocks(values, read, rows, width, size)

    def _read_plan(self, step: Step, width: int) -> int | mx.array:
        """Where the step's rows' positions `[0, width)` are: the pool position they start at
        when one row's blocks run contiguously, else each row's blocks (a row with fewer:
        block 0 after its own, masked out like any position past a row's end)."""
        rows = list(step.rows) if step.rows is not None else list(range(step.num_rows))
        if len(rows) == 1:
            first = contiguous_run(self._batch.tables[rows[0]], blocks_for(width, self.pool.block_size))
            if first is not None:
                return first * self.pool.block_size
        return self._blocks(step, width)

    def _blocks(self, step: Step, width: int) -> mx.array:
        """The step's rows' blocks covering positions `[0, width)` (`DecodeBatch.block_ids`)."""
        return self._batch.block_ids(step.rows, blocks_for(width, self.pool.block_size))

    def join_row(self, row: int, cache: Any, length: int) -> None:
        """A request's paged cache is in the row's blocks already; a contiguous one (a
        caller outside the engine) is copied in."""
        if type(cache) is KVCache and length:
            keys, values = cache.keys, cache.values
            assert keys is not None and values is not None
            self.pool.write_positions(self.ordinal, self._batch.tables[row], keys[..., :length, :], values[..., :length, :], 0)

    def extract_row(self, row: int, length: int) -> PagedKV:  # type: ignore[override]
        """The row's positions where they are (no copy): the request keeps its table."""
        return PagedKV(self.pool, self.ordinal, self._batch.tables[row], length)


def _attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    out = decode_attention(queries, keys, values, scale, mask)
    return out if out is not None else lanes.sdpa(queries, keys, values, scale, mask)


def gather_blocks(pool: mx.array, blocks: mx.array, rows: int, width: int, block_size: int) -> mx.array:
    """`[rows, heads, width, dim]`: each row's first `width` positions from its `blocks`
    (`rows * n` block ids, row-major), copied a whole block at a time (MLX gathers a block's
    `block_size x dim` run faster than its positions one by one)."""
    heads, positions, dim = pool.shape
    n = blocks.shape[0] // rows
    gathered = pool.reshape(heads, positions // block_size, block_size, dim)[:, blocks]
    return gathered.reshape(heads, rows, n * block_size, dim).transpose(1, 0, 2, 3)[:, :, :width]
