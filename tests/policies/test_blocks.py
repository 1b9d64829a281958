"""Tests for policies.blocks.BlockAllocator: reference-counted blocks of the paged KV pool."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.blocks import BlockAllocator, blocks_for


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_a_new_table_starts_where_it_has_room_to_grow():
    allocator = BlockAllocator(16, capacity=16)
    assert allocator.allocate(2) == [0, 1]  # an empty pool: at its start
    assert allocator.allocate(2) == [9, 10]  # halfway along the free run after the first table
    assert allocator.allocate(2, after=1) == [2, 3]  # the first table grows in place
    assert allocator.allocate(2) == [6, 7]  # the largest run is 4..8: halfway again
    assert allocator.allocate(3, after=10) == [11, 12, 13]


def test_a_table_whose_next_block_is_taken_grows_by_the_lowest_free_ones():
    allocator = BlockAllocator(16, capacity=6)
    first = allocator.allocate(2)  # 0, 1
    allocator.allocate(2, after=first[-1])  # 2, 3
    second = allocator.allocate(1)
    assert second == [5]  # halfway along 4..5
    allocator.release([2])
    assert allocator.allocate(2, after=second[-1]) == [2, 4]


def test_released_blocks_come_back():
    allocator = BlockAllocator(16, capacity=4)
    blocks = allocator.allocate(3)
    allocator.release(blocks[1:2])
    assert (allocator.num_used, allocator.num_free) == (2, 2)
    assert allocator.allocate(2, after=blocks[0]) == [1, 3]


def test_allocating_more_than_is_free_raises_and_takes_nothing():
    allocator = BlockAllocator(16, capacity=2)
    with pytest.raises(ValueError):
        allocator.allocate(3)
    assert allocator.num_free == 2
    allocator.grow(4)
    assert allocator.allocate(3) == [0, 1, 2]


def test_a_shared_block_is_free_only_after_its_last_holder_releases_it():
    allocator = BlockAllocator(16, capacity=4)
    blocks = allocator.allocate(2)
    allocator.hold(blocks)
    allocator.release(blocks)
    assert allocator.num_free == 2 and [allocator.refs(b) for b in blocks] == [1, 1]
    allocator.release(blocks)
    assert allocator.num_free == 4


def test_holding_a_free_block_or_releasing_one_too_often_raises():
    allocator = BlockAllocator(16, capacity=4)
    with pytest.raises(ValueError):
        allocator.hold([0])
    (block,) = allocator.allocate(1)
    allocator.release([block])
    with pytest.raises(ValueError):
        allocator.release([block])


def test_truncate_drops_free_blocks_from_the_end_only():
    allocator = BlockAllocator(16, capacity=10)
    allocator.allocate(3)
    assert allocator.highest_held() == 2
    with pytest.raises(ValueError):
        allocator.truncate(2)
    allocator.truncate(4)
    assert (allocator.capacity, allocator.num_free) == (4, 1)
    assert allocator.allocate(1) == [3]


def test_stats_count_shared_blocks_and_positions_past_each_holders_end():
    allocator = BlockAllocator(16, capacity=8)
    entry = allocator.allocate(3)  # an entry of 40 positions
    allocator.hold(entry[:2])  # a request seeded from its 32 first positions
    request = entry[:2] + allocator.allocate(1)  # ... and 5 positions of its own
    stats = allocator.stats([(40, 3), (37, len(request))], block_bytes=100)
    assert (stats.capacity, stats.used, stats.free, stats.shared) == (8, 4, 4, 2)
    assert stats.unused_positions == (48 - 40) + (48 - 37)
    assert stats.block_bytes == 100


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allocate", "hold", "release"]), st.integers(1, 4), st.integers(0, 50)), max_size=60))
def test_free_used_and_shared_blocks_always_add_up(operations):
    allocator = BlockAllocator(8, capacity=16)
    held: list[int] = []  # one entry per reference
    for op, count, pick in operations:
        if op == "allocate" and count <= allocator.num_free:
            after = held[pick % len(held)] if held and pick % 2 else None
            blocks = allocator.allocate(count, after=after)
            assert len(set(blocks)) == count and all(allocator.refs(b) == 1 for b in blocks)
            held += blocks
        elif op == "hold" and held:
            block = held[pick % len(held)]
            allocator.hold([block])
            held.append(block)
        elif op == "release" and held:
            block = held.pop(pick % len(held))
            allocator.release([block])
        assert allocator.num_used == len(set(held))
        assert allocator.num_used + allocator.num_free == allocator.capacity
        assert all(allocator.refs(b) == held.count(b) for b in range(allocator.capacity))
        assert allocator.stats().shared == sum(1 for b in set(held) if held.count(b) > 1)
