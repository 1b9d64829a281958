"""`mlxrt bench --adapters`: LoRA rows in the shared batch against base rows, and load time.

- `batch`: `streams` streams on the bench model without adapters, then the same prompts
  with `distinct` adapters (streams spread over them) in one batch; tokens/s of each and the
  ratio. Two adapter shapes: `mlx_lm.lora`'s defaults (rank 8 on every linear layer of the
  last 16 blocks) and rank 16 on every block.
- `load`: the wall time of `load_adapter` for a rank-16 adapter on every block (median; the
  adapter is unloaded between loads, so each load reads, checks and installs it).

Adapters are built with mlx-lm's own LoRA layers (`tools.lora_adapters`), deterministically,
under `$MLXRT_HOME/adapters/`. Every stream of the adapter run is checked against a run of
the same request alone (the batch must not change what a row computes).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from protocols.api import GenerateRequest
from runtime.config import LoraConfig, RuntimeConfig
from runtime.progress import Progress
from tools.bench_common import BENCH_VOCAB, generate_all, random_prompts

# (label, rank, blocks: 0 = every block).
SHAPES = (("mlx_lm.lora defaults: rank 8, last 16 blocks", 8, 16), ("rank 16, every block", 16, 0))


@dataclass(frozen=True)
class AdapterBenchOptions:
    streams: int = 16
    distinct: int = 8
    prompt_tokens: int = 128
    new_tokens: int = 64
    repeats: int = 3
    loads: int = 7
    seed: int = 0


def adapter_dir(model_dir: Path, rank: int, blocks: int, seed: int) -> Path:
    """A deterministic adapter for `model_dir`, built on first use."""
    import json

    from runtime import env
    from tools.lora_adapters import make_lora_adapter

    num_layers = blocks or json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    out = env.home() / "adapters" / f"{model_dir.name}-r{rank}-l{num_layers}-s{seed}"
    if not (out / "adapters.safetensors").exists():
        make_lora_adapter(model_dir, out, rank=rank, num_layers=num_layers, seed=seed)
    return out


async def run_adapter_bench(base: RuntimeConfig, options: AdapterBenchOptions) -> dict:
    from actors.mlx_thread import MlxThread
    from engine.builtin import builtin_name, ensure_builtin
    from runtime import env
    from runtime.runtime import Runtime

    progress = Progress("bench --adapters")
    name = builtin_name(base.model.path)
    model_dir = ensure_builtin(name, root=env.home()) if name else Path(base.model.path)
    thread = MlxThread(name="mlx-adapters")
    thread.start()
    try:
        progress.step("building the benchmark adapters (mlx-lm LoRA layers, deterministic)")
        paths = {
            (rank, blocks): [await thread.run(adapter_dir, model_dir, rank, blocks, seed) for seed in range(options.distinct)] for _, rank, blocks in SHAPES
        }
    finally:
        await thread.stop()
    config = msgspec.structs.replace(base, lora=LoraConfig(max_resident=options.distinct, max_rank=64))
    results: dict = {"options": asdict(options), "batch": {}}
    prompts = random_prompts(options.streams, options.prompt_tokens, BENCH_VOCAB, options.seed + 5)
    async with Runtime.open(config) as rt:
        await generate_all(rt, [GenerateRequest(prompt_ids=p[:32], max_tokens=4, ignore_eos=True) for p in prompts[:2]])
        for label, rank, blocks in SHAPES:
            names = []
            for i, path in enumerate(paths[(rank, blocks)]):
                names.append(f"r{rank}-l{blocks}-{i}")
                await rt.load_adapter(names[-1], path)
            results["batch"][label] = await _batch(rt, prompts, names, options, progress, label)
            for adapter in names:
                await rt.unload_adapter(adapter)
        results["load"] = await _load(rt, paths[(16, 0)][0], options, progress)
    progress.done("adapter benchmark finished")
    return results


async def _batch(rt, prompts: list[list[int]], names: list[str], options: AdapterBenchOptions, progress: Progress, label: str) -> dict:
    base_requests = [GenerateRequest(prompt_ids=p, max_tokens=options.new_tokens, ignore_eos=True) for p in prompts]
    lora_requests = [msgspec.structs.replace(r, adapter=names[i % len(names)]) for i, r in enumerate(base_requests)]
    rates: dict[str, list[float]] = {"base": [], "adapters": []}
    outputs = None
    for rep in range(options.repeats):
        for kind, requests in (("base", base_requests), ("adapters", lora_requests)):
            progress.step(f"{label}: {options.streams} streams, {kind} ({rep + 1}/{options.repeats})")
            wall, tokens, _ = await generate_all(rt, requests)
            rates[kind].append(sum(map(len, tokens)) / wall)
            if kind == "adapters":
                outputs = tokens
    progress.step(f"{label}: checking two adapter streams alone")
    assert outputs is not None
    for i in (0, len(lora_requests) - 1):
        _, alone, _ = await generate_all(rt, [lora_requests[i]])
        if alone[0] != outputs[i]:
            raise AssertionError(f"an adapter row computed differently in the batch ({label}, stream {i})")
    base, lora = statistics.median(rates["base"]), statistics.median(rates["adapters"])
    return {"base_tok_s": base, "adapters_tok_s": lora, "ratio": lora / base, "distinct": len(names)}


async def _load(rt, path: Path, options: AdapterBenchOptions, progress: Progress) -> dict:
    times = []
    for i in range(options.loads):
        progress.fraction(i, options.loads, "loading a rank-16 adapter")
        start = time.perf_counter()
        info = await rt.load_adapter("load-probe", path)
        times.append(time.perf_counter() - start)
        await rt.unload_adapter("load-probe")
    return {
        "median_ms": 1000 * statistics.median(times),
        "min_ms": 1000 * min(times),
        "rank": info.rank,
        "modules": info.modules,
        "mib": info.num_bytes / 2**20,
    }


def format_adapter_table(results: dict) -> str:
    o = results["options"]
    rows = [f"LoRA adapters in one batch: {o['streams']} streams x {o['new_tokens']} tokens, {o['distinct']} distinct adapters (medians of {o['repeats']})"]
    rows.append(f"{'adapters':<48}{'base tok/s':>11}{'LoRA tok/s':>11}{'ratio':>8}")
    for label, r in results["batch"].items():
        rows.append(f"{label:<48}{r['base_tok_s']:11.1f}{r['adapters_tok_s']:11.1f}{r['ratio']:8.2f}")
    load = results["load"]
    rows.append(
        f"load a rank-{load['rank']} adapter ({load['modules']} layers, {load['mib']:.1f} MiB): median {load['median_ms']:.1f} ms, min {load['min_ms']:.1f} ms"
    )
    return "\n".join(rows)
