"""The batch sampler against mlx-lm's samplers and logits processors."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from engine.sampler import BatchSampler, RowSampling, apply_filters, draw_key
from protocols.api import SamplingParams

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(0, 3, (rows, VOCAB)).astype(np.float32))


def _sampler(params: list[SamplingParams], contexts: list[list[int]], seeds: list[int] | None = None) -> BatchSampler:
    sampler = BatchSampler()
    for i, (p, ctx) in enumerate(zip(params, contexts)):
        sampler.add_row(RowSampling(p, seed=(seeds or list(range(len(params))))[i]), context=ctx)
    return sampler


def test_penalties_match_mlx_lm_processors():
    rng = np.random.default_rng(1)
    params = [
        SamplingParams(repetition_penalty=1.3, penalty_context_size=5),
        SamplingParams(),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, penalty_context_size=8),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5),
    ]
    contexts = [[int(t) for t in rng.integers(0, 12, n)] for n in (3, 7, 30, 25)]
    logits = _logits(len(params))
    got = _sampler(params, contexts).process(logits)
    for row, (p, ctx) in enumerate(zip(params, contexts)):
        expected = logits[row : row + 1]
        processors = make_logits_processors(
            repetition_penalty=p.repetition_penalty,
            repetition_context_size=p.penalty_context_size,
            presence_penalty=p.presence_penalty,
            presence_context_size=p.penalty_context_size,
            frequency_penalty=p.frequency_penalty,
            frequency_context_size=p.penalty_context_size,
        )
        for processor in processors:
            expected = processor(mx.array(ctx), expected)
        np.testing.assert_allclose(np.array(got[row]), np.array(expected[0]), rtol=1e-6, atol=1e-6)


def test_penalty_window_follows_sampled_tokens():
    """After sampling, the sampled token is part of the next step's penalty context."""
    params = [SamplingParams(presence_penalty=100.0, penalty_context_size=4)]
    sampler = _sampler(params, [[1, 2]])
    logits = mx.zeros((1, VOCAB)) + mx.array(np.eye(VOCAB, dtype=np.float32)[10])[None]
    first = sampler.sample(logits).tokens.item()
    second = sampler.sample(logits).tokens.item()
    assert first == 10 and second != 10


@pytest.mark.parametrize("kind", ["top_p", "min_p", "top_k"])
def test_filters_match_mlx_lm(kind):
    logits = _logits(4, seed=3)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    values = {"top_p": [0.5, 0.9, 1.0, 0.2], "min_p": [0.05, 0.0, 0.2, 0.5], "top_k": [1, 5, 0, 20]}[kind]
    params = [SamplingParams(**{kind: v}) for v in values]
    got = apply_filters(lp, params)
    for row, value in enumerate(values):
        one = lp[row : row + 1]
        if kind == "top_p":
            expected = apply_top_p(one, value) if value < 1.0 else one
        elif kind == "min_p":
            expected = apply_min_p(one, value) if value > 0 else one
        else:
            expected = apply_top_k(one, value) if value > 0 else one
        kept = np.isfinite(np.array(got[row]))
        assert kept.tolist() == np.isfinite(np.array(expected[0])).tolist(), f"{kind}={value}"
        assert kept.sum() >= 1


def test_greedy_rows_take_the_argmax():
    logits = _logits(5)
    result = _sampler([SamplingParams()] * 5, [[0]] * 5).sample(logits)
    assert result.tokens.tolist() == np.argmax(np.array(logits), axis=-1).tolist()


def test_seeded_draws_do_not_depend_on_batch_company():
    hot = SamplingParams(temperature=1.5, top_p=0.9, seed=42)
    logits = _logits(3, seed=5)
    alone = _sampler([hot], [[1, 2, 3]], seeds=[42])
    crowd = _sampler([SamplingParams(temperature=0.7), hot, SamplingParams()], [[4], [1, 2, 3], [5]], seeds=[1, 42, 2])
    for _ in range(6):
        a = alone.sample(logits[1:2]).tokens.item()
        b = crowd.sample(logits).tokens.tolist()[1]
        assert a == b


def test_sampling_follows_the_softmax_distribution():
    logits = mx.array([[2.0, 1.0, 0.0, -1.0]])
    probs = np.exp([2.0, 1.0, 0.0, -1.0])
    probs /= probs.sum()
    rows = 400
    sampler = _sampler([SamplingParams(temperature=1.0)] * rows, [[0]] * rows, seeds=list(range(rows)))
    draws = []
    for _ in range(5):
        draws += sampler.sample(mx.broadcast_to(logits, (rows, 4))).tokens.tolist()
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.abs(freq - probs).max() < 0.04


def test_distinct_seeds_give_distinct_streams():
    logits = mx.zeros((1, VOCAB))
    streams = []
    for seed in (1, 2):
        sampler = _sampler([SamplingParams(temperature=1.0)], [[0]], seeds=[seed])
        streams.append([sampler.sample(logits).tokens.item() for _ in range(10)])
    assert streams[0] != streams[1]
    assert draw_key(1, 0) != draw_key(1, 1) != draw_key(2, 0)


def test_logprobs_and_top_logprobs():
    logits = _logits(2, seed=9)
    sampler = BatchSampler()
    sampler.add_row(RowSampling(SamplingParams(), seed=0, logprobs=True, top_logprobs=3), context=[0])
    sampler.add_row(RowSampling(SamplingParams(temperature=1.0), seed=1, logprobs=True), context=[0])
    result = sampler.sample(logits)
    log_softmax = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    tokens = result.tokens.tolist()
    for row, token in enumerate(tokens):
        assert math.isclose(result.logprobs.tolist()[row], log_softmax[row, token], abs_tol=1e-5)
    top = sorted(result.top_ids.tolist()[0], key=lambda t: -log_softmax[0, t])
    assert top == list(np.argsort(-log_softmax[0])[:3])
    assert top[0] == tokens[0]


def test_reorder_keeps_rows_aligned():
    params = [SamplingParams(presence_penalty=50.0, penalty_context_size=1), SamplingParams(), SamplingParams(presence_penalty=50.0, penalty_context_size=1)]
    sampler = _sampler(params, [[3], [4], [5]])
    sampler.reorder([2, 1])
    logits = mx.zeros((2, VOCAB)) + mx.array(np.eye(VOCAB, dtype=np.float32)[5])[None]
    # Row 0 is now the request whose context is [5]: token 5 is penalised away.
    tokens = sampler.sample(logits).tokens.tolist()
    assert tokens[0] != 5 and tokens[1] == 5
