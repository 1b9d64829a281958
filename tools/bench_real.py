"""`mlxrt bench --real`: a trained model (SmolLM2-135M-Instruct, the default) on real text.

Workloads, one process, mlx-lm on the same weights where it has a counterpart:
- `throughput`: `mlxrt bench`'s concurrency (c1 / c8 / c16, TTFT p50/p99), long-prefill
  interference and prefix-reuse workloads with prompts cut from the held text
  (`tests/data/pride-and-prejudice-1-6.txt`);
- `lookup`: prompt-lookup speculation on copy-heavy chats the model really does: rewrite a
  Python function renaming a variable, and fix the typos in a paragraph of the text; at
  temperature 0 and 0.7, on against off (streams must be equal: `exact` acceptance), with
  acceptance, tokens per target forward, and whether the answer did what was asked;
- `perplexity`: perplexity of the held text, teacher-forced over windows, with float, 8-bit
  and 4-bit KV through mlxrt's decode batch, beside mlx-lm's `KVCache` and `QuantizedKVCache`;
- `structured`: a JSON-schema request: the answer and whether it validates.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import re
import statistics
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec

from actors.mlx_thread import MlxThread
from protocols.api import Finished, GenerateRequest, SamplingParams
from runtime.config import KvConfig, RuntimeConfig, SpeculativeConfig
from runtime.progress import Progress
from tools.bench import BenchOptions, run_bench
from tools.bench_common import generate_all, load_mlx_lm_model, spec_summary
from tools.bench_kv import forced_logprobs_batch, forced_logprobs_mlx_lm

MODEL = "builtin:smollm2-135m-instruct"
TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "pride-and-prejudice-1-6.txt"
WORKLOADS = ("throughput", "lookup", "perplexity", "structured")


@dataclass(frozen=True)
class RealBenchOptions:
    workloads: tuple[str, ...] = WORKLOADS
    repeats: int = 3
    new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 0.7)
    # Perplexity: windows of this many tokens (the first `context` only condition).
    windows: int = 4
    window_tokens: int = 1024
    context_tokens: int = 32
    group_size: int = 64
    seed: int = 0


# -- copy-heavy tasks -----------------------------------------------------------------------------


def _functions() -> list[tuple[str, str, str]]:
    """(source, old name, new name): real functions of the standard library."""
    import shlex
    import statistics as stats_module
    import textwrap as textwrap_module

    return [
        (inspect.getsource(stats_module.median), "data", "values"),
        (inspect.getsource(textwrap_module.indent), "prefix", "margin"),
        (inspect.getsource(shlex.quote), "s", "text"),
    ]


def _with_typos(paragraph: str, rng: random.Random) -> str:
    """One word in seven (of four letters or more) with two neighbouring letters swapped."""
    words = paragraph.split(" ")
    for i, word in enumerate(words):
        if len(word) >= 4 and word.isalpha() and rng.random() < 1 / 7:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    return " ".join(words)


def _paragraphs(text: str, n: int, rng: random.Random) -> list[str]:
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if 300 <= len(p) <= 900 and not p.startswith("CHAPTER")]
    return rng.sample(paragraphs, n)


@dataclass(frozen=True)
class Task:
    kind: str
    prompt: str
    # The answer did the task: the expected text appears in it (and the old name does not).
    expect: str
    reject: str | None = None

    def done(self, answer: str) -> bool:
        if self.reject is not None and re.search(rf"\b{re.escape(self.reject)}\b", answer):
            return False
        return self.expect in " ".join(answer.split())


def copy_tasks(text: str, seed: int) -> list[Task]:
    rng = random.Random(seed)
    tasks = [
        Task(
            "rename",
            f"Rewrite this Python function, renaming the variable `{old}` to `{new}`. Reply with the code only.\n\n```python\n{textwrap.dedent(src).strip()}\n```",
            expect=new,
            reject=old,
        )
        for src, old, new in _functions()
    ]
    for paragraph in _paragraphs(text, 3, rng):
        tasks.append(
            Task(
                "typos",
                f"Fix the spelling mistakes in this paragraph. Reply with the corrected paragraph only.\n\n{_with_typos(paragraph, rng)}",
                paragraph[:60],
            )
        )
    return tasks


async def _lookup(config: RuntimeConfig, text: str, options: RealBenchOptions, progress: Progress) -> dict:
    from runtime.runtime import Runtime

    tasks = copy_tasks(text, options.seed)
    results: dict = {}
    on_config = msgspec.structs.replace(config, speculative=SpeculativeConfig(lookup=True))
    async with Runtime.open(config) as off, Runtime.open(on_config) as on:
        for temperature in options.temperatures:
            for kind in ("rename", "typos"):
                rates: dict[str, list[float]] = {"off": [], "on": []}
                ends: list[Finished] = []
                done = 0
                selected = [t for t in tasks if t.kind == kind]
                for i, task in enumerate(selected):
                    request = GenerateRequest(
                        messages=[{"role": "user", "content": task.prompt}],
                        max_tokens=512,
                        sampling=SamplingParams(temperature=temperature, seed=options.seed + i),
                    )
                    outputs = {}
                    for name, rt in (("off", off), ("on", on)):
                        progress.step(f"lookup, {kind} {i + 1}/{len(selected)} at temperature {temperature}: speculation {name}")
                        wall, tokens, finished = await generate_all(rt, [request])
                        rates[name].append(len(tokens[0]) / wall)
                        outputs[name] = tokens[0]
                        if name == "on":
                            ends += finished
                    if outputs["on"] != outputs["off"]:
                        raise AssertionError(f"speculation changed a stream ({kind} {i}, temperature {temperature})")
                    done += task.done(on.tokenizer.decode(outputs["on"]))
                off_rate, on_rate = statistics.median(rates["off"]), statistics.median(rates["on"])
                results[f"{kind}_t{temperature:g}"] = {
                    "off_tok_s": off_rate,
                    "on_tok_s": on_rate,
                    "speedup": on_rate / off_rate,
                    "tasks_done": f"{done}/{len(selected)}",
                } | spec_summary(ends)
    return results


# -- perplexity with quantized KV ----------------------------------------------------------------


class _Perplexity:
    """Teacher-forced logprobs of the held text on the MLX thread: ours and mlx-lm's."""

    def load(self, path: str) -> None:
        from engine.kv.layout import probe_layout

        self.model = load_mlx_lm_model(path)
        self.layout = probe_layout(self.model)

    def run(self, windows: list[list[int]], context: int, bits_list: tuple[int, ...], group_size: int) -> dict:
        from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

        from policies.layout import with_kv_quantization

        prompts, forced = [w[:context] for w in windows], [w[context:] for w in windows]
        out = {}
        for bits in bits_list:
            layout = with_kv_quantization(self.layout, bits, group_size, 0)[0] if bits else self.layout
            ours = forced_logprobs_batch(self.model, layout, prompts, forced)
            caches = [([QuantizedKVCache(group_size, bits) for _ in self.layout] if bits else make_prompt_cache(self.model)) for _ in windows]
            theirs = [forced_logprobs_mlx_lm(self.model, p, f, c) for p, f, c in zip(prompts, forced, caches)]
            out[f"int{bits}" if bits else "float"] = {"mlxrt": _perplexity(ours), "mlx_lm": _perplexity(theirs)}
        return out


