"""Paged KV (`kv.block_size`): float full-attention layers keep positions in one block pool
(`engine.kv.pool.BlockPool`); here, the caches that write and read a request's blocks.

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
on this backend; docs/benchmarks/log.md has what the gather costs). Masks and RoPE offsets are
`FullSlots`' geometry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache

from engine import lanes
from engine.kv.attention import DECLINED, decode_attention, stack_queries, stacked_mask
from engine.kv.offsets import OffsetCache
from engine.kv.pool import BlockPool, contiguous_run, gather_blocks, positions_of
from engine.kv.slots import FullSlots
from engine.step import Step
from policies.blocks import blocks_for
from protocols.model import LayerLayout

# Without mlxrt's CPU kernels, a decode step whose rows hold at least this many positions in all
# attends row by row over slices of the pool rather than over one gathered copy
# (`PagedSlots.attend`): measured on `bench`, 16 rows of 1,024 positions 52 vs 21 tok/s, of 256
# positions 85 vs 92. (With the kernels every row reads its own positions in place.)
ROW_ATTENTION_MIN_POSITIONS = 8192


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


def heads_first(x: mx.array) -> mx.array:
    """`[rows, heads, n, dim]` as `[heads, rows * n, dim]` (row-major over rows, then n)."""
    rows, heads, n, dim = x.shape
    return x.transpose(1, 0, 2, 3).reshape(heads, rows * n, dim)


class PagedKV(OffsetCache):
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
