"""`mlxrt bench --speculative`: speculation on against off, one process, alternating runs.

Workloads (each run on fresh prompts; medians of `repeats` runs):
- `single`: one stream on the draft pair (`builtin:bench-spec` drafted by
  `builtin:bench-spec-draft`), greedy; beside it mlx-lm's own `generate_step` and
  `speculative_generate_step` with the same draft on the baseline thread;
- `lookup`: prompt lookup on a copy-heavy request (`builtin:bench-copy`, a model that
  copies its context: rewrite a given block of code, temperature 0.7, `exact`);
- `concurrency`: 2, 4, 8 and 16 streams on the pair with the configured gate (what a user
  gets), and with the gate lifted (where speculation stops paying: the crossover);
- `verify`: the target's cost of checking k tokens in one forward, per token, against a
  one-token forward (the `VERIFY_TOKEN_COST` the adaptive policy uses).

Speculation never changes a stream: outputs on and off are compared and must be equal.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

from actors.mlx_thread import MlxThread
from protocols.api import Finished, GenerateRequest, SamplingParams
from runtime.config import RuntimeConfig, SpeculativeConfig
from runtime.progress import Progress
from tools.bench_common import BENCH_VOCAB, generate_all, load_mlx_lm_model, random_prompts, spec_summary

TARGET, DRAFT, COPY = "builtin:bench-spec", "builtin:bench-spec-draft", "builtin:bench-copy"
WORKLOADS = ("single", "lookup", "concurrency", "verify")


@dataclass(frozen=True)
class SpecBenchOptions:
    prompt_tokens: int = 128
    new_tokens: int = 128
    concurrency: tuple[int, ...] = (2, 4, 8, 16)
    repeats: int = 3
    max_draft_tokens: int = 6
    workloads: tuple[str, ...] = WORKLOADS
    seed: int = 0


class _Baseline:
    """mlx-lm on its own MLX thread: plain and speculative single streams, forward costs."""

    def load(self, target: str, draft: str) -> None:
        self.target = load_mlx_lm_model(target)
        self.draft = load_mlx_lm_model(draft)

    def single(self, prompt: list[int], new_tokens: int, speculative: bool, num_draft: int) -> float:
        import mlx.core as mx
        from mlx_lm.generate import generate_step, speculative_generate_step

        start, n = time.perf_counter(), 0
        steps: Iterator[Any]
        if speculative:
            steps = speculative_generate_step(mx.array(prompt), self.target, self.draft, num_draft_tokens=num_draft, max_tokens=new_tokens)
        else:
            steps = generate_step(mx.array(prompt), self.target, max_tokens=new_tokens)
        for _ in steps:
            n += 1
        return n / (time.perf_counter() - start)

    def verify_cost(self, prompt: list[int], k: int, repeats: int = 20) -> float:
        """(time of a k + 1-token forward / time of a 1-token one - 1) / k, at the prompt's end."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.target)
        mx.eval(self.target(mx.array(prompt)[None], cache=cache))
        times = {}
        for width in (1, k + 1):
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                mx.eval(self.target(mx.array(prompt[:width])[None], cache=cache))
                samples.append(time.perf_counter() - start)
                for c in cache:
                    c.trim(width)
            times[width] = statistics.median(samples)
        return (times[k + 1] / times[1] - 1.0) / k


def _config(base: RuntimeConfig, model: str, spec: SpeculativeConfig | None) -> RuntimeConfig:
    config = msgspec.structs.replace(base, model=msgspec.structs.replace(base.model, path=model))
    return msgspec.structs.replace(config, speculative=spec) if spec is not None else config


