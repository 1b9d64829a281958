"""`mlxrt bench`: the same workloads through mlxrt and through mlx-lm, one process.

Workloads (random prompt ids, generation forced to full length):
- decode at concurrency 1 (mlx-lm `generate_step`, the loop under `stream_generate`,
  without detokenizing) and 8 and 16 (mlx-lm `BatchGenerator`, mlx_lm.server's engine);
- TTFT p50/p99 of those requests;
- the TTFT of a short request that arrives while a long prompt is prefilling;
- (mlxrt only) the TTFT of a request sharing a 1,024-token prefix with the previous one.

The mlx-lm side runs on its own MLX thread with its own copy of the model, never
at the same time as mlxrt. Prints a table and writes JSON.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio

from actors.mlx_thread import MlxThread
from protocols.api import Finished, GenerateRequest, PrefillProgress, TokenDelta
from runtime.config import RuntimeConfig
from runtime.errors import ConfigError
from runtime.progress import Progress
from tools.bench_common import Run, load_mlx_lm_model, median_summary, mlxrt_run, random_prompts
from tools.peers import roofline


@dataclass(frozen=True)
class BenchOptions:
    prompt_tokens: int = 128
    new_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 8, 16)
    long_prompt_tokens: int = 2048
    short_prompt_tokens: int = 16
    # The shared prefix of the prefix-reuse workload.
    prefix_tokens: int = 1024
    # Each workload runs this many times, alternating mlx-lm and mlxrt; medians are reported.
    repeats: int = 5
    seed: int = 0
    # Which workloads run: "concurrency" (the c1/c8/c16 table), "interference", "constrained",
    # "prefix".
    workloads: tuple[str, ...] = ("concurrency", "interference", "constrained", "prefix")
    # Prompts cut from this text (tokenized by the model) instead of random token ids.
    text_path: str | None = None


class PromptSource:
    """The workloads' prompts: random token ids, or windows of a text's tokens at random
    offsets (a text shorter than a window is repeated)."""

    def __init__(self, vocab: int, text_ids: list[int] | None = None):
        self.vocab, self.text_ids = vocab, text_ids

    def prompts(self, n: int, length: int, seed: int) -> list[list[int]]:
        if not self.text_ids:
            return random_prompts(n, length, self.vocab, seed)
        rng = random.Random(seed)
        ids = self.text_ids * (1 + length // len(self.text_ids))
        starts = [rng.randrange(0, len(ids) - length + 1) for _ in range(n)]
        return [ids[start : start + length] for start in starts]


# -- mlx-lm side (runs on its own MLX thread) ----------------------------------


class Baseline:
    """mlx-lm driven directly; every method runs on the baseline MLX thread."""

    def load(self, path: str) -> None:
        self.model = load_mlx_lm_model(path)

    def single(self, prompt: list[int], new_tokens: int) -> Run:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        start, times = time.perf_counter(), []
        for _ in generate_step(mx.array(prompt), self.model, max_tokens=new_tokens):
            times.append(time.perf_counter() - start)
        return Run(token_times=[times], wall_s=times[-1])

    def batch(self, prompts: list[list[int]], new_tokens: int) -> Run:
        from mlx_lm.generate import BatchGenerator

        generator = BatchGenerator(self.model, max_tokens=new_tokens)
        start = time.perf_counter()
        uids = generator.insert(prompts, max_tokens=[new_tokens] * len(prompts))
        times: dict[int, list[float]] = {uid: [] for uid in uids}
        remaining = len(uids)
        while remaining:
            for response in generator.next_generated():
                times[response.uid].append(time.perf_counter() - start)
                remaining -= response.finish_reason is not None
        generator.close()
        return Run(token_times=list(times.values()), wall_s=time.perf_counter() - start)

    def interference(self, long_prompt: list[int], short_prompt: list[int], arrival_s: float) -> dict:
        """A short prompt arriving `arrival_s` into the long prefill; mlx_lm.server
        inserts new requests between `next()` calls, which is when it gets in."""
        from mlx_lm.generate import BatchGenerator

        generator = BatchGenerator(self.model, max_tokens=4)
        start = time.perf_counter()
        (long_uid,) = generator.insert([long_prompt], max_tokens=[4])
        short_uid: int | None = None
        first: dict[int, float] = {}
        while len(first) < 2:
            responses = generator.next_generated() if short_uid is not None else generator.next()[1]
            if short_uid is None and time.perf_counter() - start >= arrival_s:
                (short_uid,) = generator.insert([short_prompt], max_tokens=[4])
            for r in responses:
                first.setdefault(r.uid, time.perf_counter() - start)
        generator.close()
        assert short_uid is not None
        return {"long_prefill_s": first[long_uid], "short_ttft_s": first[short_uid] - arrival_s}


# -- mlxrt side -------------------------------------------------------------------


# The constrained-decoding workload's format: it cannot end before max_tokens, so constrained
# and free streams have the same lengths and their throughputs compare.
CONSTRAINED_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "bench",
        "schema": {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 256}}, "required": ["values"]},
    },
}


async def _mlxrt_interference(rt, long_prompt: list[int], short_prompt: list[int]) -> dict:
    start = time.perf_counter()
    result: dict[str, float] = {}
    prefilling = anyio.Event()

    async def long() -> None:
        request = GenerateRequest(prompt_ids=long_prompt, max_tokens=4, ignore_eos=True, report_progress=True)
        async for event in rt.generate(request):
            if isinstance(event, PrefillProgress):
                prefilling.set()
            elif isinstance(event, TokenDelta) and event.token_ids:
                result.setdefault("long_prefill_s", time.perf_counter() - start)

    async def short() -> None:
        await prefilling.wait()
        arrived = time.perf_counter()
        result["arrival_s"] = arrived - start
        async for event in rt.generate(GenerateRequest(prompt_ids=short_prompt, max_tokens=4, ignore_eos=True)):
            if isinstance(event, TokenDelta) and event.token_ids:
                result.setdefault("short_ttft_s", time.perf_counter() - arrived)

    async with anyio.create_task_group() as tg:
        tg.start_soon(long)
        tg.start_soon(short)
    return result


async def _mlxrt_prefix_reuse(rt, prefix: list[int], suffixes: list[list[int]]) -> dict:
    """TTFT of a request, then of one sharing its prefix (the second starts from the saved KV)."""
    result = {}
    for name, suffix in zip(("cold", "warm"), suffixes):
        async for event in rt.generate(GenerateRequest(prompt_ids=prefix + suffix, max_tokens=4, ignore_eos=True)):
            if isinstance(event, Finished):
                result[f"{name}_ttft_s"] = event.timings.ttft_s
                result[f"{name}_cached_tokens"] = event.usage.cached_tokens
    result["warm_over_cold"] = result["warm_ttft_s"] / result["cold_ttft_s"]
    return result


async def run_bench(config: RuntimeConfig, options: BenchOptions) -> dict:
    from runtime.runtime import Runtime

    progress = Progress("bench")
    results: dict = {"options": asdict(options), "mlxrt": {}, "mlx_lm": {}}
    baseline, thread = Baseline(), MlxThread(name="mlx-baseline")
    thread.start()
    try:
        async with Runtime.open(config) as rt:
            info = rt.model_info
            results["model"] = {
                "path": info.path,
                "type": info.model_type,
                "params": info.num_parameters,
                "dtype": info.dtype,
                "device": info.device,
                "quantization": info.quantization,
            }
            _check_fits(options, info.max_context)
            text_ids = rt.tokenizer.encode(Path(options.text_path).read_text(), add_special_tokens=False) if options.text_path else None
            source = PromptSource(info.vocab_size, text_ids)
            results["model"]["prompts"] = f"windows of {options.text_path} ({len(text_ids)} tokens)" if text_ids else "random token ids"
            progress.step("loading the mlx-lm baseline")
            await thread.run(baseline.load, info.path)
            await _warm_up(rt, thread, baseline, info.vocab_size)
            if "concurrency" in options.workloads:
                # (The roofline's read bandwidth, around the runs, where there is a c1 figure to set against it.)
                with_roofline = 1 in options.concurrency and info.decode_weight_bytes > 0
                bandwidths = [await _read_bandwidth(progress)] if with_roofline else []
                await _concurrency(rt, thread, baseline, options, source, results, progress)
                if with_roofline:
                    bandwidths.append(await _read_bandwidth(progress))
                    results["roofline"] = c1_roofline(results["mlxrt"].get("c1"), info.decode_weight_bytes, info.kv_bytes_per_token, options, bandwidths)
            if "interference" in options.workloads:
                long_prompt, short_prompt = source.prompts(2, options.long_prompt_tokens, options.seed + 99)
                short_prompt = short_prompt[: options.short_prompt_tokens]
                progress.step("long-prefill interference: mlxrt")
                interference = await _mlxrt_interference(rt, long_prompt, short_prompt)
                progress.step("long-prefill interference: mlx-lm")
                ref = await thread.run(baseline.interference, long_prompt, short_prompt, interference.get("arrival_s", 0.05))
                results["mlxrt"]["interference"] = interference
                results["mlx_lm"]["interference"] = ref
            if "constrained" in options.workloads:
                constrained, free = [], []
                for rep in range(options.repeats):
                    prompts = source.prompts(8, options.prompt_tokens, options.seed + 500 + rep)
                    progress.step(f"constrained decoding ({rep + 1}/{options.repeats}): mlxrt, schema vs none")
                    constrained.append((await mlxrt_run(rt, prompts, options.new_tokens, CONSTRAINED_FORMAT)).summary())
                    free.append((await mlxrt_run(rt, [p[::-1] for p in prompts], options.new_tokens)).summary())
                results["mlxrt"]["constrained_c8"] = median_summary(constrained)
                results["mlxrt"]["unconstrained_c8"] = median_summary(free)
            if "prefix" in options.workloads:
                progress.step("prefix reuse: mlxrt")
                prefix, *suffixes = source.prompts(3, options.prefix_tokens, options.seed + 7)
                results["mlxrt"]["prefix_reuse"] = await _mlxrt_prefix_reuse(rt, prefix, [x[:32] for x in suffixes])
    finally:
        await thread.stop()
    progress.done("benchmark finished")
    results["ratios"] = _ratios(results)
    return results


async def _read_bandwidth(progress: Progress) -> float:
    """This machine's memory read bandwidth now (bytes/s; it moves between runs here)."""
    progress.step("measuring read bandwidth")
    return await anyio.to_thread.run_sync(roofline.measure_read_bandwidth)


