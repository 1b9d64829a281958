"""`mlxrt bench --pool`: two models in one process, with and without room for both.

- `swap`: time to first token of a request for the model that is not resident (the other is
  swapped out, this one loaded), against one for the resident model; medians.
- `alternating`: `streams` concurrent streams, half for each model, under a cap that holds one
  model (swaps preempt and resume requests) against no cap (both resident): tokens/s, swaps.

Models: `builtin:bench` (llama) and `builtin:bench-qwen2`, the bench's shape. Every stream of
the capped run must equal the uncapped run's (preemption is exact).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import anyio
import msgspec

from protocols.api import GenerateRequest, TokenDelta
from runtime.config import ModelPoolConfig, PoolModelConfig, RuntimeConfig
from runtime.progress import Progress
from tools.bench_common import BENCH_VOCAB, random_prompts

OTHER = "builtin:bench-qwen2"


@dataclass(frozen=True)
class PoolBenchOptions:
    streams: int = 8
    prompt_tokens: int = 128
    new_tokens: int = 64
    repeats: int = 3
    min_resident_s: float = 2.0


def _pool_config(base: RuntimeConfig, cap: int, options: PoolBenchOptions) -> RuntimeConfig:
    return msgspec.structs.replace(
        base,
        models=[PoolModelConfig(name="other", path=OTHER)],
        model_pool=ModelPoolConfig(memory_bytes=cap, min_resident_s=options.min_resident_s),
    )


async def _first_token_s(pool, request: GenerateRequest) -> float:
    start = time.perf_counter()
    async for event in pool.generate(request):
        if isinstance(event, TokenDelta):
            return time.perf_counter() - start
    raise AssertionError("no token")


async def _streams(pool, requests: list[GenerateRequest]) -> tuple[float, list[list[int]]]:
    tokens: list[list[int]] = [[] for _ in requests]

    async def one(i: int) -> None:
        async for event in pool.generate(requests[i]):
            if isinstance(event, TokenDelta):
                tokens[i] += event.token_ids

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return time.perf_counter() - start, tokens


async def run_pool_bench(base: RuntimeConfig, options: PoolBenchOptions) -> dict:
    from runtime.pool import ModelPool

    progress = Progress("bench --pool")
    prompts = random_prompts(options.streams, options.prompt_tokens, BENCH_VOCAB, 21)
    requests = [
        GenerateRequest(prompt_ids=p, max_tokens=options.new_tokens, ignore_eos=True, model=("other" if i % 2 else None)) for i, p in enumerate(prompts)
    ]
    results: dict = {"options": asdict(options)}
    progress.step("both models resident (no cap)")
    async with ModelPool.open(_pool_config(base, 0, options)) as pool:
        await _streams(pool, requests[:2])
        sizes = {m.name: m.weight_bytes for m in pool.models()}
        free = []
        for rep in range(options.repeats):
            progress.step(f"alternating streams, no cap ({rep + 1}/{options.repeats})")
            wall, reference = await _streams(pool, requests)
            free.append(sum(map(len, reference)) / wall)
    cap = max(sizes.values()) + min(sizes.values()) // 2
    async with ModelPool.open(_pool_config(base, cap, options)) as pool:
        swap, resident = [], []
        for rep in range(options.repeats):
            progress.step(f"first token after a swap ({rep + 1}/{options.repeats})")
            await anyio.sleep(options.min_resident_s)
            model = "other" if rep % 2 == 0 else None
            swap.append(await _first_token_s(pool, msgspec.structs.replace(requests[0], model=model, max_tokens=1)))
            resident.append(await _first_token_s(pool, msgspec.structs.replace(requests[0], model=model, max_tokens=1)))
        capped = []
        for rep in range(options.repeats):
            progress.step(f"alternating streams under a one-model cap ({rep + 1}/{options.repeats})")
            wall, tokens = await _streams(pool, requests)
            if tokens != reference:
                raise AssertionError("a preempted stream differs from the uncapped run")
            capped.append(sum(map(len, tokens)) / wall)
        states = {m.name: (m.loads, m.preempted) for m in pool.models()}
    progress.done("pool benchmark finished")
    results |= {
        "weight_mib": {name: size / 2**20 for name, size in sizes.items()},
        "cap_mib": cap / 2**20,
        "first_token_after_swap_s": statistics.median(swap),
        "first_token_resident_s": statistics.median(resident),
        "no_cap_tok_s": statistics.median(free),
        "capped_tok_s": statistics.median(capped),
        "loads_preempted": states,
    }
    return results


def format_pool_table(r: dict) -> str:
    o = r["options"]
    sizes = ", ".join(f"{name} {mib:.0f} MiB" for name, mib in r["weight_mib"].items())
    return "\n".join(
        [
            f"two models ({sizes}), cap {r['cap_mib']:.0f} MiB (one at a time), min_resident_s {o['min_resident_s']}",
            f"first token: resident model {r['first_token_resident_s'] * 1000:.0f} ms, after a swap {r['first_token_after_swap_s'] * 1000:.0f} ms",
            f"{o['streams']} streams x {o['new_tokens']} tokens, half per model: both resident {r['no_cap_tok_s']:.1f} tok/s, "
            f"one at a time {r['capped_tok_s']:.1f} tok/s (loads, preempted: {r['loads_preempted']})",
        ]
    )
