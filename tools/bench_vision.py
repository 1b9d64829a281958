"""`mlxrt bench --vision`: image requests (vision-language models, `docs/vision.md`).

- `beside`: 8 text rows decoding; an image request arrives: its time to first token, and the text
  rows' decode tokens/s while its vision tower and prefill run against before it came; then a text
  prompt of the same length arrives (the same figures: what any prompt of that length costs them).
- `repeat`: an image request's TTFT cold, then the same image and question again (a prefix-cache
  hit: its `cached_tokens`, and the TTFT ratio).
- `batch`: 8 image requests (8 images) at once through mlxrt against mlx-vlm's own
  `batch_generate` on the same model directory, alternating; generated tokens/s over the wall time.

The default model is `builtin:bench-idefics3` (random weights in SmolVLM-256M's shape: a 12-layer
SigLIP tower at 512 pixels, 64 tokens per tile, a 30-layer 576-wide llama).
"""

from __future__ import annotations

import importlib
import io
import itertools
import statistics
import time
from dataclasses import asdict, dataclass

import anyio
import numpy as np

from protocols.api import Finished, GenerateRequest, SamplingParams, TokenDelta
from runtime.config import RuntimeConfig
from runtime.progress import Progress

WORKLOADS = ("beside", "repeat", "batch")
DEFAULT_MODEL = "builtin:bench-idefics3"
QUESTION = "Describe this picture in detail."
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class VisionBenchOptions:
    workloads: tuple[str, ...] = WORKLOADS
    repeats: int = 3
    text_rows: int = 8
    text_prompt: str = "Write a long story about a lighthouse keeper and the sea."
    new_tokens: int = 32
    batch: int = 8
    width: int = 640
    height: int = 480


def _png(seed: int, width: int, height: int) -> bytes:
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _image_request(image: bytes, new_tokens: int) -> GenerateRequest:
    content = [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]
    return GenerateRequest(messages=[{"role": "user", "content": content}], max_tokens=new_tokens, ignore_eos=True, sampling=GREEDY)


async def _timed(rt, request: GenerateRequest) -> dict:
    start, first, tokens, usage = time.perf_counter(), 0.0, 0, None
    async for event in rt.generate(request):
        if isinstance(event, TokenDelta):
            first = first or time.perf_counter() - start
            tokens += len(event.token_ids)
        elif isinstance(event, Finished):
            usage = event.usage
    assert usage is not None
    return {
        "ttft_s": first,
        "tokens": tokens,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
        "wall_s": time.perf_counter() - start,
    }


async def _beside(rt, options: VisionBenchOptions, seed: int) -> dict:
    """Text rows decoding; an image request arrives once every row has its first token; then,
    for comparison, a text prompt of the image prompt's length (its own random ids)."""
    stamps: list[float] = []
    started = anyio.Event()
    first_tokens = 0

    async def text_row() -> None:
        nonlocal first_tokens
        request = GenerateRequest(messages=[{"role": "user", "content": options.text_prompt}], max_tokens=4096, ignore_eos=True, sampling=GREEDY)
        seen = False
        async for event in rt.generate(request):
            if isinstance(event, TokenDelta):
                stamps.extend([time.perf_counter()] * len(event.token_ids))
                if not seen:
                    seen, first_tokens = True, first_tokens + 1
                    if first_tokens == options.text_rows:
                        started.set()

    async def arrival(request: GenerateRequest) -> tuple[dict, float, float]:
        """The request's figures, the text rows' tokens/s from its arrival to its first token,
        and the longest the rows went without a token meanwhile."""
        arrived = time.perf_counter()
        timed = await _timed(rt, request)
        answered = arrived + timed["ttft_s"]
        during = [t for t in stamps if arrived <= t < answered]
        edges = [arrived, *during, answered]
        return timed, len(during) / max(answered - arrived, 1e-9), max(b - a for a, b in itertools.pairwise(edges))

    result: dict = {}
    async with anyio.create_task_group() as tg:
        for _ in range(options.text_rows):
            tg.start_soon(text_row)
        await started.wait()
        await anyio.sleep(3.0)  # the rows' decode rate alone
        before = [t for t in stamps if t >= time.perf_counter() - 3.0]
        image, image_during, image_gap = await arrival(_image_request(_png(seed, options.width, options.height), 4))
        ids = np.random.RandomState(seed).randint(100, 1000, image["prompt_tokens"]).tolist()
        text, text_during, text_gap = await arrival(GenerateRequest(prompt_ids=ids, max_tokens=4, ignore_eos=True, sampling=GREEDY))
        tg.cancel_scope.cancel()
    result["image_ttft_s"] = image["ttft_s"]
    result["image_prompt_tokens"] = image["prompt_tokens"]
    result["text_tok_s_before"] = len(before) / 3.0
    result["text_tok_s_during"] = image_during
    result["text_max_gap_s"] = image_gap
    result["text_prompt_ttft_s"] = text["ttft_s"]
    result["text_tok_s_during_text_prompt"] = text_during
    result["text_max_gap_s_text_prompt"] = text_gap
    return result


