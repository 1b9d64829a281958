"""`mlxrt bench --kv`: float KV in padded rows and in pool blocks, 8-bit and 4-bit KV, side
by side in one run.

- `throughput`: concurrency 1 and 16 at 128- and 2,048-token prompts for each KV format
  (decode tokens/s while every stream decodes, TTFT), with mlx-lm's own float and quantized KV
  (`generate_step`, with `kv_bits` and `quantized_kv_start=0`) at concurrency 1;
- `fidelity`: prompts and continuations fixed (the float greedy stream), the mean absolute
  difference of each forced token's logprob from float KV, ours (the decode batch) next to
  mlx-lm's `QuantizedKVCache` at the same bits and group size;
- `agreement`: greedy streams of 512 tokens on `builtin:bench-spec` (whose choices come from
  a structured, not random, circuit) with quantized KV against float KV: positions agreeing
  before the first divergence;
- `admission`: 1,024-token conversations a 1 GiB `kv.budget_bytes` admits (the ledger's count);
- `sharing`: 16 requests sharing a 1,024-token system prompt, then one long request beside
  short ones, in rows and in blocks: the most KV bytes held at once, and decode tokens/s.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import msgspec

from actors.mlx_thread import MlxThread
from policies.ledger import KvLedger
from protocols.api import GenerateRequest, TokenDelta
from runtime.config import KvConfig, RuntimeConfig, SchedulerConfig
from runtime.progress import Progress
from tools.bench_common import BENCH_VOCAB, Run, load_mlx_lm_model, median_summary, mlxrt_run, random_prompts

AGREEMENT_MODEL = "builtin:bench-spec"
WORKLOADS = ("throughput", "fidelity", "agreement", "admission", "sharing")
# KV formats by name: (kv.bits, kv.block_size).
FORMATS = {"float": (0, 0), "paged": (0, 16), "int8": (8, 0), "int4": (4, 0)}


@dataclass(frozen=True)
class KvBenchOptions:
    formats: tuple[str, ...] = ("float", "paged", "int8", "int4")
    group_size: int = 64
    contexts: tuple[int, ...] = (128, 2048)
    concurrency: tuple[int, ...] = (1, 16)
    new_tokens: int = 64
    repeats: int = 2
    fidelity_prompts: int = 4
    fidelity_tokens: int = 128
    agreement_tokens: int = 512
    workloads: tuple[str, ...] = WORKLOADS


def _logprobs(logits):
    import mlx.core as mx

    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def forced_logprobs_mlx_lm(model, prompt: list[int], forced: list[int], cache: list) -> list[float]:
    """The logprob of each forced token, fed one at a time through mlx-lm's caches."""
    import mlx.core as mx

    logits = model(mx.array(prompt)[None], cache=cache)[:, -1]
    out = []
    for token in forced:
        out.append(_logprobs(logits)[0, token].item())
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    return out


def forced_logprobs_batch(model, layout, prompts: list[list[int]], forced: list[list[int]]) -> list[list[float]]:
    """The same through mlxrt's decode batch: each prompt prefilled into its own cache and
    joined as a row, then every row's forced tokens one step at a time."""
    import mlx.core as mx

    from engine.batch import DecodeBatch
    from engine.kv.quantized import new_caches

    batch = DecodeBatch(layout)
    pending = []
    for i, prompt in enumerate(prompts):
        cache = new_caches(model, layout)
        model(mx.array(prompt[:-1])[None], cache=cache)
        batch.add_row(str(i), cache, len(prompt) - 1)
        pending.append(prompt[-1])
    out: list[list[float]] = [[] for _ in prompts]
    for step in range(len(forced[0])):
        batch.begin_step([1] * len(prompts))
        try:
            logits = model(mx.array(pending)[:, None], cache=batch.layers)[:, -1]
        finally:
            batch.end_step()
        logprobs = _logprobs(logits)
        for i in range(len(prompts)):
            out[i].append(logprobs[i, forced[i][step]].item())
        pending = [f[step] for f in forced]
    return out


def greedy_continuations(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Float KV's greedy continuation of each prompt (mlx-lm's caches)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    streams = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        logits, tokens = model(mx.array(prompt)[None], cache=cache)[:, -1], []
        for _ in range(num_tokens):
            tokens.append(int(mx.argmax(logits, axis=-1).item()))  # type: ignore[arg-type]
            logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1]
        streams.append(tokens)
    return streams


