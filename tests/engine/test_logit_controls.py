"""Per-request logits controls (`logit_bias`, `min_tokens`, `allowed_token_ids`, `bad_words`) on
the engine with builtin:tiny, against mlx-lm's `generate_step` with equivalent logits processors
(`make_logits_processors(logit_bias=...)` and vLLM's semantics for the others); rows without
controls batched beside them stay exactly mlx-lm's greedy streams."""

from __future__ import annotations

import math
from itertools import takewhile

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from engine.engine import Engine
from engine.kv.layout import probe_layout
from engine.sampler import BatchSampler, RowSampling
from protocols.api import SamplingParams
from protocols.model import AdmitRequest, StepPlan
from tests.support.engine_driver import Driver, random_prompts
from tests.support.mlx_reference import greedy_ids, load_reference

MAX_TOKENS = 12
PROMPTS = random_prompts([9, 5, 14, 3, 7, 11])


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_reference("builtin:tiny")


def _admit(rid: str, prompt: list[int], *, stop=(), bad_words_ids=(), max_tokens: int = MAX_TOKENS, seed: int = 0, **sampling) -> AdmitRequest:
    return AdmitRequest(
        request_id=rid,
        prompt_ids=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(**sampling),
        seed=seed,
        stop_token_ids=list(stop),
        bad_words_ids=[list(word) for word in bad_words_ids],
    )


def _driver(model_and_tokenizer) -> Driver:
    model, tokenizer = model_and_tokenizer
    return Driver(Engine(model, probe_layout(model), None, tokenizer.decode))


def _run(model_and_tokenizer, *admits: AdmitRequest) -> Driver:
    driver = _driver(model_and_tokenizer)
    driver.admit(*admits)
    driver.run()
    return driver


def _reference(model, prompt: list[int], processors, stop=(), max_tokens: int = MAX_TOKENS) -> list[int]:
    """mlx-lm's greedy tokens under `processors`, up to a stop token (not included)."""
    return list(takewhile(lambda token: token not in stop, greedy_ids(model, prompt, max_tokens, logits_processors=processors)))


# vLLM's semantics as mlx-lm logits processors (`tokens` is the prompt and the tokens generated so far).


def _min_tokens(prompt_len: int, min_tokens: int, stop: list[int]):
    def processor(tokens, logits):
        if tokens.size - prompt_len < min_tokens:
            logits = logits.at[:, mx.array(stop)].add(-math.inf)
        return logits

    return processor


def _allowed(allowed: list[int], vocab: int):
    mask = mx.array(np.isin(np.arange(vocab), allowed))

    def processor(_, logits):
        return mx.where(mask, logits, -math.inf)

    return processor


def _bad_words(prompt_len: int, words: list[list[int]]):
    def processor(tokens, logits):
        generated = tokens.tolist()[prompt_len:]
        banned = [w[-1] for w in words if len(w) == 1 or (len(w) - 1 <= len(generated) and generated[len(generated) - len(w) + 1 :] == w[:-1])]
        return logits.at[:, mx.array(banned)].add(-math.inf) if banned else logits

    return processor


def test_a_large_positive_bias_makes_greedy_output_that_token(model_and_tokenizer):
    driver = _run(model_and_tokenizer, _admit("a", PROMPTS[0], logit_bias={500: 100.0}))
    assert driver.tokens["a"] == [500] * MAX_TOKENS and driver.finish["a"] == "length"


def test_a_negative_bias_on_the_greedy_token_equals_mlx_lm_with_its_logit_bias_processor(model_and_tokenizer):
    model, _ = model_and_tokenizer
    prompt = PROMPTS[1]
    greedy = greedy_ids(model, prompt, MAX_TOKENS)
    bias = {greedy[0]: -100.0, greedy[3]: -7.5, 17: 4.0}
    driver = _run(model_and_tokenizer, _admit("a", prompt, logit_bias=bias))
    assert driver.tokens["a"][0] != greedy[0]
    assert driver.tokens["a"] == _reference(model, prompt, make_logits_processors(logit_bias=bias))


def test_bias_then_penalties_in_mlx_lm_order():
    rng = np.random.default_rng(4)
    logits = mx.array(rng.normal(0, 3, (2, 64)).astype(np.float32))
    context = [int(t) for t in rng.integers(0, 12, 9)]
    params = SamplingParams(logit_bias={3: 2.5, 40: -30.0}, repetition_penalty=1.3, presence_penalty=0.4, penalty_context_size=6)
    sampler = BatchSampler()
    sampler.add_row(RowSampling(params, seed=0), context=context)
    sampler.add_row(RowSampling(SamplingParams(), seed=0), context=[1])
    got = sampler.process(logits)
    expected = logits[:1]
    for processor in make_logits_processors(
        logit_bias=params.logit_bias, repetition_penalty=1.3, repetition_context_size=6, presence_penalty=0.4, presence_context_size=6
    ):
        expected = processor(mx.array(context), expected)
    np.testing.assert_allclose(np.array(got[0]), np.array(expected[0]), rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.array(got[1]), np.array(logits[1]))  # a row without controls: untouched


