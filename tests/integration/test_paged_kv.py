"""Paged KV (`kv.block_size`): a shared prefix is held once, the budget is physical, and the
streams are the ones padded rows give (and mlx-lm's)."""

from __future__ import annotations

import random

import anyio
import msgspec
import pytest

from protocols import Finished, GenerateRequest, TokenDelta
from runtime import Runtime
from runtime.config import GenerationConfig, KvConfig, LoggingConfig, RuntimeConfig, SchedulerConfig
from tests.support.mlx_reference import greedy_tokens, load_reference

BLOCK = 16
TOKEN_BYTES = 512  # builtin:tiny: 2 layers x 2 KV heads x (16 + 16) x float32


def _config(block_size: int = BLOCK, batch: int = 16, **kv) -> RuntimeConfig:
    return RuntimeConfig.for_model(
        "builtin:tiny",
        scheduler=SchedulerConfig(max_batch_size=batch, prefill_chunk_size=256),
        kv=KvConfig(**{"block_size": block_size, "prefix_cache_bytes": 1 << 30, **kv}),
        generation=GenerationConfig(seed=0),
        logging=LoggingConfig(level="warning", format="json"),
    )


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(n)]


async def _run_all(rt: Runtime, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], Finished]]:
    results: list = [None] * len(prompts)

    async def one(i: int) -> None:
        tokens, finished = [], None
        async for event in rt.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True)):
            if isinstance(event, TokenDelta):
                tokens += event.token_ids
            elif isinstance(event, Finished):
                finished = event
        results[i] = (tokens, finished)

    with anyio.fail_after(240):
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    return results


async def _shared_prefix_run(config: RuntimeConfig, system: list[int], tails: list[list[int]], max_tokens: int):
    """One request leaves the system prompt in the prefix cache; then every tail at once."""
    async with Runtime.open(config) as rt:
        (first,) = await _run_all(rt, [system + _ids(3, 99)], max_tokens)
        before = (await rt.stats()).kv
        results = await _run_all(rt, [system + tail for tail in tails], max_tokens)
        after = (await rt.stats()).kv
    return first, before, results, after


