"""Quantized KV (`kv.bits`) served: batched equals unbatched, prefix reuse and resume are exact
relative to a quantized run without them, checkpoints of another KV format are refused, and
a fixed budget admits several times the conversations."""

from __future__ import annotations

import dataclasses
import random

import anyio
import msgspec
import pytest

from engine.builtin import BUILTIN_MODELS, config_fields, ensure_model
from policies.layout import kv_format, leaves
from policies.ledger import KvLedger
from protocols import Finished, GenerateRequest, TokenDelta
from runtime import ModelLoadError, Runtime, env
from runtime.checkpoints import ForeignCheckpointError, path_for
from runtime.config import CheckpointConfig, KvConfig, SpeculativeConfig
from tests.support.config import make_config
from tests.support.parity import parity_prompts, run_all

MAX_TOKENS = 24


def _config(model: str, bits: int, start: int = 0, **kv):
    config = make_config(model)
    return msgspec.structs.replace(config, kv=KvConfig(bits=bits, quantized_start=start, **kv))


async def _streams(config, prompts, max_batch_size: int):
    config = msgspec.structs.replace(config, scheduler=msgspec.structs.replace(config.scheduler, max_batch_size=max_batch_size))
    async with Runtime.open(config) as rt:
        return [tokens for tokens, _ in await run_all(rt, prompts)]


def _hybrid(name: str) -> str:
    """A tiny hybrid model (recurrent layers beside full attention) with 64-dimensional heads."""
    base = BUILTIN_MODELS[name]
    if name == "tiny-lfm2":  # its head dim is the width over the heads
        spec = dataclasses.replace(base, name="tiny-lfm2-kv", num_attention_heads=1, num_key_value_heads=1)
    else:
        spec = dataclasses.replace(base, name=f"{name}-kv", extra=config_fields(**{**dict(base.extra), "head_dim": 64}))
    return str(ensure_model(spec, root=env.home()))


CASES = [("tiny-kv", 8, 0), ("tiny-kv", 4, 20), ("tiny-gemma3-kv", 8, 0), ("tiny-lfm2", 8, 0), ("tiny-qwen3next", 4, 8)]


# The first case stays in `make test-fast`; the other layer kinds and widths are marked slow.
@pytest.mark.parametrize(
    ("model", "bits", "start"),
    [pytest.param(*case, id="{}-{}bit-start{}".format(*case), marks=() if i == 0 else pytest.mark.slow) for i, case in enumerate(CASES)],
)
async def test_batched_streams_equal_unbatched_ones(model, bits, start):
    model = _hybrid(model) if model in ("tiny-lfm2", "tiny-qwen3next") else f"builtin:{model}"
    config = _config(model, bits, start)
    async with Runtime.open(config) as rt:
        layers = [layer for _, layer in leaves(rt.model_info.layers)]
        quantized_bytes = (await rt.stats()).kv.bytes_per_token
    assert kv_format(layers) == f"int{bits}/g64/start{start}"
    # Full layers quantized; sliding windows (and recurrent states) kept float.
    assert all(bool(layer.kv_bits) == (layer.kind == "full") for layer in layers)
    prompts = parity_prompts()
    batched = await _streams(config, prompts, 8)
    assert batched == await _streams(config, prompts, 1)
    assert all(len(tokens) > 0 for tokens in batched)
    async with Runtime.open(make_config(model)) as rt:
        assert (await rt.stats()).kv.bytes_per_token > 3 * quantized_bytes  # float32 KV: 4 bytes an element


async def test_a_model_whose_heads_cannot_be_grouped_is_refused():
    with pytest.raises(ModelLoadError, match=r"kv\.group_size"):
        async with Runtime.open(_config("builtin:tiny", 8)):
            pass


async def _generate(rt: Runtime, request: GenerateRequest) -> tuple[list[int], Finished]:
    tokens, finished = [], None
    async for event in rt.generate(request):
        if isinstance(event, TokenDelta):
            tokens += event.token_ids
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    return tokens, finished


@pytest.mark.slow
async def test_prefix_reuse_is_exact_relative_to_a_quantized_run_without_it():
    rng = random.Random(4)
    system = [rng.randrange(4, 1000) for _ in range(50)]
    prompts = [system + [rng.randrange(4, 1000) for _ in range(n)] for n in (9, 17, 3)]
    requests = [GenerateRequest(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True) for p in prompts]
    for start in (0, 32):
        async with Runtime.open(_config("builtin:tiny-kv", 8, start, prefix_cache_bytes=0)) as rt:
            fresh = [await _generate(rt, r) for r in requests]
        async with Runtime.open(_config("builtin:tiny-kv", 8, start, prefix_min_tokens=8)) as rt:
            reused = [await _generate(rt, r) for r in requests]
            stats = (await rt.stats()).kv
        assert [t for t, _ in reused] == [t for t, _ in fresh]
        assert stats.prefix_hits == 2 and all(f.usage.cached_tokens >= len(system) for _, f in reused[1:])


