"""A draft model's rows beside the target's, on the MLX thread.

Each request that speculates with the draft model has draft KV covering some prefix of its
context: prefilled with the target's prompt chunks (`prefill`), then kept in the draft's own
decode batch. A round (`propose`) first feeds the draft whatever of the context it has not
seen (at least the token the target is about to forward), then drafts k tokens one batched
forward at a time, drawing each like the target will at that position (the same keyed Gumbel
noise over the draft's own distribution, so when the two models agree the draws agree too:
sampled rows keep drafts about as often as greedy ones). After the target's check, `settle`
rewinds the draft to the kept tokens. Rows of parked or released requests leave the draft
batch; a row rejoins with its KV, or catches up from its context.

Nothing here decides who speculates (`policies.speculation`) or keeps tokens (the sampler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.batch import DecodeBatch
from engine.compiled import compile_decode_step
from engine.kv import caches
from engine.kv.attention import install as install_attention
from engine.lanes import install as install_lanes
from engine.sampler import RowSampling, draft_draws
from policies.layout import has_state
from protocols.errors import ModelLoadError
from protocols.model import LayerLayout

# Prompt positions a catch-up forwards at once (bounds its attention's memory).
CATCH_UP_CHUNK = 256


@dataclass
class DraftRow:
    """One row's round: its context (prompt and generated; the last token is the target's
    pending input), how many tokens to draft, and its sampling (keys, temperature, filters)."""

    request_id: str
    context: list[int]
    num_draft: int
    sampling: RowSampling


@dataclass
class Drafts:
    """A round's drafts: tokens per row (host lists, cut short only by `num_draft`), and with
    `want_logprobs` the draft's log-probabilities at each drafted position
    (`[rows, max_draft, vocab]`, for rejection sampling)."""

    tokens: list[list[int]]
    logprobs: mx.array | None = None


class DraftRunner:
    """The draft model's caches and batch; one instance per engine."""

    def __init__(self, model, layout: list[LayerLayout]):
        if has_state(layout):
            raise ModelLoadError("the draft model has recurrent layers: a rejected draft cannot be rewound there")
        self._model = model
        self._layout = layout
        install_attention(model)  # its decode steps attend with grouped heads stacked too
        install_lanes(model)
        self._batch = DecodeBatch(layout)
        # A lone drafting row's one-token steps run compiled (no graph build per draft token).
        self._step = compile_decode_step(model, layout)
        # KV of requests outside the draft batch (prefilling, parked), and what each covers.
        self._caches: dict[str, list] = {}
        self._covered: dict[str, int] = {}
        # Drafted positions of the last round, per row: rewound by `settle`.
        self._in_round: dict[str, tuple[int, int]] = {}

    def prefill(self, request_id: str, tokens: list[int]) -> None:
        """The target's KV covers `tokens` (a prompt chunk prefilled, after a prefix hit or a
        resume perhaps): the draft catches up to the same tokens."""
        covered = self._covered.get(request_id, 0)
        if covered >= len(tokens):
            return
        cache = self._caches.setdefault(request_id, make_prompt_cache(self._model))
        for begin in range(covered, len(tokens), CATCH_UP_CHUNK):
            self._model(mx.array(tokens[begin : begin + CATCH_UP_CHUNK])[None], cache=cache)
            mx.eval([c.state for c in cache])
        self._covered[request_id] = len(tokens)

    def propose(self, rows: list[DraftRow], want_logprobs: bool = False) -> Drafts:
        """Draft `num_draft` tokens for each row (all rows of one round, batched)."""
        indices = [self._join(row) for row in rows]
        feeds = [row.context[self._covered[row.request_id] :] for row in rows]
        # Feed what the draft lacks (at least the pending token); its last position drafts token 1.
        logits = self._batch.forward_rows(self._model, indices, feeds)
        last = logits[mx.arange(len(rows)), mx.array([len(f) - 1 for f in feeds])]
        samplings = [row.sampling for row in rows]
        token, logprobs = draft_draws(last, samplings, offset=0)
        drafted, all_logprobs = [token], [logprobs]
        for row, feed in zip(rows, feeds):
            self._covered[row.request_id] += len(feed)
        longest = max(row.num_draft for row in rows)
        for j in range(1, longest):
            active = [i for i, row in enumerate(rows) if row.num_draft > j]
            sub = mx.array(active, dtype=mx.int32)
            if len(self._batch) == 1:
                out = self._batch.forward_one(self._step, drafted[-1][sub])
            else:
                self._batch.begin_step([1] * len(active), rows=[indices[i] for i in active])
                out = self._model(drafted[-1][sub][:, None], cache=self._batch.layers)[:, -1, :]
                self._batch.end_step()
            token_j, logprobs_j = draft_draws(out, [samplings[i] for i in active], offset=j)
            drafted.append(mx.zeros_like(token).at[sub].add(token_j))
            if want_logprobs:
                all_logprobs.append(mx.zeros_like(all_logprobs[0]).at[sub].add(logprobs_j))
            for i in active:
                self._covered[rows[i].request_id] += 1
        stacked = mx.stack(drafted, axis=1)
        lp = mx.stack(all_logprobs, axis=1) if want_logprobs else None
        mx.eval(stacked) if lp is None else mx.eval(stacked, lp)
        values = cast(list[list[int]], stacked.tolist())
        tokens = [drafted_row[: row.num_draft] for drafted_row, row in zip(values, rows)]
        for row in rows:
            # The draft's KV now ends at draft token num_draft - 1 (the last one is never fed).
            self._in_round[row.request_id] = (len(row.context), row.num_draft)
        return Drafts(tokens=tokens, logprobs=lp)

    def settle(self, request_id: str, accepted: int) -> None:
        """The target kept `accepted` drafted tokens: forget the draft's KV past them."""
        base, num_draft = self._in_round.pop(request_id, (None, 0))
        if base is None or request_id not in self._batch.row_ids:
            return
        keep = base + min(accepted, num_draft - 1)
        excess = self._covered[request_id] - keep
        if excess > 0:
            self._batch.rewind(request_id, excess)
            self._covered[request_id] = keep

    def park(self, request_id: str) -> None:
        """The request leaves the batch for a while: its draft KV leaves with it (without a
        round's drafts nobody checked)."""
        self.settle(request_id, 0)
        if request_id in self._batch.row_ids:
            self._caches[request_id] = self._batch.extract(request_id)
            self._covered[request_id] = self._batch.lengths[self._batch.index(request_id)]
            self._batch.remove_row(request_id)

    def release(self, request_id: str) -> None:
        self._in_round.pop(request_id, None)
        self._caches.pop(request_id, None)
        self._covered.pop(request_id, None)
        if request_id in self._batch.row_ids:
            self._batch.remove_row(request_id)

    def reset(self) -> None:
        self._batch = DecodeBatch(self._layout)
        self._caches.clear()
        self._covered.clear()
        self._in_round.clear()

    @property
    def nbytes(self) -> int:
        return self._batch.nbytes + sum(caches.nbytes(c) for c in self._caches.values())

    def _join(self, row: DraftRow) -> int:
        """The row's index in the draft batch, joining it first; a row far behind its context
        (a long pause from speculating) catches up alone, a chunk at a time, so the round's
        batched feed stays short."""
        rid = row.request_id
        if rid not in self._batch.row_ids:
            cache = self._caches.pop(rid, None)
            covered = self._covered.get(rid, 0) if cache is not None else 0
            self._batch.add_row(rid, cache or [], covered)
            self._covered[rid] = covered
        index = self._batch.index(rid)
        while len(row.context) - self._covered[rid] > CATCH_UP_CHUNK:
            start = self._covered[rid]
            self._batch.forward_rows(self._model, [index], [row.context[start : start + CATCH_UP_CHUNK]])
            self._covered[rid] = start + CATCH_UP_CHUNK
        return index
