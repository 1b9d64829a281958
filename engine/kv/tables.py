"""Paged KV on the request side (MLX thread): each request's block table, admission to release.

`RequestBlocks` is what the engine asks of the pool (`engine.kv.pool.BlockPool`): the blocks a
step's prompt chunks need, and caches that write into them, before any forward; a request's
contiguous caches moved into its blocks (a restored checkpoint, a batched first chunk); its
blocks given back when it ends; the pool's figures over every holder. Without a pool (no
`kv.block_size`) every call leaves things as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx

from engine.kv.paged import PagedKV, map_paged
from engine.kv.pool import BlockPool
from engine.kv.quantized import new_caches
from engine.kv.request import KvRequest
from protocols.model import KvPool, LayerLayout

SHRINK_POOL_EVERY = 64  # steps


class RequestBlocks:
    def __init__(self, pool: BlockPool | None, layout: list[LayerLayout], model):
        self.pool = pool
        self._layout = layout
        self._model = model
        self._steps_since_shrink = 0

    @property
    def used_bytes(self) -> int:
        return self.pool.used_bytes if self.pool is not None else 0

    def ready(self, chunks: Iterable[tuple[KvRequest, int]], in_flight: list[mx.array]) -> None:
        """Blocks for each `(request, tokens)` chunk about to be prefilled, and caches writing
        into them for requests that have none yet (a pool grown mid-forward is evaluated there).
        A decode step `in_flight` reads the pool, and a write meanwhile would copy the whole
        pool: it is waited for first (only then: a step without chunks keeps decode pipelined)."""
        chunks = list(chunks)
        if self.pool is None or not chunks:
            return
        if in_flight:
            mx.eval(in_flight)
        for seq, num_tokens in chunks:
            self.pool.ensure(seq.table, seq.num_prefilled + num_tokens, expected=_expected(seq), shared=seq.num_shared)
            if seq.cache is None:
                seq.cache = self.into_pool(seq, new_caches(self._model, self._layout), 0)

    def into_pool(self, seq: KvRequest, caches: list, length: int) -> list:
        """The caches with each paged layer's first `length` positions in `seq`'s blocks (a
        `PagedKV`; a contiguous `KVCache` is copied in)."""
        pool = self.pool
        if pool is None:
            return caches
        pool.ensure(seq.table, length, expected=_expected(seq), shared=seq.num_shared)

        def move(cache, ordinal: int) -> PagedKV:
            if type(cache) is PagedKV:
                return cache
            if length:
                pool.write_positions(ordinal, seq.table, cache.keys[..., :length, :], cache.values[..., :length, :], 0)
            return PagedKV(pool, ordinal, seq.table, length)

        moved = map_paged(caches, self._layout, move)
        pool.evaluate()
        return moved

    def after_step(self) -> None:
        """Now and then, give back the pool's free tail (`BlockPool.shrink`)."""
        self._steps_since_shrink += 1
        if self.pool is not None and self._steps_since_shrink >= SHRINK_POOL_EVERY:
            self.pool.shrink()
            self._steps_since_shrink = 0

    def release(self, seq: KvRequest) -> None:
        if self.pool is not None:
            self.pool.release(seq.table)

    def stats(self, positions: dict[str, int], seqs: Iterable[KvRequest], entries: list[tuple[int, int]]) -> KvPool | None:
        """The pool's figures; `positions`: each request's KV positions, `entries`: (positions,
        blocks) of each prefix entry."""
        if self.pool is None:
            return None
        requests = [(positions.get(seq.request_id, 0), len(seq.table)) for seq in seqs]
        return self.pool.stats(requests + entries)


def _expected(seq: KvRequest) -> int:
    """The most positions a request's KV can take: its prompt and its whole generation."""
    return seq.prompt_len + seq.admit.max_tokens
