"""The disk tier's index: which prefixes have KV on disk, found by content, and which go first.

Pure data (no anyio, no mlx, no I/O), driven by the KV store's disk tier (`actors.disk_tier`).

A model whose layers all keep every position (full attention) stores a prefix as chunks of
`chunk` positions from position 0. Chunk i's key is a hash chained over the namespace (the
LoRA adapter the KV was computed under) and every token up to the chunk's end, so a key
names its whole token path: a prefix many requests share (a system prompt with tool
definitions) is stored once, whatever follows it, and a lookup walks the prompt's chunk keys
until one is missing. The tail past the last whole chunk is never stored (it is prefilled).

A model with sliding windows or recurrent state can only be seeded at a position its state
was saved at, so it stores whole entries, found with a radix index like the RAM tier's.

Recency decides evictions, and a chain's deeper chunks are touched before its first ones, so
eviction shortens chains from their ends; a chunk that goes takes the chunks after it along
(without it they can never be reached).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from policies.prefix_index import PrefixIndex

_CHUNK_SALT = b"mlxrt-kv-chunk/1\0"
_WHOLE_SALT = b"mlxrt-kv-whole/1\0"


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def chunk_keys(namespace: str | None, tokens: Sequence[int], chunk: int) -> list[str]:
    """The keys of the whole `chunk`-position chunks of `tokens`, in order (hex sha256)."""
    previous = hashlib.sha256(_CHUNK_SALT + (namespace or "").encode()).digest()
    keys = []
    for start in range(0, len(tokens) - chunk + 1, chunk):
        digest = hashlib.sha256(previous)
        digest.update(_token_bytes(tokens[start : start + chunk]))
        previous = digest.digest()
        keys.append(previous.hex())
    return keys


def whole_key(namespace: str | None, tokens: Sequence[int]) -> str:
    """The key of a whole entry over exactly `tokens`."""
    digest = hashlib.sha256(_WHOLE_SALT + (namespace or "").encode() + b"\0")
    digest.update(_token_bytes(tokens))
    return digest.hexdigest()


@dataclass(frozen=True)
class DiskEntry:
    key: str
    num_bytes: int
    # A chunk: the position it ends at, and the chunk before it (None for the first).
    # A whole entry: its length, and its tokens (for the radix index).
    end: int
    namespace: str | None = None
    parent: str | None = None
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class DiskMatch:
    """Files that seed a prompt's first `num_tokens` tokens (chunks in order, or one whole entry)."""

    keys: list[str]
    num_tokens: int
    whole: bool


class DiskIndex:
    """Entries on disk by key: lookup by prompt, what an entry lacks, LRU eviction."""

    def __init__(self, *, chunk: int, whole: bool):
        self.chunk = chunk
        self.whole = whole
        self._entries: OrderedDict[str, DiskEntry] = OrderedDict()
        self._children: dict[str, set[str]] = {}
        self._radix = PrefixIndex()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> DiskEntry | None:
        return self._entries.get(key)

    def lookup(self, tokens: Sequence[int], max_tokens: int, namespace: str | None) -> DiskMatch | None:
        """The longest prefix of `tokens` (at most `max_tokens`) that files on disk seed."""
        if max_tokens <= 0:
            return None
        if self.whole:
            match = self._radix.lookup(tokens, max_tokens, whole=True, namespace=namespace)
            return DiskMatch([match.entry_id], match.num_tokens, whole=True) if match is not None else None
        # Chunks that hold at least one of the first `max_tokens` positions.
        span = min(len(tokens), -(-max_tokens // self.chunk) * self.chunk)
        found: list[str] = []
        for i, key in enumerate(chunk_keys(namespace, tokens[:span], self.chunk)):
            entry = self._entries.get(key)
            # A file's header says where its positions are: they must be where the prompt needs them.
            if entry is None or entry.end != (i + 1) * self.chunk or entry.parent != (found[-1] if found else None):
                break
            found.append(key)
        if not found:
            return None
        return DiskMatch(found, min(len(found) * self.chunk, max_tokens), whole=False)

    def wanted(self, tokens: Sequence[int], namespace: str | None) -> list[tuple[str, int, int, str | None]]:
        """What storing `tokens` would add: (key, start, end, parent key) per chunk not on disk,
        or the whole entry when it is not."""
        if self.whole:
            key = whole_key(namespace, tokens)
            return [] if key in self._entries else [(key, 0, len(tokens), None)]
        keys = chunk_keys(namespace, tokens, self.chunk)
        return [(key, i * self.chunk, (i + 1) * self.chunk, keys[i - 1] if i else None) for i, key in enumerate(keys) if key not in self._entries]

    def add(self, entry: DiskEntry) -> bool:
        """Index an entry written (or found at start); False when it cannot be reached (its
        parent chunk is not indexed, or it does not end a chunk after it: another chunk size),
        does not hold its tokens, or is already there."""
        if entry.key in self._entries or (entry.parent is not None and entry.parent not in self._entries):
            return False
        if self.whole and entry.end != len(entry.tokens):
            return False
        if not self.whole and entry.end != self.chunk + (self._entries[entry.parent].end if entry.parent is not None else 0):
            return False
        if self.whole and not self._radix.insert(entry.key, entry.tokens, entry.num_bytes, whole=True, namespace=entry.namespace):
            return False
        self._entries[entry.key] = entry
        self.num_bytes += entry.num_bytes
        if entry.parent is not None:
            self._children.setdefault(entry.parent, set()).add(entry.key)
            # A chain's first chunks stay the most recent (eviction shortens it from the end).
            self._touch_chain(entry.parent)
        return True

    def restore(self, entries: Sequence[DiskEntry]) -> list[str]:
        """Index entries found at start, given least recently used first; returns the keys of
        those that cannot be reached (a chunk whose parent is gone) or repeat another."""
        added = {entry.key for entry in sorted(entries, key=lambda e: e.end) if self.add(entry)}
        self.touch([entry.key for entry in reversed(entries) if entry.key in added])
        return [entry.key for entry in entries if entry.key not in added]

    def touch(self, keys: Sequence[str]) -> None:
        """A hit: deepest first, so the first chunk ends the most recent."""
        for key in reversed(keys):
            if key in self._entries:
                self._entries.move_to_end(key)
                if self.whole:
                    self._radix.touch(key)

    def _touch_chain(self, key: str | None) -> None:
        chain = []
        while key is not None and key in self._entries:
            chain.append(key)
            key = self._entries[key].parent
        self.touch(list(reversed(chain)))

    def remove(self, key: str) -> list[str]:
        """Forget an entry and the chunks after it; returns every key forgotten."""
        removed, stack = [], [key]
        while stack:
            current = stack.pop()
            entry = self._entries.pop(current, None)
            if entry is None:
                continue
            removed.append(current)
            self.num_bytes -= entry.num_bytes
            if self.whole:
                self._radix.remove(current)
            if entry.parent is not None and entry.parent in self._children:
                self._children[entry.parent].discard(current)
            stack.extend(self._children.pop(current, ()))
        return removed

    def evict_to(self, limit_bytes: int) -> list[str]:
        """Least recently used entries (and the chunks after them) until at most `limit_bytes`
        are indexed; returns every key forgotten."""
        removed: list[str] = []
        while self.num_bytes > limit_bytes and self._entries:
            removed += self.remove(next(iter(self._entries)))
        return removed