def _perplexity(logprobs: list[list[float]]) -> float:
    values = [v for row in logprobs for v in row]
    return math.exp(-sum(values) / len(values))


async def _perplexities(path: str, text_ids: list[int], options: RealBenchOptions, progress: Progress) -> dict:
    rng = random.Random(options.seed)
    starts = sorted(rng.sample(range(0, len(text_ids) - options.window_tokens), options.windows))
    windows = [text_ids[s : s + options.window_tokens] for s in starts]
    thread, side = MlxThread(name="mlx-perplexity"), _Perplexity()
    thread.start()
    try:
        progress.step("perplexity: loading the model")
        await thread.run(side.load, path)
        progress.step(f"perplexity: {options.windows} windows x {options.window_tokens - options.context_tokens} forced tokens, float / 8-bit / 4-bit KV")
        result = await thread.run(side.run, windows, options.context_tokens, (0, 8, 4), options.group_size)
    finally:
        await thread.stop()
    return {"forced_tokens": options.windows * (options.window_tokens - options.context_tokens), "group_size": options.group_size} | result


# -- structured output ----------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "maxLength": 40},
        "capital": {"type": "string", "maxLength": 40},
        "continent": {"type": "string", "enum": ["Africa", "Asia", "Europe", "North America", "Oceania", "South America"]},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
    },
    "required": ["country", "capital", "continent", "languages"],
}
# One example in the system prompt: without it the 135M model fills the fields with the
# country's name (measured: 1 sensible capital of 5 without, 2-3 of 6 with).
SYSTEM = 'You answer with JSON only. Example: for Germany, {"country": "Germany", "capital": "Berlin", "continent": "Europe", "languages": ["German"]}'