def _mlx_vlm_batch(images: list[bytes], new_tokens: int, model_and_processor) -> dict:
    """mlx-vlm's `batch_generate` on the same images and question."""
    from PIL import Image

    model, processor = model_and_processor
    ar = importlib.import_module("mlx_vlm.generate.ar")
    pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    start = time.perf_counter()
    # (It renders the question with the model's chat template and an image itself.)
    response = ar.batch_generate(model, processor, images=pictures, prompts=[QUESTION] * len(images), max_tokens=new_tokens)  # (greedy: its default sampler)
    wall = time.perf_counter() - start
    stats = response.stats
    return {"tokens": stats.generation_tokens, "prompt_tokens": stats.prompt_tokens, "wall_s": wall, "tok_s": stats.generation_tokens / wall}


async def run_vision_bench(config: RuntimeConfig, options: VisionBenchOptions) -> dict:
    from runtime.runtime import Runtime

    progress = Progress("bench")
    results: dict = {"options": asdict(options)}
    beside, repeat, ours, theirs = [], [], [], []
    loaded = None
    for rep in range(options.repeats):
        async with Runtime.open(config) as rt:
            info = rt.model_info
            results["model"] = {"path": info.path, "type": info.model_type, "dtype": info.dtype, "device": info.device, "parameters": info.num_parameters}
            # The load's warm-up runs text steps: the vision tower's kernels compile here.
            await _timed(rt, _image_request(_png(99, options.width, options.height), 2))
            if "beside" in options.workloads:
                progress.step(f"beside ({rep + 1}/{options.repeats}): an image request among {options.text_rows} decoding text rows")
                beside.append(await _beside(rt, options, 100 + rep))
                progress.step(f"beside ({rep + 1}): {beside[-1]}")  # (each repeat's figures, as they come)
            if "repeat" in options.workloads:
                progress.step(f"repeat ({rep + 1}/{options.repeats}): an image request, then the same again")
                image = _png(200 + rep, options.width, options.height)
                cold = await _timed(rt, _image_request(image, 4))
                warm = await _timed(rt, _image_request(image, 4))
                repeat.append(
                    {
                        "cold_ttft_s": cold["ttft_s"],
                        "hit_ttft_s": warm["ttft_s"],
                        "ratio": warm["ttft_s"] / cold["ttft_s"],
                        "cached_tokens": warm["cached_tokens"],
                        "prompt_tokens": warm["prompt_tokens"],
                    }
                )
                progress.step(f"repeat ({rep + 1}): {repeat[-1]}")
            if "batch" in options.workloads:
                progress.step(f"batch ({rep + 1}/{options.repeats}): {options.batch} image requests at once, mlxrt")
                images = [_png(300 + 10 * rep + i, options.width, options.height) for i in range(options.batch)]
                start = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    runs: list[dict] = []

                    async def one(data: bytes, runs: list[dict] = runs) -> None:
                        runs.append(await _timed(rt, _image_request(data, options.new_tokens)))

                    for data in images:
                        tg.start_soon(one, data)
                wall = time.perf_counter() - start
                tokens = sum(r["tokens"] for r in runs)
                ours.append({"tokens": tokens, "prompt_tokens": sum(r["prompt_tokens"] for r in runs), "wall_s": wall, "tok_s": tokens / wall})
                progress.step(f"batch ({rep + 1}) mlxrt: {ours[-1]}")
        if "batch" in options.workloads:
            progress.step(f"batch ({rep + 1}/{options.repeats}): the same through mlx-vlm's batch_generate")
            # On this thread, with no runtime open (MLX streams are per thread).
            loaded = loaded or _load_mlx_vlm(info.path)
            theirs.append(_mlx_vlm_batch(images, options.new_tokens, loaded))
            progress.step(f"batch ({rep + 1}) mlx-vlm: {theirs[-1]}")
    if beside:
        results["beside"] = {key: statistics.median(r[key] for r in beside) for key in beside[0]}
        results["beside"]["kept"] = results["beside"]["text_tok_s_during"] / results["beside"]["text_tok_s_before"]
    if repeat:
        results["repeat"] = {key: statistics.median(r[key] for r in repeat) for key in repeat[0]}
    if ours:
        results["batch"] = {
            "mlxrt": {key: statistics.median(r[key] for r in ours) for key in ours[0]},
            "mlx_vlm": {key: statistics.median(r[key] for r in theirs) for key in theirs[0]},
        }
        results["batch"]["ratio"] = results["batch"]["mlxrt"]["tok_s"] / results["batch"]["mlx_vlm"]["tok_s"]
    progress.done("vision benchmark finished")
    return results


