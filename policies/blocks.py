"""The paged KV pool's block allocator: which blocks are free, who holds each (pure).

A block is `block_size` consecutive positions of every paged layer's pool (`engine.kv.paged`).
A request holds the blocks of its table; a prefix entry holds the blocks of the KV it kept;
a request seeded from an entry holds the entry's full blocks too (shared, not copied). A
block is free once nobody holds it. A request's blocks are best one contiguous run (attention
reads a slice of the pool, not a gathered copy), so a new table starts where it has room to
grow into: in the largest free run, leaving up to half of it to the table before the run
when that one is held. A table grows by the blocks right after its last one while they are
free, else by the lowest free ones. (Free blocks in a table's room are not held: anyone
takes them when nothing else is free.)
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from protocols.model import KvPool


def blocks_for(num_positions: int, block_size: int) -> int:
    return -(-num_positions // block_size)


class BlockAllocator:
    """Reference-counted blocks `0 .. capacity-1`; `grow` adds more, `truncate` drops free
    ones from the end."""

    def __init__(self, block_size: int, capacity: int = 0):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.capacity = 0
        self._refs: list[int] = []
        # Every free block has an entry here; entries of blocks taken out of order are
        # skipped when popped.
        self._heap: list[int] = []
        self.num_free = 0
        # Blocks held more than once (kept as they change: the engine reports it every step).
        self.num_shared = 0
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        for block in range(self.capacity, capacity):
            self._refs.append(0)
            heapq.heappush(self._heap, block)
        self.num_free += max(0, capacity - self.capacity)
        self.capacity = max(self.capacity, capacity)

    def truncate(self, capacity: int) -> None:
        """Drop blocks `capacity ..`, which must all be free."""
        if any(self._refs[capacity:]):
            raise ValueError(f"blocks past {capacity} are held")
        self.num_free -= self.capacity - capacity
        self.capacity = capacity
        del self._refs[capacity:]
        self._heap = [block for block in range(capacity) if not self._refs[block]]
        heapq.heapify(self._heap)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def highest_held(self) -> int:
        """The last held block (-1: none)."""
        return next((block for block in range(self.capacity - 1, -1, -1) if self._refs[block]), -1)

    def allocate(self, count: int, after: int | None = None, room: int = 0) -> list[int]:
        """`count` free blocks, each now held once: those right after block `after` (a table's
        last; None: a new table expecting to grow by `room` more, placed by `place`) while
        they are free, then the lowest free ones. The caller grows the pool first when fewer
        are free (`ValueError` otherwise: nothing is allocated)."""
        if count > self.num_free:
            raise ValueError(f"{count} blocks wanted, {self.num_free} free")
        blocks: list[int] = []
        block = after + 1 if after is not None else self.place(count + room)
        while len(blocks) < count and block < self.capacity and not self._refs[block]:
            blocks.append(block)
            self._refs[block] = 1
            block += 1
        while len(blocks) < count:
            block = heapq.heappop(self._heap)
            if not self._refs[block]:
                blocks.append(block)
                self._refs[block] = 1
        self.num_free -= count
        if len(self._heap) > 2 * self.capacity + 64:  # stale entries from out-of-order takes
            self._heap = [b for b in range(self.capacity) if not self._refs[b]]
            heapq.heapify(self._heap)
        return blocks

    def free_after(self, block: int) -> int:
        """How many blocks right after `block` are free (up to the capacity)."""
        count = 0
        while block + 1 + count < self.capacity and not self._refs[block + 1 + count]:
            count += 1
        return count

    def largest_free_run(self) -> tuple[int, int]:
        """(first block, length) of the longest run of free blocks."""
        best_start, best_length, start = 0, 0, None
        for block in range(self.capacity + 1):
            if block < self.capacity and not self._refs[block]:
                start = block if start is None else start
                continue
            if start is not None and block - start > best_length:
                best_start, best_length = start, block - start
            start = None
        return best_start, best_length

    def place(self, span: int) -> int:
        """Where a new table that may grow to `span` blocks starts: in the largest free run,
        as far in as leaves it `span` blocks and the table before the run at most half."""
        start, length = self.largest_free_run()
        if start == 0 or not self._refs[start - 1]:
            return start
        return start + max(0, min(length // 2, length - span))

    def hold(self, blocks: Iterable[int]) -> None:
        """One more holder of each (already held) block."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} is free")
            self._refs[block] += 1
            self.num_shared += self._refs[block] == 2

    def release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} released more often than held")
            self._refs[block] -= 1
            self.num_shared -= self._refs[block] == 1
            if self._refs[block] == 0:
                heapq.heappush(self._heap, block)
                self.num_free += 1

    def refs(self, block: int) -> int:
        return self._refs[block]

    def stats(self, holders: Iterable[tuple[int, int]] = (), block_bytes: int = 0) -> KvPool:
        """`holders`: (positions, blocks held) of each holder, for the unused positions."""
        unused = sum(max(0, held * self.block_size - positions) for positions, held in holders)
        return KvPool(
            block_size=self.block_size,
            capacity=self.capacity,
            used=self.num_used,
            free=self.num_free,
            shared=self.num_shared,
            unused_positions=unused,
            block_bytes=block_bytes,
        )
