"""Prefix reuse across requests, and admission under a KV budget."""

from __future__ import annotations

import random

import anyio
import pytest

from protocols import Finished, GenerateRequest, TokenDelta
from runtime import Runtime
from runtime.config import GenerationConfig, KvConfig, LoggingConfig, RuntimeConfig, SchedulerConfig
from tests.support.mlx_reference import greedy_ids, greedy_tokens, load_reference

MAX_TOKENS = 16


def _config(model: str = "builtin:tiny", **kv) -> RuntimeConfig:
    return RuntimeConfig.for_model(
        model,
        scheduler=SchedulerConfig(max_batch_size=8, prefill_chunk_size=16),
        kv=KvConfig(**{"prefix_min_tokens": 4, **kv}),
        generation=GenerationConfig(seed=0),
        logging=LoggingConfig(level="warning", format="json"),
    )


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


async def _run(rt: Runtime, prompt: list[int], max_tokens: int = MAX_TOKENS, **kw) -> tuple[list[int], Finished]:
    tokens, finished = [], None
    async for event in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens, **kw)):
        if isinstance(event, TokenDelta):
            tokens += event.token_ids
        elif isinstance(event, Finished):
            finished = event
    return tokens, finished


async def test_shared_prefix_is_reused_and_tokens_match_a_cold_run():
    model, tokenizer = load_reference("builtin:tiny")
    system = _ids(100, 1)
    first, second, same = system + _ids(12, 2), system + _ids(9, 3), system + _ids(12, 2)
    async with Runtime.open(_config()) as rt:
        tokens_first, fin_first = await _run(rt, first)
        tokens_second, fin_second = await _run(rt, second)
        tokens_same, fin_same = await _run(rt, same)
        stats = (await rt.stats()).kv
    assert fin_first.usage.cached_tokens == 0
    assert fin_second.usage.cached_tokens == len(system)
    assert fin_same.usage.cached_tokens == len(same) - 1
    assert tokens_first == greedy_tokens(model, tokenizer, first, MAX_TOKENS)
    assert tokens_second == greedy_tokens(model, tokenizer, second, MAX_TOKENS)
    assert tokens_same == tokens_first
    assert stats.prefix_hits == 2 and stats.prefix_tokens_reused == len(system) + len(same) - 1


async def test_a_conversation_reuses_its_own_generated_tokens():
    """A follow-up turn whose prompt contains the previous answer starts after it."""
    model, tokenizer = load_reference("builtin:tiny")
    prompt = _ids(40, 4)
    async with Runtime.open(_config()) as rt:
        answer, _ = await _run(rt, prompt, ignore_eos=True)
        follow_up = prompt + answer + _ids(6, 5)
        tokens, finished = await _run(rt, follow_up)
    # The saved entry holds the prompt and every generated token that was fed back (all but the last).
    assert finished.usage.cached_tokens == len(prompt) + len(answer) - 1
    assert tokens == greedy_tokens(model, tokenizer, follow_up, MAX_TOKENS)


async def test_prefix_cache_respects_its_byte_cap():
    async with Runtime.open(_config()) as rt:
        await _run(rt, _ids(30, 6))
        one_entry = (await rt.stats()).kv.prefix_bytes
    assert one_entry > 0
    async with Runtime.open(_config(prefix_cache_bytes=int(one_entry * 2.5))) as rt:
        for seed in range(6):
            await _run(rt, _ids(30, 10 + seed))
        stats = (await rt.stats()).kv
    assert 1 <= stats.prefix_entries <= 2 and stats.prefix_bytes <= int(one_entry * 2.5)


async def test_disabled_prefix_cache_keeps_nothing():
    async with Runtime.open(_config(prefix_cache_bytes=0)) as rt:
        await _run(rt, _ids(30, 7))
        _, finished = await _run(rt, _ids(30, 7))
        stats = (await rt.stats()).kv
    assert finished.usage.cached_tokens == 0
    assert stats.prefix_entries == 0 and stats.prefix_bytes == 0 and stats.prefix_hits == 0