async def run_spec_bench(base: RuntimeConfig, options: SpecBenchOptions) -> dict:
    from runtime.runtime import Runtime

    progress = Progress("bench --speculative")
    results: dict = {"options": asdict(options)}
    draft = SpeculativeConfig(draft=DRAFT, max_draft_tokens=options.max_draft_tokens)
    lifted = msgspec.structs.replace(draft, max_batch=64)
    thread = MlxThread(name="mlx-baseline")
    thread.start()
    try:
        async with Runtime.open(_config(base, TARGET, None)) as off, Runtime.open(_config(base, TARGET, draft)) as on:
            runtimes = {"off": off, "on": on}
            await generate_all(off, [GenerateRequest(prompt_ids=p, max_tokens=8, ignore_eos=True) for p in random_prompts(2, 32, BENCH_VOCAB, 1)])
            await generate_all(on, [GenerateRequest(prompt_ids=p, max_tokens=8, ignore_eos=True) for p in random_prompts(2, 32, BENCH_VOCAB, 1)])
            if "single" in options.workloads or "verify" in options.workloads:
                progress.step("loading the mlx-lm baseline (target and draft)")
                await thread.run(_Baseline.load, baseline := _Baseline(), off.model_info.path, _draft_path())
            if "single" in options.workloads:
                results["single"] = await _single(runtimes, thread, baseline, options, progress)
            if "verify" in options.workloads:
                prompt = random_prompts(1, options.prompt_tokens, BENCH_VOCAB, options.seed + 77)[0]
                progress.step("verify cost: one k + 1-token forward against a 1-token forward")
                results["verify"] = {f"k{k}": await thread.run(baseline.verify_cost, prompt, k) for k in (2, 4, 8)}
            if "concurrency" in options.workloads:
                results["concurrency"] = await _concurrency(runtimes, options, progress, gated=True)
        if "concurrency" in options.workloads:
            async with Runtime.open(_config(base, TARGET, None)) as off, Runtime.open(_config(base, TARGET, lifted)) as on:
                results["crossover"] = await _concurrency({"off": off, "on": on}, options, progress, gated=False)
        if "lookup" in options.workloads:
            async with Runtime.open(_config(base, COPY, None)) as off, Runtime.open(_config(base, COPY, SpeculativeConfig(lookup=True))) as on:
                results["lookup"] = await _lookup({"off": off, "on": on}, options, progress)
    finally:
        await thread.stop()
    progress.done("speculative benchmark finished")
    return results


def _draft_path() -> str:
    from engine.builtin import builtin_name, ensure_builtin
    from runtime import env

    name = builtin_name(DRAFT)
    return str(ensure_builtin(name, root=env.home())) if name else DRAFT


async def _off_then_on(runtimes: dict, requests: list[GenerateRequest], rates: dict, ends: list[Finished], label: str, progress: Progress) -> None:
    """`requests` through speculation off, then on: each one's tokens/s into `rates`, the "on"
    run's `Finished` into `ends`; the streams must be equal."""
    outputs = {}
    for name, rt in runtimes.items():
        progress.step(f"{label}: speculation {name}")
        wall, tokens, finished = await generate_all(rt, requests)
        rates[name].append(sum(map(len, tokens)) / wall)
        outputs[name] = tokens
        if name == "on":
            ends += finished
    if outputs["on"] != outputs["off"]:
        raise AssertionError(f"speculation changed a stream ({label})")


async def _single(runtimes: dict, thread: MlxThread, baseline: _Baseline, options: SpecBenchOptions, progress: Progress) -> dict:
    rates: dict[str, list[float]] = {"off": [], "on": [], "mlx_lm": [], "mlx_lm_speculative": []}
    ends: list[Finished] = []
    for rep in range(options.repeats):
        prompt = random_prompts(1, options.prompt_tokens, BENCH_VOCAB, options.seed + 10 + rep)[0]
        request = GenerateRequest(prompt_ids=prompt, max_tokens=options.new_tokens, ignore_eos=True)
        await _off_then_on(runtimes, [request], rates, ends, f"single stream ({rep + 1}/{options.repeats}), mlxrt", progress)
        for name, speculative in (("mlx_lm", False), ("mlx_lm_speculative", True)):
            progress.step(f"single stream ({rep + 1}/{options.repeats}): {name}")
            rates[name].append(await thread.run(baseline.single, prompt, options.new_tokens, speculative, options.max_draft_tokens))
    summary = {f"{name}_tok_s": statistics.median(values) for name, values in rates.items()}
    summary["speedup"] = summary["on_tok_s"] / summary["off_tok_s"]
    summary["mlx_lm_speedup"] = summary["mlx_lm_speculative_tok_s"] / summary["mlx_lm_tok_s"]
    return summary | spec_summary(ends)


