"""Speculative acceptance in the sampler: `exact` keeps drafts the row's own draw agrees with;
`rejection` (standard speculative sampling) keeps the target's distribution.

The goodness-of-fit test draws many rows, each with its own seed: a draft token from the
draft's distribution q (drawn the way the draft runner draws, `draft_draws`), checked against
the target's p by the sampler; the first emitted token must follow p (Pearson's chi-square at a
fixed 0.1% threshold; the draws are keyed, so the outcome is the same on every run). The same
statistic on the draft's own tokens shows the test can tell the two apart.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.sampler import BatchSampler, RowSampling, SpanCheck, draft_draws
from protocols.api import SamplingParams

# chi-square critical value, 7 degrees of freedom, p = 0.001.
CHI2_7_999 = 24.322
P = np.array([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
Q = np.array([0.05, 0.10, 0.40, 0.05, 0.20, 0.05, 0.10, 0.05])


def _chi2(tokens: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(p))
    expected = p * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def _round(n: int, span: int, acceptance: str, params: SamplingParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n rows draft `span` tokens from Q and are checked against P at every position; returns
    the drafts, the kept counts and the token after the kept drafts."""
    sampler = BatchSampler()
    rows = [RowSampling(params, seed=1000 + i) for i in range(n)]
    for row in rows:
        sampler.add_row(row, [])
    q_logits = mx.broadcast_to(mx.log(mx.array(Q, dtype=mx.float32)), (n, len(Q)))
    p_logits = mx.broadcast_to(mx.log(mx.array(P, dtype=mx.float32)), (n, span + 1, len(P)))
    drafts, logprobs = [], []
    for j in range(span):
        tokens, lp = draft_draws(q_logits, rows, offset=j)
        drafts.append(tokens)
        logprobs.append(lp)
    spans = mx.stack(drafts, axis=1).tolist()
    check = SpanCheck(
        rows=list(range(n)),
        spans=spans,  # type: ignore[arg-type]
        logits=p_logits,
        rejection=[acceptance == "rejection"] * n,
        draft_logprobs=mx.stack(logprobs, axis=1),
    )
    result = sampler.sample(mx.zeros((n, len(P))), check=check)
    assert result.accepted is not None
    return np.array(spans), np.array(result.accepted), np.array(result.tokens)


def test_rejection_sampling_keeps_the_targets_distribution():
    n = 6000
    spans, accepted, after = _round(n, 2, "rejection", SamplingParams(temperature=1.0))
    # The first emitted token: the first draft if kept, else the token drawn in its place.
    first = np.where(accepted > 0, spans[:, 0], after)
    assert _chi2(first, P) < CHI2_7_999
    # ... and the second, among rows that kept the first draft.
    kept = accepted > 0
    second = np.where(accepted[kept] > 1, spans[kept, 1], after[kept])
    assert _chi2(second, P) < CHI2_7_999
    # Acceptance is sum(min(p, q)) per position.
    assert abs(kept.mean() - np.minimum(P, Q).sum()) < 0.03
    # The statistic has the power to reject a wrong distribution: the draft's own tokens.
    assert _chi2(spans[:, 0], P) > 10 * CHI2_7_999


def test_exact_acceptance_emits_what_the_row_would_have_drawn_alone():
    n = 400
    params = SamplingParams(temperature=1.0)
    spans, accepted, after = _round(n, 3, "exact", params)
    # Without a draft: the same rows sample three tokens from P one step at a time.
    sampler = BatchSampler()
    rows = [RowSampling(params, seed=1000 + i) for i in range(n)]
    for row in rows:
        sampler.add_row(row, [])
    logits = mx.broadcast_to(mx.log(mx.array(P, dtype=mx.float32)), (n, len(P)))
    alone = np.stack([np.array(sampler.sample(logits).tokens) for _ in range(4)], axis=1)
    for i in range(n):
        k = int(accepted[i])
        assert list(spans[i, :k]) == list(alone[i, :k]) and after[i] == alone[i, k]
        assert k == 3 or spans[i, k] != alone[i, k]
    # Draws coupled through the row's keys agree more often than independent ones would.
    assert (accepted > 0).mean() > np.minimum(P, Q).sum() - 0.05
