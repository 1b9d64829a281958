"""What the `tools/bench_*` modules share: prompts, timed runs through a runtime, medians,
mlx-lm's model for the baseline side, the speculative summary and the JSON dump.

Nothing here decides a workload; each bench module owns its workloads and its table.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from protocols.api import Finished, GenerateRequest, TokenDelta

# The builtin bench models' vocabulary (`BENCH_TOKENIZER`): random prompt ids for a bench that
# does not read its model's own size are drawn below it.
BENCH_VOCAB = 32768


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` random token ids in [100, vocab), the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`th percentile of sorted `values` (0.0 for none)."""
    if not values:
        return 0.0
    index = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[index]


def median_summary(summaries: list[dict]) -> dict:
    """Key by key, the median of several runs' summaries (all with the first one's keys)."""
    return {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}


@dataclass
class Run:
    """Token arrival times of one workload's requests (seconds since its start)."""

    token_times: list[list[float]] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        num_tokens = sum(len(t) for t in self.token_times)
        ttfts = sorted(t[0] for t in self.token_times if t)
        decode = [(len(t) - 1) / (t[-1] - t[0]) for t in self.token_times if len(t) > 1 and t[-1] > t[0]]
        return {
            "requests": len(self.token_times),
            "tokens": num_tokens,
            "throughput_tok_s": num_tokens / self.wall_s if self.wall_s else 0.0,
            "decode_tok_s_per_stream": statistics.mean(decode) if decode else 0.0,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
        }


async def mlxrt_run(rt, prompts: list[list[int]], new_tokens: int, response_format: dict | None = None) -> Run:
    """`prompts` through `rt` at once, each `new_tokens` long (EOS ignored unless constrained by
    `response_format`): every token's arrival time."""
    run = Run(token_times=[[] for _ in prompts])
    start = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> None:
        request = GenerateRequest(
            prompt_ids=prompt, max_tokens=new_tokens, ignore_eos=response_format is None, response_format=response_format, jump_forward=False
        )
        async for event in rt.generate(request):
            if isinstance(event, TokenDelta):
                now = time.perf_counter() - start
                run.token_times[i].extend([now] * len(event.token_ids))

    async with anyio.create_task_group() as tg:
        for i, prompt in enumerate(prompts):
            tg.start_soon(one, i, prompt)
    run.wall_s = time.perf_counter() - start
    return run


async def generate_all(rt, requests: list[GenerateRequest]) -> tuple[float, list[list[int]], list[Finished]]:
    """Wall time, tokens and `Finished` of requests run concurrently."""
    tokens: list[list[int]] = [[] for _ in requests]
    ends: list = [None] * len(requests)

    async def one(i: int) -> None:
        async for event in rt.generate(requests[i]):
            if isinstance(event, TokenDelta):
                tokens[i] += event.token_ids
            elif isinstance(event, Finished):
                ends[i] = event

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return time.perf_counter() - start, tokens, ends


def spec_summary(ends: list[Finished]) -> dict:
    """Acceptance, tokens per target forward and rounds over the speculating requests of `ends`."""
    specs = [e.spec for e in ends if e.spec is not None and e.spec.refused is None]
    drafted = sum(s.drafted for s in specs)
    forwards = sum(s.target_forwards for s in specs)
    return {
        "acceptance": sum(s.accepted for s in specs) / drafted if drafted else 0.0,
        "tokens_per_forward": sum(s.generated for s in specs) / forwards if forwards else 0.0,
        "rounds": sum(s.rounds for s in specs),
    }


def load_mlx_lm_model(path: str):
    """mlx-lm's own model for `path` (on the calling MLX thread), float32 on the CPU backend. A
    GGUF file, which mlx-lm cannot read, is read by our loader into mlx-lm's own class and
    dequantized as the runtime does by default on the CPU: the same weights the runtime serves."""
    import mlx.core as mx

    from engine.model.gguf import is_gguf, load_gguf
    from engine.model.weights import apply_cpu_policy, keeps_quantized
    from runtime import env

    if is_gguf(Path(path)):
        model = load_gguf(Path(path), cache_root=env.home(), keeps_quantized=lambda need: keeps_quantized("auto", need)).model
    else:
        from mlx_lm.utils import load

        model = load(path)[0]
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
        if is_gguf(Path(path)):
            apply_cpu_policy(model, "auto")
    return model


def dump(results: dict, path: str | None) -> str:
    """`results` as indented JSON, also written to `path` when given."""
    text = json.dumps(results, indent=2)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return text
