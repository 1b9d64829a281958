"""The decode batch's membership: rows join, leave and park (MLX thread).

`BatchRows` keeps three things row by row and in one order: the batch's KV slots
(`DecodeBatch`), each row's sampling state (`BatchSampler`) and each row's next input token
(`pending`). A request joins once its prefill is done (or, parked, once unparked), with its
KV; it leaves when it ends (its KV offered to the prefix cache first, by the engine) or parks,
keeping its KV outside the batch until it rejoins. A leaving request's KV is what it offers
the prefix cache (`kept_kv`). Speculation and known tokens are the
engine's to withdraw before a row parks.
"""

from __future__ import annotations

import mlx.core as mx

from engine.batch import DecodeBatch
from engine.kv import caches
from engine.kv.pool import BlockPool
from engine.sampler import BatchSampler, RowSampling
from engine.sequence import Sequence
from protocols.model import LayerLayout


class BatchRows:
    """The decode batch, its sampler rows and its pending input tokens, always in one row order."""

    def __init__(self, layout: list[LayerLayout], pool: BlockPool | None):
        self.batch = DecodeBatch(layout, pool)
        self.sampler = BatchSampler()
        self.pending: mx.array | None = None
        self._paged = pool is not None

    def join(self, seq: Sequence) -> None:
        """A ready request (`Sequence.is_ready`) becomes a row: its KV moves into the batch."""
        rid, admit, context = seq.request_id, seq.admit, seq.context
        self.batch.add_row(rid, seq.cache or [], seq.num_prefilled, table=seq.table if self._paged else None, shift=seq.position_shift)
        # Everything the cache lacks is fed next: usually the last token, more after a park
        # (the sampler counts those when they are appended, like any appended token).
        seq.extra = context[seq.num_prefilled + 1 :]
        sampled = len(seq.generated) - len(seq.extra)
        row = RowSampling(
            admit.sampling,
            admit.seed,
            admit.logprobs,
            admit.top_logprobs,
            num_sampled=sampled,
            stop_ids=tuple(admit.stop_token_ids) if admit.sampling.min_tokens else (),
            bad_words=tuple(tuple(word) for word in admit.bad_words_ids),
        )
        self.sampler.add_row(row, context=context[: seq.num_prefilled + 1], generated=seq.generated[: max(0, sampled)])
        last = mx.array([context[seq.num_prefilled]], dtype=mx.uint32)
        self.pending = last if self.pending is None else mx.concatenate([self.pending, last])
        seq.cache = None
        seq.in_batch = seq.joined = True

    def remove(self, seq: Sequence) -> None:
        """The row leaves (its KV is dropped with it: extract it first to keep it)."""
        order = self.batch.remove_row(seq.request_id)
        self.sampler.reorder(order)
        self.pending = self.pending[mx.array(order, dtype=mx.int32)] if order and self.pending is not None else None
        seq.in_batch = False

    def park(self, seq: Sequence) -> None:
        """The row leaves with its KV, which the request keeps until it rejoins."""
        seq.num_prefilled = self.batch.lengths[self.batch.index(seq.request_id)]
        seq.cache = self.batch.extract(seq.request_id)
        self.remove(seq)
        seq.joined = False

    def kept_kv(self, seq: Sequence, trimmable: bool) -> tuple[list, int] | None:
        """What a leaving request can offer the prefix cache: caches of its prompt and every
        token fed (in the batch or not), and their length; None when there is nothing."""
        if seq.in_batch:
            length = self.batch.lengths[self.batch.index(seq.request_id)]
            # A span still being checked (a cancel mid-round) is not known to be the output.
            verified = min(length, len(seq.context))
            if verified < length and not trimmable:
                return None
            kept = self.batch.extract(seq.request_id)
            return (kept if verified == length else caches.trimmed(kept, verified)), verified
        if seq.cache is not None and seq.num_prefilled:
            return caches.trimmed(seq.cache, seq.num_prefilled), seq.num_prefilled
        return None
