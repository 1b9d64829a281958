"""Per-request logits controls before the engine: their validation (typed errors naming the
field), bad words tokenized as vLLM does, and the features they turn off (speculation and
fast-forwarding refused with a reason)."""

from __future__ import annotations

import pytest

from policies import fill_plan
from policies.speculation import plan_speculation
from policies.validation import MAX_LOGIT_BIAS, bad_words_ids, validate
from protocols.api import GenerateRequest, SamplingParams
from protocols.config import SpeculativeConfig
from protocols.errors import InvalidRequestError
from tests.support.mlx_reference import load_reference
from tests.support.model_info import model_info

INFO = model_info()


def _request(max_tokens: int | None = 8, **sampling) -> GenerateRequest:
    return GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=max_tokens, sampling=SamplingParams(**sampling))


@pytest.mark.parametrize(
    "field, sampling",
    [
        ("logit_bias", {"logit_bias": {1024: 1.0}}),
        ("logit_bias", {"logit_bias": {-1: 1.0}}),
        ("logit_bias", {"logit_bias": {"5": 1.0}}),
        ("logit_bias", {"logit_bias": {5: 100.5}}),
        ("logit_bias", {"logit_bias": {5: float("nan")}}),
        ("logit_bias", {"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 9}),
        ("allowed_token_ids", {"allowed_token_ids": []}),
        ("allowed_token_ids", {"allowed_token_ids": [3, 1024]}),
        ("bad_words", {"bad_words": ["ok", ""]}),
        ("bad_words", {"bad_words": ["   "]}),
        ("bad_words", {"bad_words": ["w"] * 129}),
        ("bad_words", {"bad_words": ["x" * 9000]}),
    ],
)
def test_bad_values_are_refused_naming_the_field(field, sampling):
    with pytest.raises(InvalidRequestError) as info:
        validate(_request(**sampling), INFO)
    assert info.value.field == f"sampling.{field}"


def test_values_in_range_pass():
    validate(
        _request(logit_bias={i: (-100.0 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS)}, min_tokens=8, allowed_token_ids=[0, 1023], bad_words=["a b"]),
        INFO,
    )
    validate(_request(max_tokens=None, min_tokens=10_000), INFO)  # capped by the context, as max_tokens is


def test_bad_words_are_tokenized_with_and_without_a_leading_space_as_vllm_does():
    _, tokenizer = load_reference("builtin:tiny")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # vLLM keeps the spaced form only when it is a new first token of the same length: "line"
    # and " line" are one token each; "the" is two tokens and " the" one; " hello" is "hello"
    # after a space token.
    assert [len(encode(w)) for w in ("line", " line", "the", " the")] == [1, 1, 2, 1] and encode(" hello")[1:] == encode("hello")
    ids = bad_words_ids(["line", "the", "  hello"], tokenizer)
    assert ids == [encode("line"), encode(" line"), encode("the"), encode("hello")]


@pytest.mark.parametrize(
    "sampling", [{"logit_bias": {1: 1.0}}, {"min_tokens": 1}, {"allowed_token_ids": [1]}, {"bad_words": ["x"]}], ids=lambda s: next(iter(s))
)
def test_controls_refuse_speculation_and_fast_forwarding_with_a_reason(sampling):
    request = GenerateRequest(prompt_ids=[1], sampling=SamplingParams(**sampling), speculative=True)
    plan, stats = plan_speculation(request, SpeculativeConfig(), has_draft=False)
    assert plan is None and stats is not None and stats.refused and "logits processing" in stats.refused
    assert "bypass" in (fill_plan.refusal(request, None) or "")
    plain = GenerateRequest(prompt_ids=[1], speculative=True)
    assert plan_speculation(plain, SpeculativeConfig(), has_draft=False)[0] is not None and fill_plan.refusal(plain, None) is None
