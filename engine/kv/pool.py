"""The block pool of paged KV (`kv.block_size`): every paged layer's positions, by block.

Each paged layer (a float full-attention `LayerLayout` with `kv_block`) has one pool per
array, `[heads, blocks * block_size, dim]`; block `b` is positions `[b * block_size, (b + 1) *
block_size)` of every paged layer's pool. A request's position `p` lives at pool position
`table[p // block_size] * block_size + p % block_size` of its block table. Blocks are counted
by `policies.blocks.BlockAllocator`; the caches that read and write them are `engine.kv.paged`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import msgspec
import structlog

from engine.kv.layout import DTYPES
from policies.blocks import BlockAllocator, blocks_for
from policies.layout import leaves, paged_block_bytes
from protocols.model import KvPool, LayerLayout

log = structlog.get_logger(actor="engine")

MIN_GROWTH = 64  # blocks added at least when the pool grows
# A new table is placed with room to grow by up to this many positions past its first chunk.
ROOM_POSITIONS = 512


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
        self._resize(old)

    def shrink(self) -> None:
        """Give back the free blocks past the last held one once they are most of the pool
        (blocks are handed out lowest first, so the held ones gather at the start)."""
        capacity = self.allocator.capacity
        keep = max(MIN_GROWTH, 2 * self.allocator.highest_held() + 2)
        if capacity < 4 * keep:
            return
        old = self.positions
        self.allocator.truncate(keep)
        self._resize(old)

    def _resize(self, old: int) -> None:
        """Every pool array from `old` positions to the allocator's capacity (kept positions copied)."""
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


def gather_blocks(pool: mx.array, blocks: mx.array, rows: int, width: int, block_size: int) -> mx.array:
    """`[rows, heads, width, dim]`: each row's first `width` positions from its `blocks`
    (`rows * n` block ids, row-major), copied a whole block at a time (MLX gathers a block's
    `block_size x dim` run faster than its positions one by one)."""
    heads, positions, dim = pool.shape
    n = blocks.shape[0] // rows
    gathered = pool.reshape(heads, positions // block_size, block_size, dim)[:, blocks]
    return gathered.reshape(heads, rows, n * block_size, dim).transpose(1, 0, 2, 3)[:, :, :width]