def c1_roofline(c1: dict | None, weight_bytes: int, kv_bytes_per_position: int, options: BenchOptions, bandwidths: list[float]) -> dict | None:
    """mlxrt's c1 per-stream decode rate as a fraction of the memory-bandwidth roofline, once per
    bandwidth measured (before and after the runs); None without a c1 figure or a fixed count of
    weight bytes (a mixture of experts)."""
    if not c1 or not weight_bytes or not c1["decode_tok_s_per_stream"]:
        return None
    per_token = roofline.bytes_per_token(weight_bytes, kv_bytes_per_position, options.prompt_tokens, options.new_tokens)
    measured = c1["decode_tok_s_per_stream"]
    return {
        "measured_tok_s": measured,
        "bytes_per_token": per_token,
        "bandwidth_bytes_s": bandwidths,
        "roofline_tok_s": [roofline.roofline_tok_s(b, per_token) for b in bandwidths],
        "fraction": [roofline.fraction_of_roofline(measured, b, per_token) for b in bandwidths],
    }


def format_roofline(line: dict) -> str:
    bounds = " / ".join(f"{bound:.1f}" for bound in line["roofline_tok_s"])
    fractions = " / ".join(f"{fraction:.1%}" for fraction in line["fraction"])
    bandwidths = " and ".join(f"{b / 1e9:.1f}" for b in line["bandwidth_bytes_s"])
    return (
        f"roofline: c1 decode {line['measured_tok_s']:.1f} tok/s per stream = {fractions} of {bounds} tok/s "
        f"({line['bytes_per_token'] / 2**20:.1f} MiB read a token; read bandwidth {bandwidths} GB/s before and after the runs)"
    )