async def test_sixteen_requests_sharing_a_system_prompt_hold_it_once():
    system, tails, new = _ids(1024, 1), [_ids(20, 100 + i) for i in range(16)], 24
    _first, before, results, after = await _shared_prefix_run(_config(), system, tails, new)
    assert all(f.usage.cached_tokens == len(system) for _, f in results)
    assert after.pool is not None and after.pool.block_size == BLOCK
    # The most the pool held at once: the first request's entry (system prompt and all), then
    # each request's own positions, and at most one partial block each.
    entry = before.physical_bytes
    assert entry == -(-(len(system) + 3 + new - 1) // BLOCK) * BLOCK * TOKEN_BYTES
    tails_bytes = sum(len(tail) + new - 1 for tail in tails) * TOKEN_BYTES
    assert after.peak_physical_bytes <= entry + tails_bytes + 16 * BLOCK * TOKEN_BYTES, after
    assert after.pool.shared >= len(system) // BLOCK  # the entries the requests left share it too

    # Padded rows copy the prefix into each row: the same streams, many times the memory.
    _, _, row_results, row_after = await _shared_prefix_run(_config(block_size=0), system, tails, new)
    assert [t for t, _ in row_results] == [t for t, _ in results]
    assert row_after.peak_physical_bytes > 8 * after.peak_physical_bytes


@pytest.mark.slow
async def test_a_long_request_beside_short_ones_stays_within_the_budget():
    prompts = [_ids(1800, 7)] + [_ids(60, 10 + i) for i in range(7)]
    new = 40
    need = sum(-(-(len(p) + new) // BLOCK) * BLOCK for p in prompts) * TOKEN_BYTES
    budget = need + 4 * BLOCK * TOKEN_BYTES
    paged = await _budgeted(_config(budget_bytes=budget, prefix_cache_bytes=0), prompts, new)
    assert paged.peak_physical_bytes <= budget, paged
    assert paged.pool is not None and paged.pool.capacity * paged.pool.block_bytes <= budget + paged.pool.block_bytes
    # Padded rows admit the same requests, then pad every row to the long one.
    rows = await _budgeted(_config(block_size=0, budget_bytes=budget, prefix_cache_bytes=0), prompts, new)
    assert rows.peak_physical_bytes > 2 * budget


async def _budgeted(config: RuntimeConfig, prompts: list[list[int]], new: int):
    model, tokenizer = load_reference("builtin:tiny")
    async with Runtime.open(config) as rt:
        results = await _run_all(rt, prompts, new)
        stats = (await rt.stats()).kv
    assert all(f.finish_reason == "length" for _, f in results)
    assert results[1][0] == greedy_tokens(model, tokenizer, prompts[1], new)
    return stats


async def test_paged_and_row_streams_are_the_same_and_mlx_lms():
    model, tokenizer = load_reference("builtin:tiny")
    prompts = [_ids(n, 30 + n) for n in (1, 2, 17, 33, 100, 250)]
    paged = await _streams(_config(), prompts)
    rows = await _streams(_config(block_size=0), prompts)
    assert paged == rows
    assert paged == [greedy_tokens(model, tokenizer, p, 20) for p in prompts]


async def _streams(config: RuntimeConfig, prompts: list[list[int]]) -> list[list[int]]:
    config = msgspec.structs.replace(config, kv=msgspec.structs.replace(config.kv, prefix_cache_bytes=0))
    async with Runtime.open(config) as rt:
        return [tokens for tokens, _ in await _run_all(rt, prompts, 20)]


@pytest.mark.slow
async def test_a_checkpoint_resumes_exactly_across_rows_and_blocks(tmp_path):
    """Checkpoints hold contiguous tensors whatever the layout: a paged runtime resumes a rows
    runtime's checkpoint, and the other way round, continuing the uninterrupted stream."""
    from runtime.checkpoints import path_for
    from runtime.config import CheckpointConfig

    def config(block_size: int, directory) -> RuntimeConfig:
        base = _config(block_size=block_size, batch=8)
        return msgspec.structs.replace(base, checkpoints=CheckpointConfig(dir=str(directory)))

    request = GenerateRequest(prompt_ids=_ids(40, 5), max_tokens=300, ignore_eos=True, request_id="r", checkpoint_every=8)
    async with Runtime.open(config(0, tmp_path / "plain")) as rt:
        uninterrupted = [t async for e in rt.generate(request) if isinstance(e, TokenDelta) for t in e.token_ids]
    for writer, reader in ((BLOCK, 0), (0, BLOCK)):
        directory = tmp_path / f"{writer}-{reader}"
        async with Runtime.open(config(writer, directory)) as rt:
            stream = rt.generate(request).__aiter__()
            with anyio.fail_after(60):
                while not path_for(directory, "r").exists():
                    await stream.__anext__()
        async with Runtime.open(config(reader, directory)) as rt:
            resumed = [t async for e in rt.resume("r") if isinstance(e, TokenDelta) for t in e.token_ids]
        assert resumed == uninterrupted, (writer, reader)


async def test_the_default_configuration_serves_paged_kv_here():
    """`kv.block_size = "auto"`: a text model on this CPU, with mlxrt's kernels (the setup builds
    them), gets blocks of `AUTO_BLOCK_SIZE`; its stream is mlx-lm's."""
    from engine import native
    from protocols.config import AUTO_BLOCK_SIZE

    if not native.supported_platform():
        pytest.skip("mlxrt's CPU kernels are x86-64 only: rows serve elsewhere")
    config = RuntimeConfig.for_model("builtin:tiny", generation=GenerationConfig(seed=0), logging=LoggingConfig(level="warning", format="json"))
    assert config.kv.block_size == "auto"
    prompt = _ids(21, 4)
    async with Runtime.open(config) as rt:
        ((tokens, finished),) = await _run_all(rt, [prompt], 8)
        kv = (await rt.stats()).kv
    assert kv.pool is not None and kv.pool.block_size == AUTO_BLOCK_SIZE
    model, tokenizer = load_reference("builtin:tiny")
    assert finished.finish_reason == "length" and tokens == greedy_tokens(model, tokenizer, prompt, 8)
