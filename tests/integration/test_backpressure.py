"""A caller that stops reading pauses only its own request, which resumes exactly."""

from __future__ import annotations

import random

import anyio

from protocols import Finished, GenerateRequest, TokenDelta
from runtime import Runtime
from tests.support.mlx_reference import greedy_tokens, load_reference


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


async def test_an_unread_stream_is_paused_and_resumes_exactly(tiny_config):
    model, tokenizer = load_reference("builtin:tiny")
    slow_prompt, fast_prompt = _ids(12, 1), _ids(9, 2)
    slow_request = GenerateRequest(prompt_ids=slow_prompt, max_tokens=300, ignore_eos=True)
    fast_request = GenerateRequest(prompt_ids=fast_prompt, max_tokens=200, ignore_eos=True)
    async with Runtime.open(tiny_config) as rt:
        slow = rt.generate(slow_request).__aiter__()
        first = await slow.__anext__()  # then stop reading for a while
        fast = [t async for e in rt.generate(fast_request) if isinstance(e, TokenDelta) for t in e.token_ids]
        with anyio.fail_after(5):
            while (stats := (await rt.stats()).scheduler).paused != 1:
                await anyio.sleep(0.01)
        steps = stats.steps
        await anyio.sleep(0.1)  # a window in which a step would show: what is checked is that none does
        stats = (await rt.stats()).scheduler
        assert stats.paused == 1 and stats.steps == steps, "nothing runs for a paused request alone"
        rest = []
        async for event in slow:
            if isinstance(event, TokenDelta):
                rest += event.token_ids
            elif isinstance(event, Finished):
                assert event.finish_reason == "length"
    slow_tokens = (first.token_ids if isinstance(first, TokenDelta) else []) + rest
    assert fast == greedy_tokens(model, tokenizer, fast_prompt, 200)
    assert slow_tokens == greedy_tokens(model, tokenizer, slow_prompt, 300)
