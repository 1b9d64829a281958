"""Hostile denoising options on a real diffusion runtime: refused typed, naming the field, before
any compute, while a request already denoising goes on untouched; the step limit is read from
`limits.max_denoise_steps`."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest

from protocols import DenoisingOptions, GenerateRequest, SamplingParams
from protocols.api import TokenDelta
from protocols.config import LimitsConfig
from protocols.errors import InvalidRequestError
from runtime import Runtime
from tests.support.config import make_config
from tests.support.diffusion import BLOCK_MODEL, DIFFUSION_MODEL
from tests.support.events import collect


def _request(max_tokens: int = 8, /, **options: Any) -> GenerateRequest:
    return GenerateRequest(
        prompt="Hello", max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0, seed=1), denoising=DenoisingOptions(**options)
    )


HOSTILE = [
    ("canvas_length", 2.5),  # (used to reach the engine and fail the step every request shared)
    ("canvas_length", "4"),
    ("canvas_length", 1 << 63),
    ("min_canvas_length", 1 << 63),
    ("max_steps", 2.5),
    ("max_steps", "3"),
    ("max_steps", True),
    ("threshold", "0.5"),
]


@pytest.mark.parametrize("model", [DIFFUSION_MODEL, BLOCK_MODEL])
async def test_hostile_options_are_refused_while_another_request_denoises_untouched(model):
    async with Runtime.open(make_config(model)) as rt:
        alone = await collect(rt.generate(_request(32)))
        running = rt.generate(_request(32))
        first = await anext(running)  # (denoising: its first canvas or block is out)
        assert isinstance(first, TokenDelta)
        for name, value in HOSTILE:
            with pytest.raises(InvalidRequestError) as refused:
                await collect(rt.generate(_request(**{name: value})))
            assert refused.value.field == f"denoising.{name}", (name, value)
        rest = await collect(running)
    assert rest.last.finish_reason == "length" and rest.last.error is None
    assert first.token_ids + rest.tokens == alone.tokens


async def test_the_step_limit_comes_from_the_config():
    config = msgspec.structs.replace(make_config(DIFFUSION_MODEL), limits=LimitsConfig(max_denoise_steps=3))
    async with Runtime.open(config) as rt:
        with pytest.raises(InvalidRequestError, match=r"limits\.max_denoise_steps") as refused:
            await collect(rt.generate(_request(max_steps=4)))
        assert refused.value.field == "denoising.max_steps"
        with anyio.fail_after(60):
            assert (await collect(rt.generate(_request(max_steps=3)))).last.finish_reason == "length"