async def _structured(config: RuntimeConfig) -> dict:
    import jsonschema

    from runtime.runtime import Runtime

    answers = {}
    async with Runtime.open(config) as rt:
        for country in ("France", "Japan", "Brazil", "Canada"):
            request = GenerateRequest(
                messages=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Give the capital, continent and main languages of {country} as JSON."},
                ],
                max_tokens=128,
                response_format={"type": "json_schema", "json_schema": {"name": "country", "schema": SCHEMA}},
            )
            _, tokens, ends = await generate_all(rt, [request])
            text = rt.tokenizer.decode(tokens[0])
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            answers[country] = {"answer": text, "valid": valid, "finish_reason": ends[0].finish_reason}
    return answers


# -- the whole run ----------------------------------------------------------------------------------


async def run_real_bench(config: RuntimeConfig, options: RealBenchOptions) -> dict:
    from runtime.runtime import Runtime

    progress = Progress("bench --real")
    config = msgspec.structs.replace(config, kv=msgspec.structs.replace(config.kv, prefix_cache_bytes=KvConfig().prefix_cache_bytes))
    text = TEXT.read_text()
    results: dict = {"options": asdict(options), "text": f"{TEXT.name}"}
    if "throughput" in options.workloads:
        bench = BenchOptions(repeats=options.repeats, new_tokens=options.new_tokens, workloads=("concurrency", "interference", "prefix"), text_path=str(TEXT))
        results["throughput"] = await run_bench(config, bench)
    if "lookup" in options.workloads:
        results["lookup"] = await _lookup(config, text, options, progress)
    if "perplexity" in options.workloads or "structured" in options.workloads:
        async with Runtime.open(config) as rt:
            path, text_ids = rt.model_info.path, rt.tokenizer.encode(text, add_special_tokens=False)
            results["model"] = {
                "path": path,
                "type": rt.model_info.model_type,
                "params": rt.model_info.num_parameters,
                "quantization": rt.model_info.quantization,
            }
        if "perplexity" in options.workloads:
            results["perplexity"] = await _perplexities(path, text_ids, options, progress)
        if "structured" in options.workloads:
            progress.step("structured output: three JSON-schema requests")
            results["structured"] = await _structured(config)
    progress.done("real-model benchmark finished")
    return results


def format_real_table(results: dict) -> str:
    from tools.bench import format_table

    lines = []
    if "throughput" in results:
        lines += ["throughput (prompts cut from the held text):", format_table(results["throughput"]), ""]
    if "lookup" in results:
        lines.append(f"{'prompt lookup':<22}{'off tok/s':>10}{'on tok/s':>10}{'speedup':>9}{'accept':>8}{'tok/fwd':>9}{'done':>7}")
        for name, r in results["lookup"].items():
            lines.append(
                f"{name:<22}{r['off_tok_s']:10.1f}{r['on_tok_s']:10.1f}{r['speedup']:9.2f}{r['acceptance']:8.2f}{r['tokens_per_forward']:9.2f}{r['tasks_done']:>7}"
            )
        lines.append("")
    if "perplexity" in results:
        p = results["perplexity"]
        lines.append(f"perplexity of the held text ({p['forced_tokens']} forced tokens, group {p['group_size']}):  mlxrt   mlx-lm")
        for name in ("float", "int8", "int4"):
            lines.append(f"  {name:<8}{p[name]['mlxrt']:>10.3f}{p[name]['mlx_lm']:>9.3f}")
        lines.append("")
    for country, r in results.get("structured", {}).items():
        lines.append(f"json_schema {country}: {'valid' if r['valid'] else 'INVALID'}: {r['answer']}")
    return "\n".join(lines)
