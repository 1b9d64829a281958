"""Greedy token parity with mlx-lm: batched and unbatched, two architectures."""

from __future__ import annotations

import random

import anyio
import pytest

from protocols import GenerateRequest, TokenDelta
from runtime import Runtime
from tests.support.config import make_config
from tests.support.mlx_reference import greedy_tokens, load_reference
from tests.support.parity import MAX_TOKENS, parity_prompts, run_all


@pytest.fixture(scope="module", params=["builtin:tiny", "builtin:tiny-qwen2"])
def case(request):
    model, tokenizer = load_reference(request.param)
    prompts = parity_prompts()
    references = [greedy_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts]
    return request.param, prompts, references


@pytest.mark.parametrize("max_batch_size", [8, 1], ids=["batched", "unbatched"])
async def test_greedy_streams_equal_mlx_lm(case, max_batch_size):
    model, prompts, references = case
    async with Runtime.open(make_config(model, max_batch_size=max_batch_size)) as rt:
        results = await run_all(rt, prompts)
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
        streaming = [anyio.Event() for _ in prompts]

        async def one(i: int) -> None:
            if i:  # each joins once the one before it streams: a running batch, at a later step
                await streaming[i - 1].wait()
            tokens = []
            async for event in rt.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=MAX_TOKENS)):
                streaming[i].set()
                if isinstance(event, TokenDelta):
                    tokens += event.token_ids
            results[i] = tokens

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    assert results == references


@pytest.mark.parametrize("max_batch_size", [8, 1], ids=["batched", "unbatched"])
async def test_parity_past_the_width_where_attention_computes_its_own_products(max_batch_size):
    """Rows wide enough that the paged attention computes its scores itself (past 1,200 scores a
    KV head's query group: 600 positions for tiny-kv's two query heads per KV head of 64
    dimensions) and its values too, batched and alone: still mlx-lm's greedy tokens."""
    from engine import native

    model, tokenizer = load_reference("builtin:tiny-kv")
    rng = random.Random(11)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (700, 640, 12)]
    references = [greedy_tokens(model, tokenizer, p, 12) for p in prompts]
    async with Runtime.open(make_config("builtin:tiny-kv", max_batch_size=max_batch_size)) as rt:
        results = await run_all(rt, prompts, max_tokens=12)
    assert [tokens for tokens, _ in results] == references
    kernels = native.loaded()
    if kernels is not None and kernels.quantized_isa() == "avx512":
        assert kernels.set_attention_chains(True)  # (what ran: the kernel's own products, where its check passes)
