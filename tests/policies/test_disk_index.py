"""The disk tier's index: chained chunk keys, lookups, what an entry lacks, LRU that shortens chains."""

from __future__ import annotations

from policies.disk_index import DiskEntry, DiskIndex, chunk_keys, whole_key

C = 4


def _chunks(index: DiskIndex, tokens: list[int], namespace: str | None = None, size: int = 100) -> list[str]:
    """Index every chunk `tokens` lacks (as the writer would after writing them); their keys."""
    for key, _, end, parent in index.wanted(tokens, namespace):
        assert index.add(DiskEntry(key=key, num_bytes=size, end=end, namespace=namespace, parent=parent))
    return chunk_keys(namespace, tokens, C)


def test_a_chunk_key_names_every_token_before_it_and_the_namespace():
    a = chunk_keys(None, list(range(12)), C)
    assert len(a) == 3 and len(set(a)) == 3
    assert chunk_keys(None, list(range(9)), C) == a[:2]  # a prefix's keys are the first keys
    changed = chunk_keys(None, [99, *range(1, 12)], C)
    assert all(x != y for x, y in zip(a, changed))  # an early token changes every key after it
    assert chunk_keys("adapter@abc", list(range(12)), C)[0] != a[0]
    assert whole_key(None, [1, 2, 3]) != whole_key(None, [1, 2]) != whole_key("x", [1, 2])


def test_lookup_walks_chunks_until_one_is_missing_and_respects_the_cap():
    index = DiskIndex(chunk=C, whole=False)
    system = list(range(100, 112))
    _chunks(index, system)
    prompt = [*system, 7, 8, 9, 10, 11]
    match = index.lookup(prompt, len(prompt) - 1, None)
    assert match is not None and match.num_tokens == 12 and len(match.keys) == 3 and not match.whole
    # A prompt that is exactly the chunks: the last position stays to be forwarded.
    assert index.lookup(system, len(system) - 1, None).num_tokens == 11
    # At most max_tokens, and only the chunks that reach them are read.
    capped = index.lookup(prompt, 5, None)
    assert capped.num_tokens == 5 and len(capped.keys) == 2
    assert index.lookup([1, *prompt[1:]], 16, None) is None
    assert index.lookup(prompt, 16, "other-namespace") is None


def test_wanted_lists_only_what_the_disk_lacks():
    index = DiskIndex(chunk=C, whole=False)
    _chunks(index, list(range(8)))
    wanted = index.wanted(list(range(14)), None)
    keys = chunk_keys(None, list(range(14)), C)
    assert wanted == [(keys[2], 8, 12, keys[1])]  # the tail (12:14) is never stored


def test_a_chunk_without_its_parent_is_refused_and_removal_takes_the_chunks_after_it():
    index = DiskIndex(chunk=C, whole=False)
    keys = _chunks(index, list(range(16)))
    assert not index.add(DiskEntry(key="f" * 64, num_bytes=1, end=8, parent="e" * 64))
    branch = _chunks(index, [*range(8), 50, 51, 52, 53])  # shares two chunks, then differs
    assert len(index) == 5 and index.num_bytes == 500
    assert sorted(index.remove(keys[1])) == sorted([keys[1], keys[2], keys[3], branch[2]])
    assert len(index) == 1 and index.num_bytes == 100
    assert index.lookup(list(range(16)), 15, None).num_tokens == 4


def test_eviction_shortens_chains_from_their_ends():
    index = DiskIndex(chunk=C, whole=False)
    old = _chunks(index, list(range(16)))
    new = _chunks(index, list(range(200, 208)))
    index.touch(old)  # a hit on the old chain: its first chunk is now the most recent
    evicted = index.evict_to(500)
    assert evicted == [new[1]]  # the least recent: the newer chain's end, not its start
    evicted = index.evict_to(300)
    assert evicted == [new[0], old[3]]
    assert index.lookup(list(range(16)), 15, None).num_tokens == 12


def test_restore_rebuilds_chains_in_any_order_and_drops_orphans():
    index = DiskIndex(chunk=C, whole=False)
    keys = _chunks(index, list(range(12)))
    found = [index.get(k) for k in keys]
    orphan = DiskEntry(key="a" * 64, num_bytes=7, end=8, parent="b" * 64)
    rebuilt = DiskIndex(chunk=C, whole=False)
    # Least recently used first (the scan's order: by modification time).
    assert rebuilt.restore([found[2], orphan, found[0], found[1]]) == [orphan.key]
    assert rebuilt.lookup(list(range(13)), 12, None).num_tokens == 12
    assert rebuilt.evict_to(200) == [keys[2]]  # the oldest by the order given


def test_whole_entries_match_only_where_they_end():
    index = DiskIndex(chunk=C, whole=True)
    tokens = [5, 6, 7, 8, 9, 10]
    ((key, start, end, parent),) = index.wanted(tokens, None)
    assert (key, start, end, parent) == (whole_key(None, tokens), 0, 6, None)
    assert index.add(DiskEntry(key=key, num_bytes=10, end=6, tokens=tuple(tokens)))
    assert index.wanted(tokens, None) == []
    match = index.lookup([*tokens, 1, 2], 7, None)
    assert match is not None and match.whole and match.keys == [key] and match.num_tokens == 6
    assert index.lookup([*tokens[:5], 1, 2], 6, None) is None  # a window cannot be cut back
    assert index.lookup(tokens, 5, None) is None  # the prompt's last token must stay to forward
    assert index.remove(key) == [key] and index.lookup([*tokens, 1], 7, None) is None


def test_a_chunk_is_found_only_at_the_positions_its_file_says_it_holds():
    index = DiskIndex(chunk=C, whole=False)
    keys = chunk_keys(None, list(range(12)), C)
    assert index.add(DiskEntry(key=keys[0], num_bytes=1, end=4))
    # The third chunk's key on a file that says it is a first chunk (a relabelled file).
    assert index.add(DiskEntry(key=keys[2], num_bytes=1, end=4))
    assert index.add(DiskEntry(key=keys[1], num_bytes=1, end=8, parent=keys[0]))
    match = index.lookup(list(range(13)), 12, None)
    assert match is not None and match.keys == keys[:2] and match.num_tokens == 8


def test_chunks_of_another_size_or_whole_entries_short_of_their_tokens_are_not_indexed():
    index = DiskIndex(chunk=C, whole=False)
    keys = chunk_keys(None, list(range(16)), 2 * C)  # written with another `kv.disk_chunk_tokens`
    found = [DiskEntry(key=keys[0], num_bytes=1, end=8), DiskEntry(key=keys[1], num_bytes=1, end=16, parent=keys[0])]
    assert index.restore(found) == keys and len(index) == 0  # unreachable: their files are removed
    wholes = DiskIndex(chunk=C, whole=True)
    assert not wholes.add(DiskEntry(key=whole_key(None, [1, 2, 3]), num_bytes=1, end=9, tokens=(1, 2, 3)))