async def test_burst_under_a_small_budget_completes_and_accounting_returns_to_idle():
    model, tokenizer = load_reference("builtin:tiny")
    prompts = [_ids(20 + i, 20 + i) for i in range(12)]
    async with Runtime.open(_config()) as rt:
        bytes_per_token = rt.model_info.kv_bytes_per_token
    # Room for about three requests (prompt + max_tokens) at a time, prefix cache included.
    budget = 3 * (32 + MAX_TOKENS) * bytes_per_token
    async with Runtime.open(_config(budget_bytes=budget, prefix_cache_bytes=budget)) as rt:
        results: dict = {}

        async def one(i):
            results[i] = await _run(rt, prompts[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        with anyio.fail_after(5):
            while (stats := await rt.stats()).live_requests or stats.kv.live_tokens:
                await anyio.sleep(0.01)
        kv = stats.kv
    for i, prompt in enumerate(prompts):
        tokens, finished = results[i]
        assert finished.finish_reason in ("length", "stop")
        assert tokens == greedy_tokens(model, tokenizer, prompt, MAX_TOKENS)
    assert kv.reserved_tokens == 0 and kv.live_tokens == 0
    assert kv.prefix_bytes <= budget


async def test_request_that_can_never_fit_is_refused():
    from runtime import RequestTooLargeError

    async with Runtime.open(_config()) as rt:
        bytes_per_token = rt.model_info.kv_bytes_per_token
    async with Runtime.open(_config(budget_bytes=50 * bytes_per_token)) as rt:
        with pytest.raises(RequestTooLargeError):
            await _run(rt, _ids(40, 30), max_tokens=20)
        _, finished = await _run(rt, _ids(10, 31), max_tokens=20)
        assert finished.finish_reason in ("length", "stop")


@pytest.mark.parametrize("model", ["builtin:tiny", "builtin:tiny-gemma3", "builtin:tiny-lfm2"])
async def test_snapshot_at_keeps_the_system_prompt_while_the_request_runs(model):
    """Also on a model with 16-token sliding windows and on a convolution hybrid, whose
    entries seed only whole (they also keep one at the end of each prompt but its last token,
    and one of the whole prompt, reported with the first token)."""
    system = _ids(37, 40)
    async with Runtime.open(_config(model)) as rt:
        first = rt.generate(GenerateRequest(prompt_ids=system + _ids(20, 41), max_tokens=200, ignore_eos=True, snapshot_at=len(system)))
        # The snapshot exists as soon as prefill passed the system prompt, long before the first request ends.
        async for event in first:
            if isinstance(event, TokenDelta):
                break
        stats = (await rt.stats()).kv
        assert stats.prefix_entries == (1 if model == "builtin:tiny" else 3)
        prompt = system + _ids(5, 42)
        tokens, finished = await _run(rt, prompt, ignore_eos=True)
        assert finished.usage.cached_tokens == len(system)
        await first.aclose()
    reference, _ = load_reference(model)
    assert tokens == greedy_ids(reference, prompt, MAX_TOKENS)


async def test_timings_split_prefill_and_decode_and_rate_only_what_was_prefilled():
    system = _ids(100, 11)
    async with Runtime.open(_config()) as rt:
        _, cold = await _run(rt, system + _ids(10, 12), max_tokens=8, ignore_eos=True)
        _, warm = await _run(rt, system + _ids(10, 13), max_tokens=8, ignore_eos=True)
    for finished in (cold, warm):
        t, u = finished.timings, finished.usage
        assert t.prefill_s > 0 and t.decode_s > 0
        assert t.ttft_s >= t.prefill_s and t.total_s >= t.ttft_s + t.decode_s - 1e-6
        # The seeds' definition: tokens actually prefilled (not cached ones) per prefill second.
        prefilled = u.prompt_tokens - u.cached_tokens
        assert abs(t.prefill_tokens_per_s * t.prefill_s - prefilled) < 1e-6 * max(1, prefilled) + 1e-6
    assert warm.usage.cached_tokens == len(system) and cold.usage.cached_tokens == 0