def _load_mlx_vlm(path: str):
    import mlx.core as mx
    from mlx_vlm import load

    model, processor = load(path)
    model.set_dtype(mx.float32)
    return model, processor


def format_vision_table(results: dict) -> str:
    m = results["model"]
    lines = [f"model: {m['path']} ({m['type']}, {m['parameters'] / 1e6:.0f}M params, {m['dtype']} on {m['device']})"]
    if "beside" in results:
        b = results["beside"]
        lines.append(
            f"beside {results['options']['text_rows']} text rows: image TTFT {b['image_ttft_s']:.2f} s ({b['image_prompt_tokens']:.0f} prompt tokens);"
            f" text decode {b['text_tok_s_before']:.1f} tok/s before, {b['text_tok_s_during']:.1f} during its prefill ({b['kept']:.2f}x kept),"
            f" longest without a token {b['text_max_gap_s']:.2f} s; a text prompt of that length: TTFT {b['text_prompt_ttft_s']:.2f} s,"
            f" text decode {b['text_tok_s_during_text_prompt']:.1f} tok/s during it, longest without a token {b['text_max_gap_s_text_prompt']:.2f} s"
        )
    if "repeat" in results:
        r = results["repeat"]
        lines.append(
            f"repeat: TTFT cold {r['cold_ttft_s']:.2f} s, same image again {r['hit_ttft_s']:.3f} s ({r['ratio']:.3f}x),"
            f" cached {r['cached_tokens']:.0f} of {r['prompt_tokens']:.0f} prompt tokens"
        )
    if "batch" in results:
        b = results["batch"]
        lines.append(
            f"batch of {results['options']['batch']} image requests: mlxrt {b['mlxrt']['tok_s']:.2f} tok/s"
            f" ({b['mlxrt']['tokens']:.0f} tokens, {b['mlxrt']['prompt_tokens']:.0f} prompt tokens), mlx-vlm batch_generate"
            f" {b['mlx_vlm']['tok_s']:.2f} tok/s ({b['mlx_vlm']['tokens']:.0f}, {b['mlx_vlm']['prompt_tokens']:.0f}): {b['ratio']:.2f}x"
        )
    return "\n".join(lines)
