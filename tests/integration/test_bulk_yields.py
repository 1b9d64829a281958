"""Bulk requests yield batch slots to an interactive stream and take them back after, each token
still the one greedy decoding alone gives (`scheduler.bulk_share`)."""

from __future__ import annotations

import random

import anyio

from protocols import GenerateRequest, TokenDelta
from runtime import Runtime
from tests.support.mlx_reference import greedy_ids, load_reference


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


async def _tokens(rt: Runtime, request: GenerateRequest) -> list[int]:
    return [t async for event in rt.generate(request) if isinstance(event, TokenDelta) for t in event.token_ids]


async def test_bulk_rows_are_held_beside_a_stream_and_all_decode_exactly(tiny_config):
    model, _ = load_reference("builtin:tiny")
    prompts = [_ids(10 + k, k) for k in range(6)]
    bulk = [GenerateRequest(prompt_ids=p, max_tokens=120, ignore_eos=True, bulk=True) for p in prompts]
    stream_prompt = _ids(9, 99)
    results: dict[int, list[int]] = {}
    most_held = 0
    async with Runtime.open(tiny_config) as rt:

        async def run(k: int) -> None:
            results[k] = await _tokens(rt, bulk[k])

        async with anyio.create_task_group() as tg:
            for k in range(len(bulk)):
                tg.start_soon(run, k)
            with anyio.fail_after(30):
                while (await rt.stats()).scheduler.decoding < len(bulk):
                    await anyio.sleep(0.005)
            streamed = rt.generate(GenerateRequest(prompt_ids=stream_prompt, max_tokens=150, ignore_eos=True))
            stream: list[int] = []
            async for event in streamed:
                if isinstance(event, TokenDelta):
                    stream += event.token_ids
                    most_held = max(most_held, (await rt.stats(fresh=False)).scheduler.held)
        stats = (await rt.stats()).scheduler
    # One interactive stream at share 0.2: bulk keeps one slot; the others waited out of the batch.
    assert most_held >= len(bulk) - 2
    assert stats.held == 0 and stats.decoding == 0
    assert stream == greedy_ids(model, stream_prompt, 150)
    for k, prompt in enumerate(prompts):
        assert results[k] == greedy_ids(model, prompt, 120), k
