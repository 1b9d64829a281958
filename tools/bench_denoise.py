"""`mlxrt bench --denoise`: denoising requests (diffusion language models, `docs/denoising.md`).

- `alone`: one denoising request through mlxrt, then the same prompt and seed through mlx-vlm's
  own `stream_diffusion_generate` on the same model directory (alternating which goes first):
  answer tokens per second over the wall time, denoising steps per answer, and whether the
  answers are the same tokens.
- `together`: `together` denoising requests submitted at once through mlxrt (canvases of one
  length step in one batched decoder forward), against the same requests one after another
  through mlx-vlm's loop (which denoises one sequence at a time): answer tokens per second over
  the wall time of all of them, and whether every answer is the same tokens.
- `beside`: an autoregressive request decoding alone, then with denoising requests running beside
  it on the same MLX thread (a model pool serving both models): its decode tokens/s while they
  run against alone, and the longest it went without a token.

Default models: `builtin:bench-diffusion-gemma` (random weights: an 8-layer, 512-wide
DiffusionGemma, 8 experts, a 64-position canvas, at most 24 steps per canvas) and, beside it,
`builtin:bench` (SmolLM-135M's shape).
"""

from __future__ import annotations

import importlib
import itertools
import statistics
import time
from dataclasses import asdict, dataclass

import anyio
import msgspec

from protocols.api import Finished, GenerateRequest, SamplingParams, TokenDelta
from runtime.config import PoolModelConfig, RuntimeConfig
from runtime.progress import Progress

WORKLOADS = ("alone", "together", "beside")
DEFAULT_MODEL = "builtin:bench-diffusion-gemma"
AR_MODEL = "builtin:bench"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True)
class DenoiseBenchOptions:
    workloads: tuple[str, ...] = WORKLOADS
    repeats: int = 3
    new_tokens: int = 64
    # Denoising requests running beside the autoregressive one.
    beside: int = 2
    # Denoising requests submitted at once (`together`).
    together: int = 4


async def _timed(generate, request: GenerateRequest) -> dict:
    start, first, tokens, stamps, finished = time.perf_counter(), 0.0, [], [], None
    async for event in generate(request):
        if isinstance(event, TokenDelta) and event.token_ids:
            first = first or time.perf_counter() - start
            tokens += event.token_ids
            stamps += [time.perf_counter()] * len(event.token_ids)
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, "tok_s": len(tokens) / wall, "ttft_s": first, "steps": finished.denoising_steps, "stamps": stamps}


def _mlx_vlm_runs(path: str, prompts: list[list[int]], new_tokens: int, seeds: list[int]) -> list[dict]:
    """mlx-vlm's loop on this thread (no runtime open: MLX streams are per thread), one prompt
    after another (the model loaded once, before the clock starts)."""
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.tokenizer_utils import NaiveStreamingDetokenizer
    from mlx_vlm.utils import load_model

    loop = importlib.import_module("mlx_vlm.generate.diffusion")
    from pathlib import Path

    model = load_model(Path(path))
    model.set_dtype(mx.float32)
    tokenizer = load_tokenizer(path)._tokenizer
    tokenizer.stopping_criteria = lambda _token: False  # (the requests ignore EOS)
    tokenizer.stopping_criteria.add_eos_token_ids = lambda _ids: None

    class Processor:
        detokenizer = NaiveStreamingDetokenizer(tokenizer)

    runs = []
    for prompt_ids, seed in zip(prompts, seeds):
        mx.random.seed(seed)
        start = time.perf_counter()
        if getattr(model.config, "mask_token_id", None) is not None:  # block diffusion: its own loop, as the stream calls it
            out = model.language_model.generate(mx.array([prompt_ids]), temperature=0.0, gen_length=new_tokens, eos_early_stop=True)
            wall = time.perf_counter() - start
            tokens = [int(t) for t in out[0].tolist()]
            runs.append({"tokens": tokens, "wall_s": wall, "tok_s": len(tokens) / wall, "steps": None})
            continue
        results = list(
            loop.stream_diffusion_generate(
                model, Processor(), tokenizer, mx.array([prompt_ids]), None, None, max_tokens=new_tokens, skip_special_token_ids=[], temperature=0.0
            )
        )
        wall = time.perf_counter() - start
        tokens = [r.token for r in results if r.finish_reason is None and not r.diffusion_block_complete and not r.is_draft]
        runs.append({"tokens": tokens, "wall_s": wall, "tok_s": len(tokens) / wall, "steps": results[-1].diffusion_denoising_steps})
    return runs


def _request(prompt_ids: list[int], new_tokens: int, seed: int, **kw) -> GenerateRequest:
    return GenerateRequest(prompt_ids=prompt_ids, max_tokens=new_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0, seed=seed), **kw)


