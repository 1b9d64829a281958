"""Prompts and a runner for greedy-parity tests of the runtime.

`parity_prompts()` gives prompts of `PROMPT_LENGTHS` tokens (one a single token, two longer than
the prefill chunk); `run_all(rt, prompts)` submits them together and returns each stream's tokens
and `Finished`, in prompt order.
"""

from __future__ import annotations

import random

import anyio

from protocols import Finished, GenerateRequest, TokenDelta
from runtime import Runtime
from tests.support.config import CHUNK

MAX_TOKENS = 24
# Different lengths, one prompt a single token, two longer than the prefill chunk.
PROMPT_LENGTHS = [1, 3, 9, 20, CHUNK - 1, 33, 2 * CHUNK + 5, 5 * CHUNK + 3]


def parity_prompts(vocab: int = 1000) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


async def run_all(rt: Runtime, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[tuple[list[int], Finished]]:
    results: list = [None] * len(prompts)

    async def one(i: int) -> None:
        tokens, finished = [], None
        async for event in rt.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=max_tokens)):
            if isinstance(event, TokenDelta):
                tokens += event.token_ids
            elif isinstance(event, Finished):
                finished = event
        results[i] = (tokens, finished)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results
