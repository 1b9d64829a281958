"""A denoising request's options before any compute: each one out of range, of the wrong type
or larger than the model's canvas is a typed `InvalidRequestError` naming it; the step limit is
`limits.max_denoise_steps`."""

from __future__ import annotations

import msgspec
import pytest

from policies.validation import validate
from protocols.api import DenoisingOptions, GenerateRequest
from protocols.config import LimitsConfig
from protocols.errors import InvalidRequestError
from protocols.model import ModelInfo
from runtime.config import RuntimeConfig
from runtime.errors import ConfigError
from tests.support.model_info import model_info

CANVAS = 16
DIFFUSION = model_info(model_type="diffusion_gemma", denoising=True, canvas_length=CANVAS)
BLOCKS = msgspec.structs.replace(DIFFUSION, model_type="llada2_moe", canvas_length=32, denoises_blocks=True)
HUGE = [1 << 31, 1 << 63, (1 << 64) - 1]


def _request(**options) -> GenerateRequest:
    return GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=8, denoising=DenoisingOptions(**options))


def _refused_field(request: GenerateRequest, info: ModelInfo = DIFFUSION, limits: LimitsConfig = LimitsConfig()) -> str | None:
    with pytest.raises(InvalidRequestError) as refused:
        validate(request, info, limits)
    return refused.value.field


@pytest.mark.parametrize(
    "name, value",
    [
        *[("max_steps", v) for v in (0, -1, 1025, *HUGE, 2.5, "3", True, [3])],
        *[("canvas_length", v) for v in (0, -1, CANVAS + 1, *HUGE, 2.5, "4", True, [4])],
        *[("min_canvas_length", v) for v in (0, -1, CANVAS + 1, *HUGE, 2.5, "4", True)],
        *[("threshold", v) for v in (-0.1, 1.5, float("nan"), float("inf"), -float("inf"), "0.5", True, 1 << 63)],
    ],
)
def test_a_denoising_option_out_of_range_or_of_the_wrong_type_is_refused_naming_it(name, value):
    assert _refused_field(_request(**{name: value})) == f"denoising.{name}"


@pytest.mark.parametrize("value", [0, -1, 33, *HUGE, 2.5, "8", True])
def test_a_block_length_out_of_range_is_refused_for_a_block_diffusion_model(value):
    assert _refused_field(_request(canvas_length=value), BLOCKS) == "denoising.canvas_length"


def test_a_least_canvas_longer_than_the_canvas_asked_for_is_refused():
    assert _refused_field(_request(canvas_length=4, min_canvas_length=8)) == "denoising.min_canvas_length"
    validate(_request(canvas_length=8, min_canvas_length=8), DIFFUSION)


@pytest.mark.parametrize(
    "options",
    [
        {"max_steps": 1, "canvas_length": 1, "min_canvas_length": 1, "threshold": 0.0},
        {"max_steps": 1024, "canvas_length": CANVAS, "min_canvas_length": CANVAS, "threshold": 1.0},
        {"threshold": 1},  # an integer is a number
        {},
    ],
)
def test_options_in_range_pass(options):
    validate(_request(**options), DIFFUSION)


def test_the_step_limit_is_a_setting_named_in_the_refusal():
    limits = LimitsConfig(max_denoise_steps=8)
    validate(_request(max_steps=8), DIFFUSION, limits)
    with pytest.raises(InvalidRequestError, match=r"limits\.max_denoise_steps") as refused:
        validate(_request(max_steps=9), DIFFUSION, limits)
    assert refused.value.field == "denoising.max_steps"
    assert LimitsConfig().max_denoise_steps == 1024


def test_the_step_limit_is_read_from_the_config_and_must_be_positive():
    config = '[model]\npath = "m"\n[limits]\nmax_denoise_steps = '
    assert RuntimeConfig.from_toml(config + "12\n").limits.max_denoise_steps == 12
    with pytest.raises(ConfigError, match="max_denoise_steps"):
        RuntimeConfig.from_toml(config + "0\n")


def test_options_that_are_not_denoising_options_are_refused():
    request = GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=8, denoising={"max_steps": 3})  # type: ignore[arg-type]
    assert _refused_field(request) == "denoising"