async def _concurrency(runtimes: dict, options: SpecBenchOptions, progress: Progress, gated: bool) -> dict:
    table = {}
    label = "gate on" if gated else "gate lifted"
    for n in options.concurrency:
        rates: dict[str, list[float]] = {"off": [], "on": []}
        ends: list[Finished] = []
        for rep in range(options.repeats):
            prompts = random_prompts(n, options.prompt_tokens, BENCH_VOCAB, options.seed + 1000 * rep + n)
            requests = [GenerateRequest(prompt_ids=p, max_tokens=options.new_tokens, ignore_eos=True) for p in prompts]
            await _off_then_on(runtimes, requests, rates, ends, f"{n} streams, {label} ({rep + 1}/{options.repeats})", progress)
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        table[f"c{n}"] = {"off_tok_s": off, "on_tok_s": on, "ratio": on / off} | spec_summary(ends)
    return table


def code_blocks(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` blocks of `length` tokens of real code: consecutive stretches of mlx-lm's llama
    model source (fixed by the pinned mlx-lm version)."""
    import mlx_lm.models.llama as llama

    ids = tokenizer.encode(Path(llama.__file__).read_text())
    stride = max(1, (len(ids) - length) // max(1, n))
    return [ids[i * stride : i * stride + length] for i in range(n)]


def copy_heavy_request(block: list[int], separator: list[int], seed: int, new_tokens: int) -> GenerateRequest:
    """'Rewrite this code block': the block, a separator, then the block's opening;
    sampled at temperature 0.7, where `bench-copy` copies with small edits of its own (a
    token that leaves the copy, a recurring trigram whose other continuation it takes)."""
    return GenerateRequest(
        prompt_ids=[*block, *separator, *block[:4]], max_tokens=new_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.7, seed=seed)
    )


async def _lookup(runtimes: dict, options: SpecBenchOptions, progress: Progress) -> dict:
    rates: dict[str, list[float]] = {"off": [], "on": []}
    ends: list[Finished] = []
    tokenizer = runtimes["off"].tokenizer
    blocks = code_blocks(tokenizer, options.repeats, options.prompt_tokens)
    for rep, block in enumerate(blocks):
        request = copy_heavy_request(block, tokenizer.encode("\n\n"), options.seed + rep, options.new_tokens)
        await _off_then_on(runtimes, [request], rates, ends, f"copy-heavy lookup ({rep + 1}/{options.repeats})", progress)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    return {"off_tok_s": off, "on_tok_s": on, "speedup": on / off} | spec_summary(ends)


def format_spec_table(results: dict) -> str:
    rows = [f"{'workload':<22}{'off tok/s':>11}{'on tok/s':>11}{'ratio':>8}{'accept':>8}{'tok/fwd':>9}"]

    def line(name: str, entry: dict, ratio_key: str) -> None:
        rows.append(
            f"{name:<22}{entry['off_tok_s']:11.1f}{entry['on_tok_s']:11.1f}{entry[ratio_key]:8.2f}{entry.get('acceptance', 0.0):8.2f}{entry.get('tokens_per_forward', 0.0):9.2f}"
        )

    if "single" in results:
        single = results["single"]
        line("single (draft pair)", single, "speedup")
        rows.append(f"{'  mlx-lm same pair':<22}{single['mlx_lm_tok_s']:11.1f}{single['mlx_lm_speculative_tok_s']:11.1f}{single['mlx_lm_speedup']:8.2f}")
    if "lookup" in results:
        line("lookup (copy-heavy)", results["lookup"], "speedup")
    for key in ("concurrency", "crossover"):
        for n, entry in results.get(key, {}).items():
            line(f"{n} ({'gate' if key == 'concurrency' else 'no gate'})", entry, "ratio")
    for k, cost in results.get("verify", {}).items():
        rows.append(f"verify cost per token, {k}: {cost:.3f} of a one-token forward")
    return "\n".join(rows)
