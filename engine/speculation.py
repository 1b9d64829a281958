"""Speculative decoding in the shared batch: drafts in, checked spans out.

Before a step is built, `propose` gives the rows that speculate this step a draft (from the
draft model, all of them in one batched round, or by prompt lookup) as known tokens to
verify: the engine appends them in its forward over just those rows, and the sampler's
`SpanCheck` samples every position as plain decoding would and keeps the agreeing prefix
(or, with rejection acceptance, keeps by min(1, p/q)). After the step is read, `settle`
rewinds what was not kept (target and draft) and records the round. Rows that do not
speculate decode in the same step as always. A draft never holds a stop token or more than
the request may still generate, and a grammar row's drafts are checked by its matcher, so
a draft token the grammar rejects ends what can be kept.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

from engine.batch import DecodeBatch
from engine.draft import DraftRow, DraftRunner
from engine.sampler import RowSampling, SpanCheck
from engine.sequence import Sequence
from policies.speculation import LookupSource, SpecRow, SpeculationGate

# A round's cost in plain target steps, fitted to one stream's rounds at fixed k = 1..8 on this
# machine's CPU backend (bench-spec drafted by bench-spec-draft, 128 tokens x 3 prompts): a round
# took 1.18 pipelined plain steps plus 0.19 per drafted token. The round's own overhead (it waits
# for its drafts and its check, where plain steps overlap the host with the device) is
# ROUND_OVERHEAD; of the 0.19 per token the draft's forward is its parameter ratio (0.14), and
# checking the token in the target's forward is VERIFY_TOKEN_COST.
ROUND_OVERHEAD = 0.18
VERIFY_TOKEN_COST = 0.05


class Speculator:
    """Drafts and their settlement for one engine."""

    def __init__(self, draft: DraftRunner | None = None, gate: SpeculationGate | None = None, draft_cost: float = 0.0):
        self.draft = draft
        self.gate = gate or SpeculationGate()
        # A drafted token's cost in plain target steps, by method.
        self._token_cost = {"draft": draft_cost + VERIFY_TOKEN_COST, "lookup": VERIFY_TOKEN_COST}
        self._logprobs: mx.array | None = None
        self._logprob_rows: dict[int, int] = {}

    def start(self, seq: Sequence) -> None:
        """A new request that speculates: its adaptive state and, for prompt lookup, its index."""
        plan = seq.admit.spec
        assert plan is not None
        seq.spec = SpecRow(plan, token_cost=self._token_cost[plan.method], round_overhead=ROUND_OVERHEAD)
        if plan.method == "lookup":
            seq.lookup = LookupSource(plan.lookup_anchor, plan.max_draft, seq.context)
        elif self.draft is None:
            raise ValueError("a request planned to draft with a draft model, but none is loaded")

    def propose(self, rows: list[Sequence], samplings: list[RowSampling], lengths: list[int]) -> None:
        """Give this step's speculating rows a draft (`seq.extra`, `seq.draft`). `lengths`: each
        row's KV positions; a row whose last sampled token is still in flight (its context
        ends at its KV) does not draft this step: the draft continues the whole context."""
        self._logprobs, self._logprob_rows = None, {}
        if not any(seq.spec is not None for seq in rows):
            return
        allowed = self.gate.allows(len(rows))
        from_model: list[tuple[int, Sequence, int]] = []
        for i, seq in enumerate(rows):
            if seq.spec is None:
                continue
            seq.spec.gated = not allowed
            if not allowed or seq.extra or seq.verify is not None or seq.failure is not None:
                continue
            num_draft = seq.spec.draft_length(seq.admit.max_tokens - seq.num_generated - 1)  # (counts a pause down)
            stale = len(seq.context) != lengths[i] + 1
            if num_draft == 0 or stale or (seq.matcher is not None and seq.matcher.is_terminated()):
                continue
            if seq.lookup is not None:
                tokens = seq.lookup.propose(num_draft)
                if not tokens:
                    seq.spec.record_miss()
                self._set_draft(seq, tokens)
            else:
                from_model.append((i, seq, num_draft))
        if from_model:
            assert self.draft is not None
            wanted = [DraftRow(seq.request_id, seq.context, num_draft, samplings[i]) for i, seq, num_draft in from_model]
            rejection = any(seq.admit.spec is not None and seq.admit.spec.acceptance == "rejection" for _, seq, _ in from_model)
            drafts = self.draft.propose(wanted, want_logprobs=rejection)
            for j, ((_, seq, _), tokens) in enumerate(zip(from_model, drafts.tokens)):
                if not self._set_draft(seq, tokens):
                    self.draft.settle(seq.request_id, 0)  # cut to nothing: the draft forgets its round
                self._logprob_rows[id(seq)] = j
            self._logprobs = drafts.logprobs

    def check(self, rows: list[Sequence], appending: list[int], sub_logits: mx.array, logits: mx.array, vocab: int) -> tuple[SpanCheck, list[Sequence]] | None:
        """The sampler's check of every row that forwarded a span to verify this step (drafts
        and echo spans), and those rows in check order."""
        checked = [(a, i) for a, i in enumerate(appending) if rows[i].verify is not None or rows[i].draft is not None]
        if not checked:
            return None
        spans = [rows[i].extra for _, i in checked]
        positions = max(len(span) for span in spans) + 1
        sub = sub_logits[mx.array([a for a, _ in checked], dtype=mx.int32)][:, : positions - 1]
        full = mx.concatenate([sub, mx.zeros((len(checked), 1, sub.shape[-1]), sub.dtype)], axis=1)
        full[mx.arange(len(checked)), mx.array([len(span) for span in spans])] = logits[mx.array([i for _, i in checked], dtype=mx.int32)]
        seqs = [rows[i] for _, i in checked]
        rejection = [seq.draft is not None and seq.admit.spec is not None and seq.admit.spec.acceptance == "rejection" for seq in seqs]
        draft_logprobs = None
        if any(rejection) and self._logprobs is not None:
            # Rows drafted by prompt lookup propose a point mass; the model's rows their distribution.
            lp = self._logprobs[:, : positions - 1]
            if lp.shape[1] < positions - 1:
                lp = mx.pad(lp, [(0, 0), (0, positions - 1 - lp.shape[1]), (0, 0)], constant_values=-np.inf)
            picks = [self._logprob_rows.get(id(seq), -1) for seq in seqs]
            point = mx.log((mx.arange(vocab)[None, None, :] == _padded(spans, positions - 1)[:, :, None]).astype(mx.float32))
            from_model = mx.array([p >= 0 for p in picks])[:, None, None]
            draft_logprobs = mx.where(from_model, lp[mx.array([max(p, 0) for p in picks], dtype=mx.int32)], point)
        masks = _span_masks(seqs, spans, positions, vocab) if any(seq.matcher is not None for seq in seqs) else None
        return SpanCheck(rows=[i for _, i in checked], spans=spans, logits=full, masks=masks, rejection=rejection, draft_logprobs=draft_logprobs), seqs

    def settle(self, seq: Sequence, batch: DecodeBatch, accepted: int) -> list[int]:
        """After the step is read: a drafted row keeps `accepted` tokens of its draft (the rest
        is rewound in target and draft); returns the kept tokens."""
        draft, seq.draft = seq.draft, None
        assert draft is not None and seq.spec is not None
        batch.rewind(seq.request_id, len(draft) - accepted)  # (a recurrent target then replays)
        if self.draft is not None and seq.lookup is None:
            self.draft.settle(seq.request_id, accepted)
        seq.spec.record_round(len(draft), accepted)
        kept = draft[:accepted]
        if seq.matcher is not None:
            for token in kept:
                if not seq.matcher.accept_token(token):
                    raise RuntimeError(f"the grammar rejected kept draft token {token}")
        return kept

    def withdraw(self, seq: Sequence) -> None:
        """The row leaves the batch before its draft was forwarded."""
        if seq.draft is not None:
            seq.draft, seq.extra = None, []

    def park(self, seq: Sequence) -> None:
        if self.draft is not None:
            self.draft.park(seq.request_id)

    def release(self, request_id: str) -> None:
        if self.draft is not None:
            self.draft.release(request_id)

    @staticmethod
    def _set_draft(seq: Sequence, tokens: list[int]) -> bool:
        """A draft is cut before a stop token (sampling one is the target's call) and, for a
        grammar row, before the first token its grammar would not accept. False when nothing
        is left to check."""
        cut = next((j for j, t in enumerate(tokens) if t in seq.stop_ids), len(tokens))
        tokens = tokens[:cut]
        if seq.matcher is not None and tokens:
            ok = 0
            while ok < len(tokens) and seq.matcher.accept_token(tokens[ok]):
                ok += 1
            if ok:
                seq.matcher.rollback(ok)
            tokens = tokens[:ok]
        if tokens:
            seq.extra, seq.draft = list(tokens), list(tokens)
        return bool(tokens)


def _padded(spans: list[list[int]], width: int) -> mx.array:
    return mx.array([span + [-1] * (width - len(span)) for span in spans], dtype=mx.int32)


def _span_masks(seqs: list[Sequence], spans: list[list[int]], positions: int, vocab: int) -> mx.array:
    """Each position's grammar bitmask along each row's span (all allowed for rows without a
    grammar, and past a token the grammar rejects); the matchers end where they started."""
    words = (vocab + 31) // 32
    bitmask = np.full((len(seqs) * positions, words), -1, dtype=np.int32)
    tensor = torch.from_numpy(bitmask)
    for i, (seq, span) in enumerate(zip(seqs, spans)):
        if seq.matcher is None:
            continue
        taken = 0
        for j in range(len(span) + 1):
            seq.matcher.fill_next_token_bitmask(tensor, i * positions + j)
            if j == len(span) or not seq.matcher.accept_token(span[j]):
                break
            taken += 1
        if taken:
            seq.matcher.rollback(taken)
    return mx.array(bitmask).reshape(len(seqs), positions, words)
