"""Prompt scoring (`GenerateRequest.prompt_logprobs`): each prompt token's log-probability given
those before it, computed in the prefill pass (chunked, and batched with other prompts' first
chunks), equal to mlx-lm's own forward over the whole prompt; a request scoring its prompt
never starts from a saved prefix (those positions would not be forwarded)."""

from __future__ import annotations

import random

import anyio
import mlx.core as mx
import msgspec
import pytest

from protocols.api import GenerateRequest, TokenDelta
from protocols.config import KvConfig
from runtime import Runtime
from tests.support.config import CHUNK, make_config
from tests.support.mlx_reference import load_reference

MODEL = "builtin:tiny"


def reference_scores(model, prompt: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """mlx-lm's log-probability of each prompt token 1.. from one forward, and the top `k`."""
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    out = []
    for i, token in enumerate(prompt[1:]):
        row = lp[i].tolist()
        top = sorted(range(len(row)), key=lambda t: -row[t])[:k]
        out.append((row[token], [(t, row[t]) for t in top]))
    return out


async def scored(rt: Runtime, prompt: list[int], k: int, **fields) -> list:
    first = None
    async for event in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=2, prompt_logprobs=k, **fields)):
        if isinstance(event, TokenDelta) and first is None:
            first = event
    assert first is not None
    return first.prompt_logprobs or []


@pytest.mark.parametrize("concurrent", [False, True], ids=["alone", "batched-prefill"])
async def test_prompt_scores_equal_mlx_lms_forward_over_the_whole_prompt(concurrent, monkeypatch):
    import engine.engine

    batched = []
    together = engine.engine.prefill_together

    def counting(model, layout, trimmable, chunks):
        batched.append(len(chunks))
        return together(model, layout, trimmable, chunks)

    monkeypatch.setattr(engine.engine, "prefill_together", counting)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (2, CHUNK - 3, CHUNK + 5, 3 * CHUNK + 1)]
    model, _ = load_reference(MODEL)
    expected = [reference_scores(model, p, 3) for p in prompts]
    async with Runtime.open(make_config(MODEL)) as rt:
        batched.clear()  # (the load's warm-up prefills two throwaway requests together)
        if concurrent:
            results: list = [None] * len(prompts)

            async def one(i: int) -> None:
                results[i] = await scored(rt, prompts[i], 3)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        else:
            results = [await scored(rt, p, 3) for p in prompts]
    assert bool(batched) == concurrent  # first chunks of several prompts in one forward, or none
    for prompt, got, want in zip(prompts, results, expected):
        assert [s.token_id for s in got] == prompt[1:]
        for s, (logprob, top) in zip(got, want):
            assert s.logprob == pytest.approx(logprob, abs=1e-4)
            assert [t.token_id for t in s.top or []] == [t for t, _ in top]
            assert [t.logprob for t in s.top or []] == pytest.approx([v for _, v in top], abs=1e-4)


async def test_a_scored_prompt_is_prefilled_whole_beside_the_prefix_cache():
    rng = random.Random(5)
    prompt = [rng.randrange(1, 1000) for _ in range(3 * CHUNK)]
    model, _ = load_reference(MODEL)
    want = [v for v, _ in reference_scores(model, prompt, 0)]
    config = make_config(MODEL)
    config = msgspec.structs.replace(config, kv=msgspec.structs.replace(config.kv or KvConfig(), prefix_cache_bytes=64 << 20))
    async with Runtime.open(config) as rt:
        await scored(rt, prompt, 0)  # leaves its prefix in the cache
        again = await scored(rt, prompt, 0)
        plain = [e async for e in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=2))]
        stats = await rt.stats()
    assert [s.logprob for s in again] == pytest.approx(want, abs=1e-4) and all(s.top is None for s in again)
    assert stats.kv.prefix_hits >= 1  # the unscored request did start from it
    assert plain[-1].usage.cached_tokens > 0


async def test_prompt_logprobs_out_of_range_are_refused():
    from runtime.errors import InvalidRequestError

    async with Runtime.open(make_config(MODEL)) as rt:
        with pytest.raises(InvalidRequestError) as info:
            await scored(rt, [1, 2, 3], 21)
    assert info.value.field == "prompt_logprobs"
