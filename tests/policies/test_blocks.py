"""Tests for policies.blocks.BlockAllocator: reference-counted blocks of the paged KV pool."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.blocks import BlockAllocator, blocks_for


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_blocks_are_handed_out_lowest_first_and_come_back_when_released():
    allocator = BlockAllocator(16, capacity=8)
    assert allocator.allocate(3) == [0, 1, 2]
    assert allocator.allocate(2) == [3, 4]
    allocator.release([1])
    assert (allocator.num_used, allocator.num_free) == (4, 4)
    assert allocator.allocate(2) == [1, 5]


def test_a_table_grows_by_the_blocks_right_after_its_last_one_when_free():
    allocator = BlockAllocator(16, capacity=16)
    first = allocator.allocate(2)  # 0, 1
    allocator.allocate(2)  # 2, 3: right after the first table
    assert allocator.allocate(2, after=first[-1]) == [4, 5]  # block 2 is taken: lowest free instead
    table = allocator.allocate(1)  # 6
    assert allocator.allocate(3, after=table[-1]) == [7, 8, 9]


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
def test_free_and_used_blocks_always_add_up(operations):
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
