"""Tests for policies.prefix_index.PrefixIndex: longest-prefix lookup over a radix tree, LRU eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.prefix_index import PrefixIndex, PrefixMatch


def index_of(*entries: tuple[str, list[int], int]) -> PrefixIndex:
    index = PrefixIndex()
    for entry_id, tokens, num_bytes in entries:
        assert index.insert(entry_id, tokens, num_bytes)
    return index


# -- lookup ------------------------------------------------------------------------------


def test_lookup_finds_the_longest_shared_prefix():
    index = index_of(("short", [1, 2], 10), ("long", [1, 2, 3, 4, 5], 10), ("other", [7, 8], 10))
    assert index.lookup([1, 2, 3, 4, 5, 6], 100) == PrefixMatch("long", 5)
    assert index.lookup([1, 2, 9], 100).num_tokens == 2
    assert index.lookup([7, 8, 9], 100) == PrefixMatch("other", 2)
    assert index.lookup([9, 1, 2], 100) is None
    assert index.lookup([], 100) is None


def test_lookup_is_clamped_to_max_tokens():
    index = index_of(("a", [1, 2, 3, 4, 5], 10))
    assert index.lookup([1, 2, 3, 4, 5], 3) == PrefixMatch("a", 3)
    assert index.lookup([1, 2, 3, 4, 5], 5) == PrefixMatch("a", 5)
    assert index.lookup([1, 2, 3, 4, 5], 0) is None


def test_lookup_may_stop_in_the_middle_of_an_edge():
    index = index_of(("a", [1, 2, 3, 4, 5, 6], 10))
    assert index.lookup([1, 2, 3, 9], 100) == PrefixMatch("a", 3)
    assert index.lookup([1], 100) == PrefixMatch("a", 1)


def test_lookup_after_an_insert_split_an_edge_reaches_both_branches():
    index = index_of(("a", [1, 2, 3, 4], 10), ("b", [1, 2, 7, 8], 10))
    assert index.lookup([1, 2, 3, 4], 100) == PrefixMatch("a", 4)
    assert index.lookup([1, 2, 7, 8, 9], 100) == PrefixMatch("b", 4)
    assert index.lookup([1, 2, 5], 100).num_tokens == 2


def test_lookup_among_equal_matches_prefers_the_most_recently_used_entry():
    index = index_of(("a", [1, 2, 3], 10), ("b", [1, 2, 4], 10))
    assert index.lookup([1, 2, 9], 100) == PrefixMatch("b", 2)
    index.touch("a")
    assert index.lookup([1, 2, 9], 100) == PrefixMatch("a", 2)


# -- insert / remove ---------------------------------------------------------------------


def test_insert_refuses_tokens_an_entry_already_covers():
    index = index_of(("a", [1, 2, 3, 4], 10))
    assert not index.insert("same", [1, 2, 3, 4], 10)
    assert not index.insert("prefix", (1, 2), 10)
    assert not index.insert("a", [5, 6], 10)
    assert not index.insert("empty", [], 10)
    assert len(index) == 1 and index.num_bytes == 10
    assert index.insert("longer", [1, 2, 3, 4, 5], 20)
    assert index.tokens("longer") == (1, 2, 3, 4, 5)
    assert "longer" in index and "prefix" not in index


def test_remove_leaves_no_stale_match():
    index = index_of(("a", [1, 2, 3], 10), ("b", [1, 2, 4, 5], 10))
    index.remove("b")
    assert index.lookup([1, 2, 4, 5], 100) == PrefixMatch("a", 2)
    index.remove("a")
    assert index.lookup([1, 2, 3], 100) is None
    assert len(index) == 0 and index.num_bytes == 0
    # The emptied tree accepts the same sequences again.
    assert index.insert("b2", [1, 2, 4, 5], 7)
    assert index.lookup([1, 2, 4], 100) == PrefixMatch("b2", 3)


def test_removing_an_extension_keeps_the_entry_it_extends():
    index = index_of(("a", [1, 2], 10), ("ab", [1, 2, 3, 4], 10))
    index.remove("ab")
    assert index.lookup([1, 2, 3, 4], 100) == PrefixMatch("a", 2)


# -- eviction ----------------------------------------------------------------------------


def test_evict_takes_least_recently_used_first_and_frees_at_least_the_bytes_asked():
    index = index_of(("a", [1], 10), ("b", [2], 10), ("c", [3], 10), ("d", [4], 10))
    index.touch("a")
    assert index.evict(15) == ["b", "c"]
    assert sorted(e for e in "abcd" if e in index) == ["a", "d"]
    assert index.num_bytes == 20
    assert index.lookup([2], 100) is None and index.lookup([3], 100) is None


def test_evict_of_nothing_evicts_nothing():
    index = index_of(("a", [1], 10))
    assert index.evict(0) == []
    assert len(index) == 1


def test_evict_skips_pinned_entries_until_unpinned():
    index = index_of(("a", [1], 10), ("b", [2], 10), ("c", [3], 10))
    index.pin("a")
    index.pin("a")
    assert index.evict(10) == ["b"]
    index.unpin("a")
    assert index.evict(100) == ["c"]
    index.unpin("a")
    index.unpin("a")  # more unpins than pins are ignored
    assert index.evict(100) == ["a"]
    assert len(index) == 0


def test_pin_counts_as_use():
    index = index_of(("a", [1], 10), ("b", [2], 10))
    index.pin("a")
    index.unpin("a")
    assert index.evict(10) == ["b"]


def test_evict_more_than_there_is_takes_every_unpinned_entry():
    index = index_of(("a", [1], 10), ("b", [2], 10), ("c", [3], 10))
    index.pin("b")
    assert index.evict(1000) == ["a", "c"]
    assert index.num_bytes == 10


def test_unpin_of_a_removed_entry_is_ignored():
    index = index_of(("a", [1], 10))
    index.pin("a")
    index.remove("a")
    index.unpin("a")
    assert len(index) == 0


# -- against a brute-force reference -----------------------------------------------------


def common_length(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


sequences = st.lists(st.integers(0, 3), min_size=1, max_size=6)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), sequences, st.integers(1, 50)),
        st.tuples(st.just("remove"), st.integers(0, 20)),
        st.tuples(st.just("touch"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(0, 60)),
    ),
    max_size=25,
)


def apply(index: PrefixIndex, reference: dict[str, tuple[tuple[int, ...], int]], step: int, op: tuple) -> None:
    """Run one operation on the index and on the reference (a dict whose order is recency)."""
    kind = op[0]
    if kind == "insert":
        tokens = tuple(op[1])
        covered = any(existing[: len(tokens)] == tokens for existing, _ in reference.values())
        assert index.insert(f"e{step}", tokens, op[2]) == (not covered)
        if not covered:
            reference[f"e{step}"] = (tokens, op[2])
    elif kind == "evict":
        expected, freed = [], 0
        for entry_id, (_, num_bytes) in reference.items():
            if freed >= op[1]:
                break
            expected.append(entry_id)
            freed += num_bytes
        assert index.evict(op[1]) == expected
        for entry_id in expected:
            del reference[entry_id]
    elif reference:
        entry_id = list(reference)[op[1] % len(reference)]
        if kind == "remove":
            index.remove(entry_id)
            del reference[entry_id]
        else:
            index.touch(entry_id)
            reference[entry_id] = reference.pop(entry_id)


def check_lookups(index: PrefixIndex, reference: dict[str, tuple[tuple[int, ...], int]], queries: list) -> None:
    for tokens, max_tokens in queries:
        lengths = {entry_id: min(common_length(seq, tokens), max_tokens) for entry_id, (seq, _) in reference.items()}
        best = max(lengths.values(), default=0)
        match = index.lookup(tokens, max_tokens)
        if best == 0:
            assert match is None
        else:
            most_recent = [entry_id for entry_id in reference if lengths[entry_id] == best][-1]
            assert match == PrefixMatch(most_recent, best)


@settings(max_examples=300, deadline=None)
@given(operations, st.lists(st.tuples(sequences, st.integers(0, 8)), min_size=1, max_size=6))
def test_lookup_matches_a_brute_force_reference(ops, queries):
    index = PrefixIndex()
    reference: dict[str, tuple[tuple[int, ...], int]] = {}
    for step, op in enumerate(ops):
        apply(index, reference, step, op)
        assert len(index) == len(reference)
        assert index.num_bytes == sum(num_bytes for _, num_bytes in reference.values())
        check_lookups(index, reference, queries)
