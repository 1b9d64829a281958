"""Greedy token parity with mlx-lm: batched and unbatched, two architectures."""

from __future__ import annotations

import random

import anyio
import pytest

from protocols import Finished, GenerateRequest, TokenDelta
from runtime import Runtime
from tests.conftest import CHUNK, make_config
from tests.integration.reference import greedy_tokens, load_reference

MAX_TOKENS = 24
# Different lengths, one prompt a single token, two longer than the prefill chunk.
PROMPT_LENGTHS = [1, 3, 9, 20, CHUNK - 1, 33, 2 * CHUNK + 5, 5 * CHUNK + 3]


def _prompts(vocab: int = 1000) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=["builtin:tiny", "builtin:tiny-qwen2"])
def case(request):
    model, tokenizer = load_reference(request.param)
    prompts = _prompts()
    references = [greedy_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]
    return request.param, prompts, references


async def _run_all(rt: Runtime, prompts: list[list[int]]) -> list[tuple[list[int], Finished]]:
    results: list = [None] * len(prompts)

    async def one(i: int) -> None:
        tokens, finished = [], None
        async for event in rt.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=MAX_TOKENS)):
            if isinstance(event, TokenDelta):
                tokens += event.token_ids
            elif isinstance(event, Finished):
                finished = event
        results[i] = (tokens, finished)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


@pytest.mark.parametrize("max_batch_size", [8, 1], ids=["batched", "unbatched"])
async def test_greedy_streams_equal_mlx_lm(case, max_batch_size):
    model, prompts, references = case
    async with Runtime.open(make_config(model, max_batch_size=max_batch_size)) as rt:
        results = await _run_all(rt, prompts)
    for prompt, reference, (tokens, finished) in zip(prompts, references, results):
        assert tokens == reference, f"prompt of {len(prompt)} tokens diverged"
        assert finished.finish_reason == ("length" if len(reference) == MAX_TOKENS else "stop")
        assert finished.usage.prompt_tokens == len(prompt)
    # The references are not degenerate: the models produce varied text.
    assert len({t for ref in references for t in ref}) > 20


async def test_parity_holds_with_staggered_arrivals(case):
    """Requests joining a running batch at different steps still match."""
    model, prompts, references = case
    async with Runtime.open(make_config(model)) as rt:
        results: list = [None] * len(prompts)

        async def one(i: int) -> None:
            await anyio.sleep(0.003 * i)
            tokens = []
            async for event in rt.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=MAX_TOKENS)):
                if isinstance(event, TokenDelta):
                    tokens += event.token_ids
            results[i] = tokens

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    assert results == references
