"""The prefix cache's index: which token sequences have KV saved, and which to evict.

Pure data (no anyio, no mlx). Entries are whole token sequences whose KV the
engine holds under the entry's id; any prefix of an entry can seed a new
request (the engine trims). A radix tree over token ids finds the longest
shared prefix; recency decides evictions; pinned entries (looked up for a
request not yet admitted) are never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Node:
    # Edge label from the parent: the tokens between the parent and this node.
    label: tuple[int, ...] = ()
    children: dict[int, _Node] = field(default_factory=dict)
    # Entries whose sequence passes through (or ends at) this node, and those ending here.
    entries: set[str] = field(default_factory=set)
    ends: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class PrefixMatch:
    entry_id: str
    num_tokens: int


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    num_bytes: int
    namespace: str | None = None
    pins: int = 0


class PrefixIndex:
    """Longest-prefix lookup and LRU eviction over saved token sequences."""

    def __init__(self) -> None:
        self._roots: dict[str | None, _Node] = {}
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # The entries' bytes, kept as they come and go (the ledger reads it in loops).
        self._num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._entries

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def tokens(self, entry_id: str) -> tuple[int, ...]:
        return self._entries[entry_id].tokens

    def insert(self, entry_id: str, tokens: list[int] | tuple[int, ...], num_bytes: int, *, whole: bool = False, namespace: str | None = None) -> bool:
        """Add an entry; False (and nothing added) if an entry already covers `tokens` (with
        `whole`: if one already ends exactly there; a longer one cannot seed them)."""
        tokens = tuple(tokens)
        if not tokens or entry_id in self._entries:
            return False
        match = self.lookup(tokens, len(tokens), whole=whole, namespace=namespace)
        if match is not None and match.num_tokens == len(tokens):
            return False
        self._entries[entry_id] = _Entry(tokens, num_bytes, namespace)
        self._num_bytes += num_bytes
        node, i = self._roots.setdefault(namespace, _Node()), 0
        while True:
            node.entries.add(entry_id)
            if i == len(tokens):
                node.ends.add(entry_id)
                return True
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = _Node(label=tokens[i:], entries={entry_id}, ends={entry_id})
                return True
            common = _common_length(child.label, tokens[i:])
            if common < len(child.label):
                child = self._split(node, child, common)
            node, i = child, i + common

    def lookup(self, tokens: Sequence[int], max_tokens: int, *, whole: bool = False, namespace: str | None = None) -> PrefixMatch | None:
        """The longest prefix of `tokens` (at most `max_tokens`) some entry of `namespace`
        holds; with `whole`, the longest one that is an entire entry."""
        node, depth, best = self._roots.get(namespace), 0, None
        if node is None:
            return None
        while depth < min(len(tokens), max_tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            common = _common_length(child.label, tokens[depth:max_tokens])
            if common == 0:
                break
            depth += common
            if common < len(child.label):
                if not whole:
                    best = (child.entries, depth)
                break
            if child.ends or not whole:
                best = (child.ends if whole else child.entries, depth)
            node = child
        if best is None:
            return None
        candidates, depth = best
        return PrefixMatch(self._most_recent(candidates), depth)

    def touch(self, entry_id: str) -> None:
        self._entries.move_to_end(entry_id)

    def pin(self, entry_id: str) -> None:
        self._entries[entry_id].pins += 1
        self.touch(entry_id)

    def unpin(self, entry_id: str) -> None:
        entry = self._entries.get(entry_id)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def remove(self, entry_id: str) -> None:
        entry = self._entries.pop(entry_id)
        self._num_bytes -= entry.num_bytes
        node, i = self._roots[entry.namespace], 0
        path = [node]
        while i < len(entry.tokens):
            node = node.children[entry.tokens[i]]
            path.append(node)
            i += len(node.label)
        for node in path:
            node.entries.discard(entry_id)
            node.ends.discard(entry_id)
        for parent, child in zip(reversed(path[:-1]), reversed(path[1:])):
            if not child.entries:
                del parent.children[child.label[0]]

    def evict(self, num_bytes: int) -> list[str]:
        """Least recently used unpinned entries totalling at least `num_bytes` (or all there are)."""
        chosen, freed = [], 0
        for entry_id, entry in self._entries.items():
            if freed >= num_bytes:
                break
            if entry.pins == 0:
                chosen.append(entry_id)
                freed += entry.num_bytes
        for entry_id in chosen:
            self.remove(entry_id)
        return chosen

    def _most_recent(self, candidates: set[str]) -> str:
        # OrderedDict order is recency; candidates are few compared to the index.
        for entry_id in reversed(self._entries):
            if entry_id in candidates:
                return entry_id
        raise AssertionError("a node's entries are always indexed")

    def _split(self, parent: _Node, child: _Node, at: int) -> _Node:
        middle = _Node(label=child.label[:at], children={child.label[at]: child}, entries=set(child.entries))  # ends stay below
        child.label = child.label[at:]
        parent.children[middle.label[0]] = middle
        return middle


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
