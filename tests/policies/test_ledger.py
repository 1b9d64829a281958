"""Tests for policies.ledger.KvLedger with paged KV: reservations in whole blocks, a prefix's
full blocks counted once however many requests share them, parents kept while children are."""

from __future__ import annotations

from policies.ledger import KvLedger
from protocols.model import LayerLayout, SavedPrefix

BLOCK = 16
# One paged layer: 2 heads x (4 + 4) float32 per token = 64 bytes; a block is 1,024 bytes.
PAGED = [LayerLayout(kind="full", heads=2, key_dim=4, value_dim=4, dtype="float32", kv_block=BLOCK)]
TOKEN, BLOCK_BYTES = 64, 64 * BLOCK


def ledger(budget_blocks: int = 0, **kw) -> KvLedger:
    return KvLedger(bytes_per_token=TOKEN, budget_bytes=budget_blocks * BLOCK_BYTES, prefix_cache_bytes=1 << 30, layers=PAGED, **kw)


def saved(entry_id: str, tokens: list[int], num_blocks: int, parent: str | None = None, shared_blocks: int = 0) -> SavedPrefix:
    own = (num_blocks - shared_blocks) * BLOCK_BYTES
    return SavedPrefix(entry_id=entry_id, tokens=tokens, num_bytes=own, parent=parent, shared_bytes=shared_blocks * BLOCK_BYTES)


def test_a_paged_request_reserves_whole_blocks():
    kv = ledger()
    kv.reserve("a", 17)
    kv.reserve("b", 32)
    assert kv.reserved_bytes == (2 + 2) * BLOCK_BYTES


def test_a_seeded_request_reserves_only_what_it_does_not_share():
    kv = ledger()
    prefix = list(range(40))
    kv.save_prefixes([saved("p", prefix, 3)])
    reservation, _ = kv.reserve("a", 100, [*prefix, 99, 98], max_prefix_tokens=41)
    assert (reservation.prefix_entry, reservation.prefix_tokens) == ("p", 40)
    # 100 positions take 7 blocks; the prefix's 2 full blocks are shared, its partial one copied.
    assert kv.reserved_bytes == (7 - 2) * BLOCK_BYTES
    kv.release("a")
    assert kv.reserved_bytes == 0


def test_sixteen_requests_sharing_a_prefix_fit_where_copies_would_not():
    prefix = list(range(1024))  # 64 blocks
    kv = ledger(budget_blocks=64 + 16 * 5)
    kv.save_prefixes([saved("system", prefix, 64)])
    granted = []
    for i in range(16):
        reservation, _ = kv.reserve(f"r{i}", 1024 + 80, [*prefix, 2000 + i], max_prefix_tokens=1024)
        granted.append(reservation.granted and reservation.prefix_entry == "system")
        kv.unpin("system")  # admitted: the lookup's pin goes, the request's hold stays
    assert all(granted)
    assert kv.reserved_bytes + kv.prefixes.num_bytes == (64 + 16 * 5) * BLOCK_BYTES
    assert not kv.reserve("one-more", 1024 + 80)[0].granted


def test_an_entry_shared_by_a_running_request_is_not_evicted():
    kv = ledger(budget_blocks=10)
    prefix = list(range(64))  # 4 blocks
    kv.save_prefixes([saved("p", prefix, 4)])
    kv.reserve("a", 80, [*prefix, 7], max_prefix_tokens=64)  # 5 blocks, 4 shared
    kv.unpin("p")
    # 9 free blocks' worth would need the entry gone: it stays, the newcomer waits.
    reservation, evicted = kv.reserve("b", 16 * 9)
    assert not reservation.granted and evicted == [] and "p" in kv.prefixes
    kv.release("a")
    reservation, evicted = kv.reserve("b", 16 * 9)
    assert reservation.granted and evicted == ["p"]


def test_a_child_entry_counts_its_own_blocks_and_keeps_its_parent():
    kv = ledger()
    kv.save_prefixes([saved("parent", list(range(40)), 3)])
    kv.save_prefixes([saved("child", list(range(60)), 4, parent="parent", shared_blocks=2)])
    assert kv.prefixes.num_bytes == (3 + 2) * BLOCK_BYTES
    # Evicting for room takes the child first (the parent is held), then the parent.
    assert kv._evict(4 * BLOCK_BYTES) == ["child", "parent"]
    assert kv.prefixes.num_bytes == 0


def test_a_child_whose_parent_is_gone_counts_the_shared_blocks_itself():
    kv = ledger()
    kv.save_prefixes([saved("child", list(range(60)), 4, parent="evicted-before", shared_blocks=2)])
    assert kv.prefixes.num_bytes == 4 * BLOCK_BYTES


def test_stats_carry_the_pools_figures_and_the_peak():
    from protocols.model import KvPool

    kv = ledger()
    pool = KvPool(block_size=BLOCK, capacity=64, used=10, free=53, shared=2, unused_positions=7, block_bytes=BLOCK_BYTES)
    kv.record_usage({"a": 100}, physical_bytes=10 * BLOCK_BYTES, pool=pool)
    kv.record_usage({"a": 101}, physical_bytes=4 * BLOCK_BYTES, pool=pool)
    stats = kv.stats()
    assert stats.pool == pool and stats.peak_physical_bytes == 10 * BLOCK_BYTES