@pytest.mark.slow
@pytest.mark.parametrize(("model", "start"), [("tiny-kv", 16), ("tiny-gemma3-kv", 0)])
async def test_resume_is_exact_and_another_kv_format_is_refused(tmp_path, model, start):
    prompt = [random.Random(3).randrange(1000) for _ in range(21)]
    request = GenerateRequest(prompt_ids=prompt, max_tokens=400, ignore_eos=True, request_id="r", checkpoint_every=8)

    def config(directory, bits: int = 8):
        return msgspec.structs.replace(_config(f"builtin:{model}", bits, start), checkpoints=CheckpointConfig(dir=str(directory)))

    async with Runtime.open(config(tmp_path / "a")) as rt:
        uninterrupted, _ = await _generate(rt, request)
    directory = tmp_path / "b"
    async with Runtime.open(config(directory)) as rt:
        stream = rt.generate(request).__aiter__()
        while not path_for(directory, "r").exists():
            await stream.__anext__()
    for bits in (0, 4):
        async with Runtime.open(config(directory, bits)) as rt:
            with pytest.raises(ForeignCheckpointError, match=rf"int8/g64/start{start} KV"):
                async for _ in rt.resume("r"):
                    pass
    async with Runtime.open(config(directory)) as rt:
        tokens = [t async for e in rt.resume("r") if isinstance(e, TokenDelta) for t in e.token_ids]
    assert tokens == uninterrupted


@pytest.mark.slow
async def test_a_paused_row_leaves_and_rejoins_the_batch_exactly():
    """A caller that stops reading: its quantized row is taken out of the batch (extracted) and
    joins again later; both streams equal those of requests run alone."""
    rng = random.Random(6)
    slow_request = GenerateRequest(prompt_ids=[rng.randrange(1000) for _ in range(12)], max_tokens=300, ignore_eos=True)
    fast_request = GenerateRequest(prompt_ids=[rng.randrange(1000) for _ in range(9)], max_tokens=200, ignore_eos=True)
    config = _config("builtin:tiny-kv", 4, 8)
    async with Runtime.open(config) as rt:
        alone = [(await _generate(rt, r))[0] for r in (slow_request, fast_request)]
    async with Runtime.open(config) as rt:
        slow = rt.generate(slow_request).__aiter__()
        first = await slow.__anext__()  # then stop reading for a while
        fast, _ = await _generate(rt, fast_request)
        with anyio.fail_after(5):
            while (await rt.stats()).scheduler.paused != 1:
                await anyio.sleep(0.01)
        rest = [t async for e in slow if isinstance(e, TokenDelta) for t in e.token_ids]
    assert [(first.token_ids if isinstance(first, TokenDelta) else []) + rest, fast] == alone


async def test_speculation_on_quantized_rows_keeps_the_stream():
    """Prompt lookup verifies drafts over quantized rows and rewinds the rejected ones."""
    rng = random.Random(8)
    motif = [rng.randrange(4, 1000) for _ in range(12)]
    prompts = [motif * 4 + [rng.randrange(4, 1000) for _ in range(n)] for n in (1, 5, 9)]
    base = _config("builtin:tiny-kv", 8)
    plain = await _streams(base, prompts, 8)
    spec = msgspec.structs.replace(base, speculative=SpeculativeConfig(lookup=True, adaptive=False))
    async with Runtime.open(spec) as rt:
        results = await run_all(rt, prompts)
    assert [t for t, _ in results] == plain
    assert sum(f.spec.rounds for _, f in results if f.spec is not None) > 0


async def test_a_fixed_budget_admits_several_times_the_conversations():
    """1,024-token conversations against one budget, counted by the ledger the KV store admits with."""
    counts = {}
    for bits in (0, 8, 4):
        config = make_config("builtin:tiny-kv") if not bits else _config("builtin:tiny-kv", bits)
        async with Runtime.open(config) as rt:
            layers = rt.model_info.layers
        budget = 64 * 1024 * 1024
        ledger = KvLedger(bytes_per_token=0, budget_bytes=budget, layers=layers)
        count = 0
        while ledger.reserve(f"r{count}", 1024)[0].granted:
            count += 1
        counts[bits] = count
    assert counts[8] >= 1.9 * counts[0] and counts[4] >= 3.5 * counts[0], counts


@pytest.mark.slow
async def test_streams_end_cleanly_under_a_quantized_budget():
    """Many requests against a budget that holds a few at a time: all finish, none errors."""
    layers_config = _config("builtin:tiny-kv", 4)
    async with Runtime.open(layers_config) as rt:
        per_request = (await rt.stats()).kv.bytes_per_token * 200
    config = _config("builtin:tiny-kv", 4, budget_bytes=3 * per_request)
    prompts = [[random.Random(i).randrange(4, 1000) for _ in range(150)] for i in range(8)]
    results: list = [None] * len(prompts)
    seen = []

    async def one(i: int) -> None:
        tokens, finished = [], None
        async for event in rt.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=40, ignore_eos=True)):
            if isinstance(event, TokenDelta):
                tokens += event.token_ids
                seen.append((await rt.stats()).kv)
            elif isinstance(event, Finished):
                finished = event
        results[i] = (tokens, finished)

    async with Runtime.open(config) as rt:
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
    assert all(f.finish_reason == "length" and len(t) == 40 for t, f in results)
    # Memory truth: the KV held, by kind, as the engine measured it (no float head and no
    # window layers: every byte held is quantized KV).
    assert all(kv.kv_format == "int4/g64/start0" for kv in seen)
    busy = [kv for kv in seen if kv.live_requests]
    assert busy and all(0 < kv.quantized_bytes == kv.physical_bytes for kv in busy)
    assert max(kv.live_requests for kv in seen) <= 3