async def _alone(config: RuntimeConfig, options: DenoiseBenchOptions, rep: int, progress: Progress, known: dict) -> dict:
    """One pair of runs; `known` keeps the model's path and the prompt across repeats (the first
    repeat learns them from the runtime, so it goes first there; later ones alternate)."""
    from runtime.runtime import Runtime

    seed = 100 + rep
    runs: dict = {}

    async def ours() -> None:
        async with Runtime.open(config) as rt:
            known["prompt_ids"] = ids = rt.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
            known["path"] = rt.model_info.path
            await _timed(rt.generate, _request(ids[:8], 4, 0))  # (kernels for this prompt's shapes)
            runs["mlxrt"] = await _timed(rt.generate, _request(ids, options.new_tokens, seed))

    def theirs() -> None:
        runs["mlx_vlm"] = _mlx_vlm_runs(known["path"], [known["prompt_ids"]], options.new_tokens, [seed])[0]

    if rep % 2 == 0 or "path" not in known:
        await ours()
        theirs()
    else:
        theirs()
        await ours()
    mlxrt, mlx_vlm = runs["mlxrt"], runs["mlx_vlm"]
    result = {
        "mlxrt_tok_s": mlxrt["tok_s"],
        "mlx_vlm_tok_s": mlx_vlm["tok_s"],
        "ratio": mlxrt["tok_s"] / mlx_vlm["tok_s"],
        "mlxrt_steps": mlxrt["steps"],
        "mlx_vlm_steps": mlx_vlm["steps"],
        "same_tokens": mlxrt["tokens"] == mlx_vlm["tokens"],
        "tokens": len(mlxrt["tokens"]),
        "prompt_tokens": len(known["prompt_ids"]),
    }
    progress.step(f"alone ({rep + 1}): {result}")
    return result


async def _together(config: RuntimeConfig, options: DenoiseBenchOptions, rep: int, progress: Progress, known: dict) -> dict:
    """All requests at once through mlxrt, then one after another through mlx-vlm's loop
    (the first repeat learns the prompts from the runtime, so it goes first there; later ones
    alternate)."""
    from runtime.runtime import Runtime

    n, seeds = options.together, [300 + 10 * rep + i for i in range(options.together)]
    runs: dict[str, dict] = {}

    async def ours() -> None:
        async with Runtime.open(config) as rt:
            known["prompts"] = prompts = known.get("prompts") or [
                rt.tokenizer.apply_chat_template([{"role": "user", "content": f"{PROMPT} (Story {i + 1}.)"}], add_generation_prompt=True) for i in range(n)
            ]
            known["path"] = rt.model_info.path
            await _timed(rt.generate, _request(prompts[0][:8], 4, 0))  # (kernels for these shapes)
            start = time.perf_counter()
            results: list = [None] * n

            async def one(i: int) -> None:
                results[i] = await _timed(rt.generate, _request(prompts[i], options.new_tokens, seeds[i]))

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
            runs["mlxrt"] = {"wall_s": time.perf_counter() - start, "answers": [r["tokens"] for r in results]}

    def theirs() -> None:
        answers = _mlx_vlm_runs(known["path"], known["prompts"], options.new_tokens, seeds)
        runs["mlx_vlm"] = {"wall_s": sum(a["wall_s"] for a in answers), "answers": [a["tokens"] for a in answers]}

    if rep % 2 == 0 or "prompts" not in known:
        await ours()
        theirs()
    else:
        theirs()
        await ours()
    tokens = sum(len(a) for a in runs["mlxrt"]["answers"])
    result = {
        "mlxrt_tok_s": tokens / runs["mlxrt"]["wall_s"],
        "mlx_vlm_tok_s": tokens / runs["mlx_vlm"]["wall_s"],
        "ratio": runs["mlx_vlm"]["wall_s"] / runs["mlxrt"]["wall_s"],
        "same_tokens": runs["mlxrt"]["answers"] == runs["mlx_vlm"]["answers"],
        "tokens": tokens,
    }
    progress.step(f"together ({rep + 1}): {result}")
    return result