def mean_abs_error(run: list[list[float]], reference: list[list[float]]) -> float:
    pairs = [(a, b) for row, ref in zip(run, reference) for a, b in zip(row, ref)]
    return sum(abs(a - b) for a, b in pairs) / len(pairs)


class _MlxLmSide:
    """mlx-lm's model and quantized KV, on a thread of its own."""

    def load(self, path: str) -> None:
        from engine.kv.layout import probe_layout

        self.model = load_mlx_lm_model(path)
        self.layout = probe_layout(self.model)

    def single(self, prompt: list[int], new_tokens: int, bits: int, group_size: int) -> Run:
        import time

        import mlx.core as mx
        from mlx_lm.generate import generate_step

        start, times = time.perf_counter(), []
        steps = generate_step(mx.array(prompt), self.model, max_tokens=new_tokens, kv_bits=bits or None, kv_group_size=group_size, quantized_kv_start=0)
        for _ in steps:
            times.append(time.perf_counter() - start)
        return Run(token_times=[times], wall_s=times[-1])

    def fidelity(self, prompts: list[list[int]], num_tokens: int, bits_list: tuple[int, ...], group_size: int) -> dict:
        from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

        from policies.layout import with_kv_quantization

        model = self.model
        forced = greedy_continuations(model, prompts, num_tokens)
        reference = [forced_logprobs_mlx_lm(model, p, f, make_prompt_cache(model)) for p, f in zip(prompts, forced)]
        out = {}
        for bits in (b for b in bits_list if b):
            theirs = [forced_logprobs_mlx_lm(model, p, f, [QuantizedKVCache(group_size, bits) for _ in self.layout]) for p, f in zip(prompts, forced)]
            layout, _ = with_kv_quantization(self.layout, bits, group_size, 0)
            ours = forced_logprobs_batch(model, layout, prompts, forced)
            out[f"int{bits}"] = {"mlxrt": mean_abs_error(ours, reference), "mlx_lm": mean_abs_error(theirs, reference)}
        return out


def steady_decode(run: Run) -> float:
    """Tokens/s while every stream decodes: from the last first token to the first last one
    (other streams' prefill chunks are not in it)."""
    times = [t for t in run.token_times if len(t) > 1]
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    if end <= start:
        return 0.0
    return sum(sum(start < x <= end for x in t) for t in times) / (end - start)


def _summary(run: Run) -> dict:
    return run.summary() | {"steady_decode_tok_s": steady_decode(run)}


def _with_kv(config: RuntimeConfig, bits: int, group_size: int, model: str | None = None, block_size: int = 0, **kv) -> RuntimeConfig:
    scheduler = msgspec.structs.replace(config.scheduler, max_batch_size=max(16, config.scheduler.max_batch_size))
    kv_config = KvConfig(bits=bits, group_size=group_size, block_size=block_size, **{"prefix_cache_bytes": 0, **kv})  # type: ignore[arg-type]
    config = msgspec.structs.replace(config, kv=kv_config, scheduler=scheduler)
    if model:
        config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=model))
    return config


def _format_bits(options: KvBenchOptions) -> tuple[int, ...]:
    """The quantized bit widths measured (float: 0), each once."""
    return tuple(dict.fromkeys(FORMATS[name][0] for name in options.formats))