def test_min_tokens_keeps_the_stop_token_out_of_the_first_tokens(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = PROMPTS[2]
    first = greedy_ids(model, prompt, 1)[0]
    stop = sorted({first, *tokenizer.eos_token_ids})
    without = _run(model_and_tokenizer, _admit("a", prompt, stop=stop))
    assert without.tokens["a"] == [] and without.finish["a"] == "stop"
    driver = _run(model_and_tokenizer, _admit("a", prompt, stop=stop, min_tokens=5))
    tokens = driver.tokens["a"]
    assert len(tokens) >= 5 and not set(tokens[:5]) & set(stop)
    assert tokens == _reference(model, prompt, [_min_tokens(len(prompt), 5, stop)], stop=stop)


def test_allowed_token_ids_greedy_and_sampled(model_and_tokenizer):
    model, _ = model_and_tokenizer
    allowed = [5, 77, 300, 301, 640, 900]
    prompt = PROMPTS[3]
    driver = _run(
        model_and_tokenizer,
        _admit("greedy", prompt, allowed_token_ids=allowed),
        _admit("sampled", prompt, allowed_token_ids=allowed, temperature=1.5, seed=7),
    )
    assert set(driver.tokens["greedy"]) <= set(allowed) and set(driver.tokens["sampled"]) <= set(allowed)
    assert len(driver.tokens["sampled"]) == MAX_TOKENS
    assert driver.tokens["greedy"] == _reference(model, prompt, [_allowed(allowed, 1024)])


def test_bad_words_batched_beside_plain_rows_that_stay_identical_to_running_alone(model_and_tokenizer):
    model, _ = model_and_tokenizer
    plain = [PROMPTS[0], PROMPTS[4], PROMPTS[5]]
    prompt = PROMPTS[1]
    greedy = greedy_ids(model, prompt, MAX_TOKENS)
    # A one-token word (a token of the greedy stream) and a two-token word (its first two tokens).
    words = [[greedy[5]], [greedy[0], greedy[1]]]
    driver = _run(
        model_and_tokenizer,
        _admit("p0", plain[0]),
        _admit("bad", prompt, bad_words_ids=words),
        _admit("p1", plain[1]),
        _admit("bias", PROMPTS[2], logit_bias={9: 50.0}, min_tokens=3, stop=[9]),
        _admit("p2", plain[2]),
    )
    tokens = driver.tokens["bad"]
    assert greedy[5] not in tokens
    assert all(tokens[i : i + 2] != words[1] for i in range(len(tokens) - 1))
    assert tokens[0] == greedy[0] and tokens[1] != greedy[1]  # the longer word bans only after its prefix
    assert tokens == _reference(model, prompt, [_bad_words(len(prompt), words)])
    for rid, p in zip(("p0", "p1", "p2"), plain):
        assert driver.tokens[rid] == greedy_ids(model, p, MAX_TOKENS)
    # The biased stop token wins every step once min_tokens no longer holds it off.
    assert len(driver.tokens["bias"]) == 3 and 9 not in driver.tokens["bias"] and driver.finish["bias"] == "stop"


def test_bad_words_look_back_over_tokens_generated_before_a_park(model_and_tokenizer):
    """A parked row rejoins with the history its longer bad words match against."""
    model, _ = model_and_tokenizer
    prompt = PROMPTS[3]
    greedy = greedy_ids(model, prompt, MAX_TOKENS)
    words = [[greedy[3], greedy[4], greedy[5]]]
    driver = _driver(model_and_tokenizer)
    driver.admit(_admit("bad", prompt, bad_words_ids=words))
    while len(driver.tokens["bad"]) < 5:
        driver.step(driver.plan())
    driver.step(StepPlan(park=["bad"]))
    driver.step(StepPlan(unpark=["bad"]))
    driver.run()
    tokens = driver.tokens["bad"]
    assert tokens[:5] == greedy[:5] and tokens[5] != greedy[5]
    assert tokens == _reference(model, prompt, [_bad_words(len(prompt), words)])


def test_controls_that_leave_no_token_end_their_request_alone_with_an_error(model_and_tokenizer):
    model, _ = model_and_tokenizer
    driver = _driver(model_and_tokenizer)
    driver.admit(
        _admit("banned", PROMPTS[0], allowed_token_ids=[5], bad_words_ids=[[5]]),
        _admit("plain", PROMPTS[1]),
        _admit("held", PROMPTS[2], allowed_token_ids=[7], stop=[7], min_tokens=2),
    )
    outputs = []
    for _ in range(40):
        if len(driver.finish) == 3:
            break
        outputs += driver.step(driver.plan()).outputs
    assert driver.finish == {"banned": "error", "held": "error", "plain": "length"}
    errors = {row.request_id: row for row in outputs if row.finish_reason == "error"}
    assert all(row.error_code == "invalid_request" and "no token is left" in (row.error or "") for row in errors.values())
    assert driver.tokens["banned"] == [] and driver.tokens["held"] == []
    assert driver.tokens["plain"] == greedy_ids(model, PROMPTS[1], MAX_TOKENS)
