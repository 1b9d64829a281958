"""Which features combine (`policies.features`, pure): denoising options, speculation,
jump-forward and bulk work, each rule alone."""

from __future__ import annotations

import pytest

from policies import features
from protocols.api import DenoisingOptions, GenerateRequest, SamplingParams
from protocols.config import SpeculativeConfig
from protocols.errors import InvalidRequestError
from protocols.model import FillPlan, FillRow, GrammarSpec
from tests.support.model_info import model_info

GRAMMAR = GrammarSpec(kind="json_object", source="")
LOOKUP = SpeculativeConfig(lookup=True)


def test_denoising_options_only_for_a_diffusion_model_with_the_canvas_bounded_by_its_own():
    request = GenerateRequest(prompt="x", denoising=DenoisingOptions(canvas_length=500))
    assert features.denoising_options(request, model_info()) is None
    options = features.denoising_options(request, model_info(denoising=True, canvas_length=64))
    assert options is not None and options.canvas_length == 64
    default = features.denoising_options(GenerateRequest(prompt="x"), model_info(denoising=True, canvas_length=32))
    assert default is not None and default.canvas_length == 32
    blocks = model_info(denoising=True, canvas_length=32, denoises_blocks=True, model_type="llada2_moe")
    with pytest.raises(InvalidRequestError) as refused:
        features.denoising_options(GenerateRequest(prompt="x", denoising=DenoisingOptions(min_canvas_length=4)), blocks)
    assert refused.value.field == "denoising.min_canvas_length" and "llada2_moe" in str(refused.value)


def test_speculation_is_dropped_for_denoising_refused_by_a_world_and_a_grammar_cannot_denoise():
    request = GenerateRequest(prompt="x")
    plan, stats = features.speculation(request, LOOKUP, denoising=False, grammar=None, distributed=False)
    assert plan is not None and plan.method == "lookup"
    assert features.speculation(request, LOOKUP, denoising=True, grammar=None, distributed=False) == (None, None)
    plan, stats = features.speculation(request, LOOKUP, denoising=False, grammar=None, distributed=True)
    assert plan is None and stats is not None and stats.refused == "a distributed world does not speculate"
    with pytest.raises(InvalidRequestError) as refused:
        features.speculation(request, LOOKUP, denoising=True, grammar=GRAMMAR, distributed=False)
    assert refused.value.field == "tools"
    assert features.speculation(request, SpeculativeConfig(), denoising=False, grammar=None, distributed=False) == (None, None)


@pytest.mark.parametrize(
    ("request_fields", "fill_rows", "default", "expected"),
    [
        ({}, False, True, True),
        ({}, False, False, False),
        ({"jump_forward": True}, False, False, True),
        ({"jump_forward": False}, False, True, False),
        ({}, True, True, False),  # strict fast-forward rows do the work
        ({"logprobs": True}, False, True, False),
        ({"top_logprobs": 2, "logprobs": True}, False, True, False),
        ({"sampling": SamplingParams(min_tokens=3)}, False, True, False),
    ],
)
def test_jump_forward_only_with_a_grammar_no_fill_rows_and_nothing_reading_probabilities(request_fields, fill_rows, default, expected):
    request = GenerateRequest(prompt="x", **request_fields)
    plan = FillPlan(mode="strict", rows=[FillRow(kind="scaffold", trigger=[1], emit=[2])], eos=[0]) if fill_rows else None
    assert features.jump_forward(request, GRAMMAR, plan, default) is expected
    assert features.jump_forward(request, None, plan, True) is False


def test_bulk_work_is_asked_for_or_scoring():
    assert not features.is_bulk(GenerateRequest(prompt="x"))
    assert features.is_bulk(GenerateRequest(prompt="x", bulk=True))
    assert features.is_bulk(GenerateRequest(prompt="x", prompt_logprobs=0))