async def run_kv_bench(config: RuntimeConfig, options: KvBenchOptions) -> dict:
    progress = Progress("bench --kv")
    results: dict = {"options": asdict(options), "mlxrt": {}, "mlx_lm": {}}
    thread, side = MlxThread(name="mlx-baseline"), _MlxLmSide()
    thread.start()
    try:
        for name in options.formats:
            await _format_throughput(config, options, name, results, progress)
            bits = FORMATS[name][0]
            if "throughput" in options.workloads and 1 in options.concurrency and f"{_bits_name(bits)}_ctx{options.contexts[0]}_c1" not in results["mlx_lm"]:
                if not hasattr(side, "model"):
                    progress.step("loading the mlx-lm side")
                    await thread.run(side.load, results["model"]["path"])
                for ctx in options.contexts:
                    runs = []
                    for rep in range(options.repeats):
                        progress.step(f"mlx-lm {_bits_name(bits)} KV, {ctx}-token prompt, one stream ({rep + 1}/{options.repeats})")
                        prompt = random_prompts(1, ctx, results["model"]["vocab_size"], 1000 * rep + 10 + ctx)[0]
                        runs.append(_summary(await thread.run(side.single, prompt, options.new_tokens, bits, options.group_size)))
                    results["mlx_lm"][f"{_bits_name(bits)}_ctx{ctx}_c1"] = median_summary(runs)
        if "fidelity" in options.workloads:
            if not hasattr(side, "model"):
                await thread.run(side.load, results["model"]["path"])
            progress.step(f"fidelity: {options.fidelity_prompts} prompts x {options.fidelity_tokens} forced tokens")
            prompts = random_prompts(options.fidelity_prompts, 128, results["model"]["vocab_size"], 77)
            results["fidelity"] = await thread.run(side.fidelity, prompts, options.fidelity_tokens, _format_bits(options), options.group_size)
        if "agreement" in options.workloads:
            results["agreement"] = await _agreement(config, options, progress)
        if "sharing" in options.workloads:
            results["sharing"] = await _sharing(config, options, progress)
    finally:
        await thread.stop()
    progress.done("KV benchmark finished")
    return results


def _bits_name(bits: int) -> str:
    return f"int{bits}" if bits else "float"


async def _format_throughput(config: RuntimeConfig, options: KvBenchOptions, name: str, results: dict, progress: Progress) -> None:
    from runtime.runtime import Runtime

    bits, block_size = FORMATS[name]
    async with Runtime.open(_with_kv(config, bits, options.group_size, block_size=block_size)) as rt:
        info = rt.model_info
        results.setdefault("model", {"path": info.path, "dtype": info.dtype, "device": info.device, "vocab_size": info.vocab_size})
        results["mlxrt"].setdefault("bytes_per_token", {})[name] = (await rt.stats()).kv.bytes_per_token
        results["mlxrt"].setdefault("admitted_1024", {})[name] = _admitted(info.layers)
        if "throughput" not in options.workloads:
            return
        await mlxrt_run(rt, random_prompts(2, 32, info.vocab_size, 12345), 4)
        for ctx in options.contexts:
            for n in options.concurrency:
                runs = []
                for rep in range(options.repeats):
                    progress.step(f"{name} KV, {ctx}-token prompts, concurrency {n} ({rep + 1}/{options.repeats})")
                    prompts = random_prompts(n, ctx, info.vocab_size, 1000 * rep + 10 * n + ctx)
                    runs.append(_summary(await mlxrt_run(rt, prompts, options.new_tokens)))
                results["mlxrt"].setdefault(f"{name}_ctx{ctx}_c{n}", median_summary(runs))


async def _sharing(config: RuntimeConfig, options: KvBenchOptions, progress: Progress) -> dict:
    """Rows against blocks: 16 requests sharing a 1,024-token system prompt (after one that
    left it in the prefix cache), then a 2,048-token request beside 15 of 128 tokens: the most
    KV bytes held at once, and decode tokens/s while every stream decodes (the second: tokens/s
    over the run, the short ones being done before the long one starts)."""
    from runtime.runtime import Runtime

    out: dict = {}
    for name in ("float", "paged"):
        _, block_size = FORMATS[name]
        shared = _with_kv(config, 0, options.group_size, block_size=block_size, prefix_cache_bytes=1 << 32)
        async with Runtime.open(shared) as rt:
            vocab = rt.model_info.vocab_size
            system = random_prompts(1, 1024, vocab, 4242)[0]
            progress.step(f"sharing, {name}: 16 requests on a 1,024-token system prompt")
            await mlxrt_run(rt, [system + random_prompts(1, 8, vocab, 1)[0]], 2)
            tails = random_prompts(16, 64, vocab, 4343)
            run = await mlxrt_run(rt, [system + tail for tail in tails], options.new_tokens)
            kv = (await rt.stats()).kv
            out[f"{name}_shared_prefix"] = {"peak_kv_bytes": kv.peak_physical_bytes, "steady_decode_tok_s": steady_decode(run)}
        async with Runtime.open(_with_kv(config, 0, options.group_size, block_size=block_size)) as rt:
            progress.step(f"sharing, {name}: one 2,048-token request beside 15 of 128")
            long = min(2048, rt.model_info.max_context - options.new_tokens - 1)
            prompts = random_prompts(1, long, vocab, 5) + random_prompts(15, 128, vocab, 6)
            run = await mlxrt_run(rt, prompts, options.new_tokens)
            kv = (await rt.stats()).kv
            out[f"{name}_long_and_short"] = {"peak_kv_bytes": kv.peak_physical_bytes, "throughput_tok_s": run.summary()["throughput_tok_s"]}
    return out