async def _beside(config: RuntimeConfig, options: DenoiseBenchOptions, rep: int, progress: Progress) -> dict:
    from runtime.pool import ModelPool

    pool_config = msgspec.structs.replace(
        config, model=msgspec.structs.replace(config.model, path=AR_MODEL), models=[PoolModelConfig(name="diffusion", path=config.model.path)]
    )
    ar_ids = [(37 * i + 11) % 30000 + 100 for i in range(128)]
    async with ModelPool.open(pool_config) as pool:
        prompt = [(53 * i + 7) % 30000 + 100 for i in range(64)]
        await _timed(pool.generate, _request(prompt[:8], 4, 0, model="diffusion"))  # loaded and warm
        alone = await _timed(pool.generate, _request(ar_ids, 96, 1))
        ar_rate_alone = (len(alone["stamps"]) - 1) / (alone["stamps"][-1] - alone["stamps"][0])
        results: dict = {}

        async def denoise(i: int) -> None:
            results[i] = await _timed(pool.generate, _request(prompt, options.new_tokens, 200 + i, model="diffusion"))

        async with anyio.create_task_group() as tg:
            for i in range(options.beside):
                tg.start_soon(denoise, i)
            await anyio.sleep(0.5)  # (the denoising requests are prefilled and denoising)
            with_ar = await _timed(pool.generate, _request(ar_ids, 96, 1))
        ends = [r["wall_s"] for r in results.values()]
    stamps = with_ar["stamps"]
    # The AR row's rate while the denoising requests ran (they end at different times).
    window = [t for t in stamps if t <= stamps[0] + min(ends)]
    rate = (len(window) - 1) / (window[-1] - window[0]) if len(window) > 2 else float("nan")
    gaps = [b - a for a, b in itertools.pairwise(window)]
    result = {
        "ar_tok_s_alone": ar_rate_alone,
        "ar_tok_s_beside": rate,
        "kept": rate / ar_rate_alone,
        "ar_longest_gap_s": max(gaps) if gaps else float("nan"),
        "denoise_tok_s": statistics.median(r["tok_s"] for r in results.values()),
        "same_ar_tokens": with_ar["tokens"] == alone["tokens"],
    }
    progress.step(f"beside ({rep + 1}): {result}")
    return result


async def run_denoise_bench(config: RuntimeConfig, options: DenoiseBenchOptions) -> dict:
    progress = Progress("bench")
    results: dict = {"options": asdict(options)}
    alone: list[dict] = []
    together: list[dict] = []
    beside: list[dict] = []
    known: dict = {}
    known_together: dict = {}
    for rep in range(options.repeats):
        if "alone" in options.workloads:
            progress.step(f"alone ({rep + 1}/{options.repeats}): one denoising request, mlxrt then mlx-vlm's loop")
            alone.append(await _alone(config, options, rep, progress, known))
        if "together" in options.workloads:
            progress.step(f"together ({rep + 1}/{options.repeats}): {options.together} denoising requests at once, then one by one through mlx-vlm's loop")
            together.append(await _together(config, options, rep, progress, known_together))
        if "beside" in options.workloads:
            progress.step(f"beside ({rep + 1}/{options.repeats}): an AR request alone, then beside {options.beside} denoising requests")
            beside.append(await _beside(config, options, rep, progress))
    for name, runs in (("alone", alone), ("together", together), ("beside", beside)):
        if runs:
            results[name] = {
                key: (
                    all(r[key] for r in runs) if isinstance(runs[0][key], bool) else None if runs[0][key] is None else statistics.median(r[key] for r in runs)
                )
                for key in runs[0]
            }
    return results


def format_denoise_table(results: dict) -> str:
    lines = []
    if "alone" in results:
        a = results["alone"]
        lines.append(
            f"alone: mlxrt {a['mlxrt_tok_s']:.2f} tok/s, mlx-vlm's loop {a['mlx_vlm_tok_s']:.2f} tok/s ({a['ratio']:.2f}x);"
            f" {a['mlxrt_steps']:.0f} steps per answer (mlx-vlm {'n/a' if a['mlx_vlm_steps'] is None else format(a['mlx_vlm_steps'], '.0f')});"
            f" {a['tokens']:.0f} tokens,"
            f" {a['prompt_tokens']:.0f} prompt tokens; same tokens: {a['same_tokens']}"
        )
    if "together" in results:
        t = results["together"]
        lines.append(
            f"together ({results['options']['together']} requests): mlxrt {t['mlxrt_tok_s']:.2f} tok/s, mlx-vlm's loop one by one"
            f" {t['mlx_vlm_tok_s']:.2f} tok/s ({t['ratio']:.2f}x); {t['tokens']:.0f} tokens; same tokens: {t['same_tokens']}"
        )
    if "beside" in results:
        b = results["beside"]
        lines.append(
            f"beside {results['options']['beside']} denoising requests: an AR request decodes {b['ar_tok_s_beside']:.1f} tok/s"
            f" against {b['ar_tok_s_alone']:.1f} alone ({b['kept']:.2f}x kept), longest without a token {b['ar_longest_gap_s']:.2f} s;"
            f" denoising {b['denoise_tok_s']:.2f} tok/s each; AR tokens unchanged: {b['same_ar_tokens']}"
        )
    return "\n".join(lines)
