"""`mlxrt bench --disk`: the prefix cache's disk tier (`kv.disk_cache_dir`).

- `restart`: for each KV format, a long prompt's time to first token cold, from the RAM tier
  (the same prompt again), and from disk after a restart (a new runtime on the directory the
  first one wrote), the disk run's tokens checked against the cold run's; the bytes per token
  the disk holds.
- `writes`: 8 streams kept busy (a new request as each ends: 512-token prompts, so every
  request's prefix is written through) with the disk tier on against off, alternating runs;
  decode tokens/s per stream and overall throughput, medians.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import anyio
import msgspec

from protocols.api import GenerateRequest, TokenDelta
from runtime.config import KvConfig, RuntimeConfig
from runtime.progress import Progress
from tools.bench_common import Run, median_summary, random_prompts

WORKLOADS = ("restart", "writes")
FORMATS = {"float": 0, "int8": 8, "int4": 4}
CHUNK = 256


@dataclass(frozen=True)
class DiskBenchOptions:
    prompt_tokens: int = 4096
    new_tokens: int = 8
    formats: tuple[str, ...] = ("float", "int8", "int4")
    repeats: int = 3  # restarts per format (each a cold prefill of a long prompt)
    write_repeats: int = 5  # pairs of write-through runs, on and off back to back
    streams: int = 8
    write_requests: int = 24
    write_prompt_tokens: int = 512
    write_new_tokens: int = 64
    seed: int = 0
    workloads: tuple[str, ...] = WORKLOADS


def _with_kv(config: RuntimeConfig, **kv) -> RuntimeConfig:
    return msgspec.structs.replace(config, kv=msgspec.structs.replace(config.kv, **kv))


async def _first_token(rt, prompt: list[int], new_tokens: int) -> tuple[float, list[int], int]:
    """TTFT, the tokens, and the prompt tokens served from a cache."""
    start, ttft, tokens, cached = time.perf_counter(), 0.0, [], 0
    async for event in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=new_tokens, ignore_eos=True)):
        if isinstance(event, TokenDelta):
            ttft = ttft or time.perf_counter() - start
            tokens += event.token_ids
        elif hasattr(event, "usage"):
            cached = event.usage.cached_tokens
    return ttft, tokens, cached


async def _restart(config: RuntimeConfig, options: DiskBenchOptions, vocab: int, progress: Progress) -> dict:
    from runtime.runtime import Runtime

    out = {}
    for name in options.formats:
        runs = []
        for rep in range(options.repeats):
            prompt = random_prompts(1, options.prompt_tokens, vocab, options.seed + 31 * rep + FORMATS[name])[0]
            with tempfile.TemporaryDirectory(prefix="mlxrt-disk-bench-") as directory:
                cfg = _with_kv(config, bits=FORMATS[name], disk_cache_dir=directory, disk_chunk_tokens=CHUNK, disk_min_tokens=CHUNK)
                progress.step(f"restart {name} ({rep + 1}/{options.repeats}): cold, then from RAM")
                async with Runtime.open(cfg) as rt:
                    cold, cold_tokens, _ = await _first_token(rt, prompt, options.new_tokens)
                    ram, _, ram_cached = await _first_token(rt, prompt, options.new_tokens)
                progress.step(f"restart {name} ({rep + 1}/{options.repeats}): a new runtime, from disk")
                async with Runtime.open(cfg) as rt:
                    before = (await rt.stats()).kv.disk
                    disk, disk_tokens, disk_cached = await _first_token(rt, prompt, options.new_tokens)
                    after = (await rt.stats()).kv.disk
            assert before is not None and after is not None
            runs.append(
                {
                    "cold_ttft_s": cold,
                    "ram_ttft_s": ram,
                    "disk_ttft_s": disk,
                    "disk_over_cold": disk / cold,
                    "ram_cached_tokens": ram_cached,
                    "disk_cached_tokens": disk_cached,
                    "disk_read_s": after.load_s,
                    "disk_bytes": before.bytes,
                    "disk_bytes_per_token": before.bytes / max(1, before.entries * CHUNK),
                    "same_tokens": float(disk_tokens == cold_tokens),
                }
            )
        out[name] = {**median_summary(runs), "same_tokens": float(all(r["same_tokens"] for r in runs))}
    return out


async def _busy(rt, prompts: list[list[int]], new_tokens: int, streams: int) -> Run:
    """Requests kept `streams` at a time (a new one as each ends)."""
    run, limit = Run(token_times=[[] for _ in prompts]), anyio.Semaphore(streams)
    start = time.perf_counter()

    async def one(i: int) -> None:
        async with limit:
            async for event in rt.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=new_tokens, ignore_eos=True)):
                if isinstance(event, TokenDelta):
                    run.token_times[i].extend([time.perf_counter() - start] * len(event.token_ids))

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    run.wall_s = time.perf_counter() - start
    return run


async def _writes(config: RuntimeConfig, options: DiskBenchOptions, vocab: int, progress: Progress) -> dict:
    from runtime.runtime import Runtime

    results: dict[str, list[dict]] = {"off": [], "on": []}
    for rep in range(options.write_repeats):
        prompts = random_prompts(options.write_requests, options.write_prompt_tokens, vocab, options.seed + 1000 + rep)
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            with tempfile.TemporaryDirectory(prefix="mlxrt-disk-bench-") as directory:
                cfg = _with_kv(config, disk_cache_dir=directory if mode == "on" else "", disk_chunk_tokens=CHUNK, disk_min_tokens=CHUNK)
                progress.step(f"writes ({rep + 1}/{options.write_repeats}): {options.streams} busy streams, disk tier {mode}")
                async with Runtime.open(cfg) as rt:
                    summary = (await _busy(rt, prompts, options.write_new_tokens, options.streams)).summary()
                    disk = (await rt.stats()).kv.disk
                summary["disk_writes"] = disk.writes if disk is not None else 0
                summary["disk_bytes_written"] = disk.bytes_written if disk is not None else 0
                # What writing through costs, measured where it is spent: the MLX thread's
                # copies between steps, and the writer threads' hashing and writing.
                summary["export_s"] = disk.export_s if disk is not None else 0.0
                summary["write_s"] = disk.write_s if disk is not None else 0.0
                summary["wall_s"] = summary["tokens"] / summary["throughput_tok_s"]
                results[mode].append(summary)
    off, on = median_summary(results["off"]), median_summary(results["on"])
    pairs = list(zip(results["off"], results["on"], strict=True))
    return {
        "off": off,
        "on": on,
        # Medians of the ratios of each repeat's pair (run back to back), less exposed to the
        # machine's drift than a ratio of medians.
        "decode_ratio": statistics.median(b["decode_tok_s_per_stream"] / a["decode_tok_s_per_stream"] for a, b in pairs),
        "throughput_ratio": statistics.median(b["throughput_tok_s"] / a["throughput_tok_s"] for a, b in pairs),
        "decode_ratios": [round(b["decode_tok_s_per_stream"] / a["decode_tok_s_per_stream"], 4) for a, b in pairs],
        "throughput_ratios": [round(b["throughput_tok_s"] / a["throughput_tok_s"], 4) for a, b in pairs],
        "export_share": on["export_s"] / on["wall_s"],
        "write_share": on["write_s"] / on["wall_s"],
    }


async def run_disk_bench(config: RuntimeConfig, options: DiskBenchOptions) -> dict:
    from runtime.runtime import Runtime

    progress = Progress("bench")
    config = msgspec.structs.replace(
        config, kv=msgspec.structs.replace(config.kv, prefix_cache_bytes=config.kv.prefix_cache_bytes or KvConfig().prefix_cache_bytes)
    )
    async with Runtime.open(config) as rt:
        info = rt.model_info
    results: dict = {"options": asdict(options), "model": {"path": info.path, "type": info.model_type, "dtype": info.dtype, "device": info.device}}
    if "restart" in options.workloads:
        results["restart"] = await _restart(config, options, info.vocab_size, progress)
    if "writes" in options.workloads:
        results["writes"] = await _writes(config, options, info.vocab_size, progress)
    progress.done("disk tier benchmark finished")
    return results


def format_disk_table(results: dict) -> str:
    lines = [f"model: {results['model']['path']} ({results['model']['dtype']} on {results['model']['device']})"]
    if "restart" in results:
        tokens = results["options"]["prompt_tokens"]
        lines.append(f"restart, a {tokens:,}-token prompt: TTFT cold / from RAM / from disk after a restart")
        lines.append(f"{'KV':>6} {'cold s':>8} {'RAM s':>8} {'disk s':>8} {'disk/cold':>10} {'read s':>8} {'B/token':>9} {'same':>5}")
        for name, r in results["restart"].items():
            lines.append(
                f"{name:>6} {r['cold_ttft_s']:8.3f} {r['ram_ttft_s']:8.3f} {r['disk_ttft_s']:8.3f} {r['disk_over_cold']:10.3f}"
                f" {r['disk_read_s']:8.3f} {r['disk_bytes_per_token']:9,.0f} {'yes' if r['same_tokens'] == 1 else 'NO':>5}"
            )
    if "writes" in results:
        w = results["writes"]
        lines.append(f"writes, {results['options']['streams']} busy streams: decode tok/s per stream and throughput, disk tier off / on")
        lines.append(
            f"  decode {w['off']['decode_tok_s_per_stream']:.1f} / {w['on']['decode_tok_s_per_stream']:.1f} ({w['decode_ratio']:.3f}x),"
            f" throughput {w['off']['throughput_tok_s']:.1f} / {w['on']['throughput_tok_s']:.1f} ({w['throughput_ratio']:.3f}x),"
            f" {w['on']['disk_writes']:.0f} files, {w['on']['disk_bytes_written'] / 2**20:.0f} MiB written"
        )
        lines.append(f"  per repeat (on/off): decode {w['decode_ratios']}, throughput {w['throughput_ratios']}")
        lines.append(
            f"  MLX thread copying out: {w['on']['export_s']:.2f} s ({w['export_share']:.2%} of the run);"
            f" writer threads hashing and writing: {w['on']['write_s']:.2f} s ({w['write_share']:.2%})"
        )
    return "\n".join(lines)