def _check_fits(options: BenchOptions, max_context: int) -> None:
    """Refuse, before anything runs, workloads whose prompts and answers the model's context
    cannot hold (the runtime would refuse their requests after mlx-lm's side had run)."""
    wanted = {"--prompt-tokens + --new-tokens": options.prompt_tokens + options.new_tokens}
    if "interference" in options.workloads:
        wanted["--long-prompt-tokens + 4 new"] = options.long_prompt_tokens + 4
    if "prefix" in options.workloads:
        wanted["--prefix-tokens + a 32-token suffix + 4 new"] = options.prefix_tokens + 36
    for what, tokens in wanted.items():
        if tokens > max_context:
            raise ConfigError(f"{what} = {tokens} tokens: more than the model's context of {max_context}")


async def _concurrency(rt, thread: MlxThread, baseline: Baseline, options: BenchOptions, source: PromptSource, results: dict, progress: Progress) -> None:
    """Each concurrency level, alternating mlx-lm and mlxrt on fresh prompts."""
    for n in options.concurrency:
        refs, ours = [], []
        for rep in range(options.repeats):
            # Fresh prompts each run: mlxrt's prefix cache must not serve repeats.
            prompts = source.prompts(n, options.prompt_tokens, options.seed + 1000 * rep + n)
            progress.step(f"concurrency {n} ({rep + 1}/{options.repeats}): mlx-lm")
            method = baseline.single if n == 1 else baseline.batch
            refs.append((await thread.run(method, prompts if n > 1 else prompts[0], options.new_tokens)).summary())
            progress.step(f"concurrency {n} ({rep + 1}/{options.repeats}): mlxrt")
            ours.append((await mlxrt_run(rt, prompts, options.new_tokens)).summary())
        results["mlx_lm"][f"c{n}"] = median_summary(refs)
        results["mlxrt"][f"c{n}"] = median_summary(ours)


