"""Generation features through the public API: stops, logprobs, seeds, prompts, progress."""

from __future__ import annotations

import math
import random

import anyio

from protocols import Finished, GenerateRequest, PrefillProgress, SamplingParams, TokenDelta
from runtime import Runtime
from tests.support.config import CHUNK
from tests.support.mlx_reference import greedy_tokens, load_reference


def _prompt(n: int, seed: int = 21) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


async def _events(rt: Runtime, request: GenerateRequest) -> tuple[list, Finished]:
    events = [event async for event in rt.generate(request)]
    assert isinstance(events[-1], Finished)
    assert sum(isinstance(e, Finished) for e in events) == 1
    return events[:-1], events[-1]


def _tokens(events) -> list[int]:
    return [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]


def _text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenDelta))


async def test_text_prompt_and_detokenized_text(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        events, finished = await _events(rt, GenerateRequest(prompt="def parse(path):", max_tokens=30, ignore_eos=True))
        tokens = _tokens(events)
        assert len(tokens) == 30 and finished.finish_reason == "length"
        assert _text(events) == rt.tokenizer.decode(tokens)
        assert finished.usage.prompt_tokens == len(rt.tokenizer.encode("def parse(path):"))
        assert finished.usage.completion_tokens == 30
        assert finished.timings.ttft_s > 0 and finished.timings.total_s >= finished.timings.ttft_s


async def test_stop_string_truncates_text(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        events, _ = await _events(rt, GenerateRequest(prompt="class Parser:", max_tokens=40, ignore_eos=True))
        full = _text(events)
        stop = full[10:13]
        assert stop.strip(), "the tiny model's text should be printable here"
        events, finished = await _events(rt, GenerateRequest(prompt="class Parser:", max_tokens=40, ignore_eos=True, stop=[stop]))
        assert finished.finish_reason == "stop" and finished.stop_sequence == stop
        assert _text(events) == full[: full.index(stop)]
        assert stop not in _text(events)


async def test_stop_token_ids_and_eos(tiny_config):
    model, tokenizer = load_reference("builtin:tiny")
    prompt = _prompt(9)
    reference = greedy_tokens(model, tokenizer, prompt, 40)
    stop_id = reference[5]
    async with Runtime.open(tiny_config) as rt:
        events, finished = await _events(rt, GenerateRequest(prompt_ids=prompt, max_tokens=40, stop_token_ids=[stop_id]))
    assert _tokens(events) == reference[: reference.index(stop_id)]
    assert finished.finish_reason == "stop"
    assert finished.usage.completion_tokens == reference.index(stop_id) + 1


async def test_logprobs(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        events, _ = await _events(rt, GenerateRequest(prompt_ids=_prompt(6), max_tokens=8, logprobs=True, top_logprobs=4, ignore_eos=True))
    deltas = [e for e in events if isinstance(e, TokenDelta) and e.token_ids]
    for delta in deltas:
        assert len(delta.logprobs) == len(delta.token_ids)
        for token, lp in zip(delta.token_ids, delta.logprobs):
            assert lp.token_id == token and lp.logprob <= 0 and math.isfinite(lp.logprob)
            values = [t.logprob for t in lp.top]
            assert len(values) == 4 and values == sorted(values, reverse=True)
            assert lp.top[0].token_id == token and math.isclose(lp.top[0].logprob, lp.logprob, abs_tol=1e-6)


async def test_seeded_sampling_is_reproducible_under_load(tiny_config):
    hot = GenerateRequest(prompt_ids=_prompt(7), max_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=1234))
    async with Runtime.open(tiny_config) as rt:
        alone, _ = await _events(rt, hot)
        results = {}

        async def run(i, request):
            results[i], _ = await _events(rt, request)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, i, GenerateRequest(prompt_ids=_prompt(5 + i, seed=i), max_tokens=30, sampling=SamplingParams(temperature=0.8)))
            tg.start_soon(run, "hot", hot)
        other_seed, _ = await _events(
            rt, GenerateRequest(prompt_ids=hot.prompt_ids, max_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=99))
        )
    assert _tokens(results["hot"]) == _tokens(alone)
    assert _tokens(other_seed) != _tokens(alone)


async def test_penalties_reduce_repetition(tiny_config):
    prompt = _prompt(4)
    async with Runtime.open(tiny_config) as rt:
        plain, _ = await _events(rt, GenerateRequest(prompt_ids=prompt, max_tokens=60, ignore_eos=True))
        penalised, _ = await _events(
            rt, GenerateRequest(prompt_ids=prompt, max_tokens=60, ignore_eos=True, sampling=SamplingParams(frequency_penalty=5.0, penalty_context_size=60))
        )
    assert len(set(_tokens(penalised))) > len(set(_tokens(plain)))


async def test_chat_messages_with_tools(tiny_config):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    async with Runtime.open(tiny_config) as rt:
        expected = rt.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        _, finished = await _events(rt, GenerateRequest(messages=messages, max_tokens=5))
    assert finished.usage.prompt_tokens == len(rt.tokenizer.encode(expected, add_special_tokens=False))
    assert expected.endswith("<|im_start|>assistant\n")


async def test_prefill_progress_is_reported(tiny_config):
    prompt = _prompt(5 * CHUNK + 3)
    async with Runtime.open(tiny_config) as rt:
        events, _ = await _events(rt, GenerateRequest(prompt_ids=prompt, max_tokens=3, report_progress=True))
    progress = [e.processed_tokens for e in events if isinstance(e, PrefillProgress)]
    assert progress and progress == sorted(progress) and progress[-1] == len(prompt) - 1
    assert all(e.total_tokens == len(prompt) for e in events if isinstance(e, PrefillProgress))


async def test_float32_on_cpu_by_default(tiny_config):
    import mlx.core as mx

    async with Runtime.open(tiny_config) as rt:
        info = rt.model_info
    if mx.default_device() == mx.cpu:
        assert info.dtype == "float32"
    assert info.kv_bytes_per_token > 0 and info.max_context == 2048
