"""Saved prefix entries on the MLX thread: the KV requests left behind, by entry id.

The KV store's ledger decides which entries stay (`policies.ledger`); this keeps their arrays
and starts requests from them. An entry is per-layer mlx-lm caches (`engine.kv.caches`). With
paged KV (`engine.kv.paged`) its paged layers' positions stay in the pool blocks the request
wrote them to, which the entry holds (no copy), and a request seeded from an entry holds the
entry's full blocks for as long as it runs (shared, no copy); the positions past the last
full block are copied into a block of its own, which it then writes on (copy on write).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_lm.models.cache import KVCache

from engine.errors import EngineInvariantError
from engine.kv import caches
from engine.kv.paged import PagedKV, PagedRef, map_paged
from engine.kv.pool import BlockPool
from engine.kv.quantized import packed_nbytes
from engine.kv.request import KvRequest
from policies.adapters import prefix_namespace
from policies.blocks import blocks_for
from protocols.model import LayerLayout, SavedPrefix


@dataclass
class Entry:
    caches: list  # per layer; a paged layer's is a `PagedRef` (its positions are in `blocks`)
    length: int
    blocks: list[int] = field(default_factory=list)


class PrefixEntries:
    """Entries by id, and the ones saved since the last step outcome (for the ledger)."""

    def __init__(self, layout: list[LayerLayout], pool: BlockPool | None, trimmable: bool):
        self._layout = layout
        self._pool = pool
        self._trimmable = trimmable
        self._entries: dict[str, Entry] = {}
        self._saved: list[SavedPrefix] = []
        self._num_saved = 0
        self.nbytes = 0  # outside the pool (the pool's bytes are counted whole)

    def __len__(self) -> int:
        return len(self._entries)

    def holders(self) -> list[tuple[int, int]]:
        """(positions, blocks) of every entry, for the pool's fragmentation figure."""
        return [(entry.length, len(entry.blocks)) for entry in self._entries.values()]

    def save(self, seq: KvRequest, kept: list, length: int) -> None:
        """Keep a request's first `length` positions: `kept` (copies the entry now owns, or
        paged layers' `PagedKV`/`PagedRef`, whose blocks in the request's table it holds)."""
        blocks: list[int] = []
        parent, inherited = None, 0
        if self._pool is not None:
            blocks = seq.table[: blocks_for(length, self._pool.block_size)]
            if len(blocks) * self._pool.block_size < length:
                raise EngineInvariantError(f"request {seq.request_id!r} holds {len(blocks)} blocks for {length} positions")
            self._pool.allocator.hold(blocks)
            parent, inherited = self._parent(seq, len(blocks))
            kept = map_paged(kept, self._layout, lambda cache, ordinal: PagedRef(ordinal))
        self._num_saved += 1
        entry_id = f"{seq.request_id}#{self._num_saved}"
        own = caches.nbytes(kept)
        self._entries[entry_id] = Entry(kept, length, blocks)
        self.nbytes += own
        shared = 0
        if self._pool is not None:
            own += (len(blocks) - inherited) * self._pool.block_bytes
            shared = inherited * self._pool.block_bytes
            seq.saved_entry = (entry_id, len(blocks))
        adapter = prefix_namespace(seq.admit.adapter, seq.admit.adapter_digest)
        tokens = seq.tokens_with_kv(length)
        self._saved.append(SavedPrefix(entry_id=entry_id, tokens=tokens, num_bytes=own, adapter=adapter, parent=parent, shared_bytes=shared))

    def _parent(self, seq: KvRequest, num_blocks: int) -> tuple[str | None, int]:
        """The entry whose first blocks a new entry of `seq` shares, and how many: an earlier
        entry of the same request (its table's blocks, the partial last one too) while it is
        kept, else the entry `seq` was seeded from (its full blocks)."""
        if seq.saved_entry is not None and seq.saved_entry[0] in self._entries and seq.saved_entry[1] <= num_blocks:
            return seq.saved_entry
        if seq.num_shared:
            return seq.admit.prefix_entry, min(seq.num_shared, num_blocks)
        return None, 0

    def seed(self, entry_id: str, num_tokens: int, seq: KvRequest) -> list:
        """Caches starting `seq` from an entry's first `num_tokens` positions. Paged layers:
        the entry's full blocks among them become the first of `seq.table`, held for it; the
        rest is copied into a block of its own."""
        entry = self._entries.get(entry_id)
        n = num_tokens
        if entry is None or not 0 < n <= min(entry.length, seq.prompt_len - 1) or (not self._trimmable and n != entry.length):
            raise EngineInvariantError(f"prefix {entry_id!r} cannot seed {n} tokens")
        view = caches.prefix_view(entry.caches, n)
        pool = self._pool
        if pool is None:
            return view
        if seq.table:
            raise EngineInvariantError(f"request {seq.request_id!r} seeded with blocks of its own")
        shared = entry.blocks[: n // pool.block_size]
        pool.allocator.hold(shared)
        seq.table += shared
        seq.num_shared = len(shared)
        pool.ensure(seq.table, n, expected=seq.prompt_len + seq.admit.max_tokens, shared=len(shared))
        pool.copy_positions(entry.blocks, seq.table, len(shared) * pool.block_size, n)
        return map_paged(view, self._layout, lambda cache, ordinal: PagedKV(pool, ordinal, seq.table, n))

    def caches_of(self, entry_id: str) -> list:
        """An entry's caches, paged layers read out of the pool as contiguous copies (tests,
        inspection)."""
        entry = self._entries[entry_id]
        if self._pool is None:
            return entry.caches
        pool = self._pool

        def read(cache: Any, ordinal: int) -> KVCache:
            out = KVCache()
            paged = PagedKV(pool, ordinal, entry.blocks, entry.length)
            out.keys, out.values, out.offset = paged.keys, paged.values, entry.length
            return out

        return map_paged(entry.caches, self._layout, read)

    def export(self, entry_id: str, spans: list[tuple[int, int]], whole: bool) -> list[dict]:
        """Numpy copies of an entry's positions (the disk tier's files): per span, or whole."""
        entry = self._entries[entry_id]
        kept = self.caches_of(entry_id)
        if whole:
            return [caches.tensor_arrays(kept, self._layout, entry.length)]
        if any(end > entry.length for _, end in spans):
            raise EngineInvariantError(f"prefix {entry_id!r} holds {entry.length} positions, not {max(end for _, end in spans)}")
        return caches.chunk_arrays(kept, self._layout, spans)

    def drop(self, entry_ids: list[str]) -> None:
        for entry_id in entry_ids:
            entry = self._entries.pop(entry_id, None)
            if entry is not None:
                self.nbytes -= caches.nbytes(entry.caches)
                if self._pool is not None and entry.blocks:
                    self._pool.allocator.release(entry.blocks)

    def take_saved(self) -> list[SavedPrefix]:
        saved, self._saved = self._saved, []
        return saved

    def quantized_bytes(self) -> int:
        return packed_nbytes([c for entry in self._entries.values() for c in entry.caches])