async def _warm_up(rt, thread: MlxThread, baseline: Baseline, vocab: int) -> None:
    prompts = random_prompts(2, 32, vocab, 12345)
    await thread.run(baseline.batch, prompts, 4)
    await thread.run(baseline.single, prompts[0], 4)
    await mlxrt_run(rt, prompts, 4)


def _ratios(results: dict) -> dict:
    ratios = {}
    for key, ours in results["mlxrt"].items():
        ref = results["mlx_lm"].get(key)
        if key.startswith("c") and ref and ref["throughput_tok_s"]:
            ratios[f"{key}_throughput"] = ours["throughput_tok_s"] / ref["throughput_tok_s"]
            if ref["decode_tok_s_per_stream"]:
                ratios[f"{key}_decode_per_stream"] = ours["decode_tok_s_per_stream"] / ref["decode_tok_s_per_stream"]
    constrained, free = results["mlxrt"].get("constrained_c8"), results["mlxrt"].get("unconstrained_c8")
    if constrained and free and free["throughput_tok_s"]:
        ratios["constrained_over_unconstrained_throughput"] = constrained["throughput_tok_s"] / free["throughput_tok_s"]
        if free["decode_tok_s_per_stream"]:
            ratios["constrained_over_unconstrained_decode"] = constrained["decode_tok_s_per_stream"] / free["decode_tok_s_per_stream"]
    reuse = results["mlxrt"].get("prefix_reuse", {})
    if reuse:
        ratios["prefix_warm_over_cold_ttft"] = reuse["warm_over_cold"]
    inter = results["mlxrt"].get("interference", {})
    if inter.get("long_prefill_s"):
        ratios["short_ttft_over_long_prefill"] = inter.get("short_ttft_s", 0.0) / inter["long_prefill_s"]
    return ratios


def format_table(results: dict) -> str:
    rows = [f"{'workload':<14}{'metric':<26}{'mlxrt':>12}{'mlx-lm':>12}{'ratio':>8}"]
    for key in results["mlxrt"]:
        ours, ref = results["mlxrt"][key], results["mlx_lm"].get(key, {})
        for metric in (
            "throughput_tok_s",
            "decode_tok_s_per_stream",
            "ttft_p50_s",
            "ttft_p99_s",
            "long_prefill_s",
            "short_ttft_s",
            "cold_ttft_s",
            "warm_ttft_s",
            "warm_cached_tokens",
        ):
            if metric in ours:
                a, b = ours[metric], ref.get(metric, 0.0)
                ratio = f"{a / b:8.2f}" if b else f"{'':>8}"
                rows.append(f"{key:<14}{metric:<26}{a:12.3f}{b:12.3f}{ratio}")
    return "\n".join(rows)