def _admitted(layers) -> int:
    ledger = KvLedger(bytes_per_token=0, budget_bytes=1 << 30, layers=layers)
    count = 0
    while ledger.reserve(f"r{count}", 1024)[0].granted:
        count += 1
    return count


async def _agreement(config: RuntimeConfig, options: KvBenchOptions, progress: Progress) -> dict:
    from runtime.runtime import Runtime

    prompt = random_prompts(1, 64, BENCH_VOCAB, 5)[0]
    request = GenerateRequest(prompt_ids=prompt, max_tokens=options.agreement_tokens, ignore_eos=True)
    streams = {}
    for bits in _format_bits(options):
        progress.step(f"agreement: {AGREEMENT_MODEL}, {'float' if not bits else f'{bits}-bit'} KV, {options.agreement_tokens} tokens")
        single = msgspec.structs.replace(_with_kv(config, bits, options.group_size, AGREEMENT_MODEL), scheduler=SchedulerConfig(max_batch_size=1))
        async with Runtime.open(single) as rt:
            streams[bits] = [t async for e in rt.generate(request) if isinstance(e, TokenDelta) for t in e.token_ids]
    reference = streams[0]
    out = {}
    for bits, tokens in streams.items():
        if bits:
            first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(reference))
            same = statistics.mean(a == b for a, b in zip(tokens, reference))
            out[f"int{bits}"] = {"agree_until": first, "same_position_share": same, "tokens": len(reference)}
    return out


def format_kv_table(r: dict) -> str:
    lines = []
    bpt = r["mlxrt"]["bytes_per_token"]
    admitted = r["mlxrt"]["admitted_1024"]
    lines.append("KV bytes per token: " + ", ".join(f"{k} {v}" for k, v in bpt.items()))
    lines.append("1,024-token conversations in a 1 GiB budget: " + ", ".join(f"{k} {v}" for k, v in admitted.items()))
    lines.append(f"{'format':<8}{'context':>8}{'conc':>6}{'decode tok/s':>14}{'TTFT p50':>10}{'mlx-lm':>10}{'ratio':>8}")
    for key, s in r["mlxrt"].items():
        if not key.endswith(tuple(f"_c{n}" for n in range(1, 257))):
            continue
        fmt, ctx, conc = key.split("_")
        ref = r["mlx_lm"].get(key.replace("paged", "float"))  # (mlx-lm's float KV is one contiguous cache)
        decode = s["steady_decode_tok_s"]
        theirs = f"{ref['steady_decode_tok_s']:10.1f}{decode / ref['steady_decode_tok_s']:8.2f}" if ref else f"{'':>18}"
        row = f"{fmt:<8}{ctx[3:]:>8}{conc[1:]:>6}{decode:14.1f}{s['ttft_p50_s']:10.3f}"
        lines.append(row + theirs)
    for bits, f in r.get("fidelity", {}).items():
        lines.append(f"fidelity {bits}: mean |dlogprob| mlxrt {f['mlxrt']:.4f}, mlx-lm QuantizedKVCache {f['mlx_lm']:.4f}")
    for bits, a in r.get("agreement", {}).items():
        lines.append(f"agreement {bits} vs float ({AGREEMENT_MODEL}): same until {a['agree_until']}/{a['tokens']}, {a['same_position_share']:.0%} of positions")
    for key, figures in r.get("sharing", {}).items():
        fmt, _, workload = key.partition("_")
        peak = figures["peak_kv_bytes"] / 2**20
        speed = f"decode {figures['steady_decode_tok_s']:.1f} tok/s" if "steady_decode_tok_s" in figures else f"{figures['throughput_tok_s']:.1f} tok/s overall"
        lines.append(f"{workload.replace('_', ' ')} ({'blocks' if fmt == 'paged' else 'rows'}): peak KV {peak:.1f} MiB, {speed}")
    return "\n".join(lines)
