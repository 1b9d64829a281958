"""`mlxrt bench --profile`: where a decode step's time goes, mlxrt's engine against mlx-lm on
the same model object.

Both stacks run one after the other on one MLX thread over the same model object (loaded by the
runtime's loader: the weights mlxrt serves) and the same prompts. Each decode step is timed as
it runs (pipelined, nothing added: the "step" figure), then again with the profiler on, which
evaluates every piece's output before the next starts and charges the time to the innermost
piece running (exclusive time):

- `embed+head`: the model's own code outside its layers (embedding, final norm, output head);
- `norm`, `attention` (projections and glue), `rope`, `kv write` (the cache's `update_and_fetch`),
  `mask` (the attention mask), `sdpa` (the attention itself), `mlp`, `layer glue` (residuals);
- `sampling`: mlxrt's `BatchSampler.sample`, mlx-lm's sampler and log-softmax;
- `outside`: everything else in a step: scheduling, bookkeeping, Python.

Evaluating after every piece removes the overlap of graph building with compute (mlx-lm's and
mlxrt's pipelining), so a profiled step is longer than a real one; the pieces compare across the
two stacks, and the unprofiled step time says what the real steps cost.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

CATEGORIES = ("embed+head", "norm", "attention", "rope", "kv write", "mask", "sdpa", "mlp", "layer glue", "sampling", "outside")
OUTSIDE = "outside"


@dataclass
class ProfileOptions:
    concurrency: tuple[int, ...] = (1, 16)
    prompt_tokens: int = 128
    steps: int = 24  # decode steps timed per run (after `warm` steps)
    warm: int = 4
    seed: int = 0


class Clock:
    """Exclusive time per category: at every boundary the pending work is evaluated and the
    time since the last boundary charged to the piece that was running."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.stack = [OUTSIDE]
        self.mark = time.perf_counter()

    def _charge(self) -> None:
        now = time.perf_counter()
        self.spent[self.stack[-1]] += now - self.mark
        self.mark = now

    def enter(self, kind: str, inputs: Any) -> None:
        _evaluate(inputs)
        self._charge()
        self.stack.append(kind)

    def leave(self, outputs: Any) -> None:
        _evaluate(outputs)
        self._charge()
        self.stack.pop()

    def take(self) -> dict[str, float]:
        self._charge()
        spent = dict(self.spent)
        self.spent.clear()
        return spent


def _arrays(value: Any, depth: int = 0) -> Iterator[mx.array]:
    if isinstance(value, mx.array):
        yield value
    elif depth < 3 and isinstance(value, list | tuple):
        for item in value:
            yield from _arrays(item, depth + 1)
    elif depth < 3 and isinstance(value, dict) and not isinstance(value, nn.Module):
        for item in value.values():
            yield from _arrays(item, depth + 1)
    elif depth < 3 and hasattr(value, "arrays") and callable(value.arrays):  # a SampleResult
        yield from _arrays(value.arrays(), depth + 1)


def _evaluate(value: Any) -> None:
    arrays = list(_arrays(value))
    if arrays:
        mx.eval(arrays)


class Patches:
    """Methods and functions wrapped to report to a `Clock`; `undo` puts the originals back."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._undo: list[Callable[[], None]] = []
        self._seen: set[tuple[int, str]] = set()

    def method(self, cls: type, name: str, kind: str) -> None:
        if (id(cls), name) in self._seen or not hasattr(cls, name):
            return
        self._seen.add((id(cls), name))
        own, original, clock = cls.__dict__.get(name), getattr(cls, name), self.clock

        def wrapped(this, *args, **kwargs):
            clock.enter(kind, (args, kwargs))
            out = None
            try:
                out = original(this, *args, **kwargs)
                return out
            finally:
                clock.leave(out)

        setattr(cls, name, wrapped)
        self._undo.append(lambda: setattr(cls, name, own) if own is not None else delattr(cls, name))

    def function(self, owner: Any, name: str, kind: str) -> None:
        if (id(owner), name) in self._seen or not hasattr(owner, name):
            return
        self._seen.add((id(owner), name))
        original, clock = getattr(owner, name), self.clock

        def wrapped(*args, **kwargs):
            clock.enter(kind, (args, kwargs))
            out = None
            try:
                out = original(*args, **kwargs)
                return out
            finally:
                clock.leave(out)

        setattr(owner, name, wrapped)
        self._undo.append(lambda: setattr(owner, name, original))

    def model(self, model: nn.Module) -> None:
        """The pieces of an mlx-lm model, found by the names its layers give them."""
        self.method(type(model), "__call__", "embed+head")
        inner = getattr(model, "model", None)
        if isinstance(inner, nn.Module):
            self.method(type(inner), "__call__", "embed+head")
            if (module := sys.modules.get(type(inner).__module__)) is not None:
                self.function(module, "create_attention_mask", "mask")
        for layer in model.layers:
            self.method(type(layer), "__call__", "layer glue")
            for name, child in layer.children().items():
                if not isinstance(child, nn.Module):
                    continue
                lowered = name.lower()
                if "norm" in lowered:
                    self.method(type(child), "__call__", "norm")
                elif "attn" in lowered or "attention" in lowered or "mixer" in lowered:
                    self.method(type(child), "__call__", "attention")
                    if (module := sys.modules.get(type(child).__module__)) is not None:
                        self.function(module, "scaled_dot_product_attention", "sdpa")
                    rope = getattr(child, "rope", None)
                    if isinstance(rope, nn.Module):
                        self.method(type(rope), "__call__", "rope")
                elif "mlp" in lowered or "feed_forward" in lowered or "moe" in lowered:
                    self.method(type(child), "__call__", "mlp")
        norm = getattr(inner, "norm", None)
        if isinstance(norm, nn.Module):
            self.method(type(norm), "__call__", "norm")

    def caches(self, caches: list) -> None:
        for cache in caches:
            self.method(type(cache), "update_and_fetch", "kv write")
            self.method(type(cache), "make_mask", "mask")

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
        self._seen.clear()


@dataclass
class StepTimes:
    """One stack at one concurrency: the median unprofiled step, and the mean profiled step and its pieces (ms)."""

    step_ms: float = 0.0
    profiled_ms: float = 0.0
    pieces_ms: dict[str, float] = field(default_factory=dict)


def _ms_per_step(spent: list[dict[str, float]]) -> dict[str, float]:
    # Means, so that the pieces add up to the profiled step (steps differ: some read results).
    return {k: round(statistics.fmean(s.get(k, 0.0) for s in spent) * 1000, 2) for k in CATEGORIES}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length + i)] for i in range(n)]  # staggered, as rows that joined apart


class _EngineRun:
    """mlxrt's engine: admit, prefill whole, then decode steps (what the scheduler plans)."""

    def __init__(self, engine, prompts: list[list[int]], total_steps: int):
        from protocols.api import SamplingParams
        from protocols.model import AdmitRequest, PrefillWork, StepPlan

        self.engine, self.StepPlan = engine, StepPlan
        admits = [
            AdmitRequest(request_id=f"p{i}", prompt_ids=p, max_tokens=total_steps + 2, sampling=SamplingParams(), seed=0, stop_token_ids=[])
            for i, p in enumerate(prompts)
        ]
        engine.step(StepPlan(admit=admits))
        engine.step(StepPlan(prefill=[PrefillWork(request_id=a.request_id, num_tokens=len(a.prompt_ids) - 1) for a in admits], decode=True))
        self.ids = [a.request_id for a in admits]

    def step(self) -> None:
        self.engine.step(self.StepPlan(decode=True))

    def close(self) -> None:
        self.engine.step(self.StepPlan(release=self.ids))


class _BatchGeneratorRun:
    """mlx-lm's `BatchGenerator` (mlx_lm.server's engine): insert, run until every row decodes."""

    def __init__(self, model, prompts: list[list[int]], total_steps: int, sampler):
        from mlx_lm.generate import BatchGenerator

        self.generator = BatchGenerator(model, max_tokens=total_steps + 4, sampler=sampler)
        uids = self.generator.insert(prompts, max_tokens=[total_steps + 4] * len(prompts))
        started: set[int] = set()
        while len(started) < len(uids):
            started |= {r.uid for r in self.generator.next_generated()}

    def step(self) -> None:
        self.generator.next_generated()

    def close(self) -> None:
        self.generator.close()


class _GenerateStepRun:
    """mlx-lm's `generate_step` (the loop under `stream_generate`) for one prompt."""

    def __init__(self, model, prompt: list[int], total_steps: int, sampler):
        from mlx_lm.generate import generate_step

        self.tokens = generate_step(mx.array(prompt), model, max_tokens=total_steps + 4, sampler=sampler)
        next(self.tokens)

    def step(self) -> None:
        next(self.tokens)

    def close(self) -> None:
        self.tokens.close()


def _argmax(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _time(make: Callable[[], Any], options: ProfileOptions, clock: Clock | None) -> tuple[list[float], list[dict[str, float]]]:
    run = make()
    times, spent = [], []
    try:
        for i in range(options.warm + options.steps):
            if clock is not None:
                clock.take()
            start = time.perf_counter()
            run.step()
            elapsed = time.perf_counter() - start
            if i >= options.warm:
                times.append(elapsed)
                if clock is not None:
                    spent.append(clock.take())
    finally:
        run.close()
    return times, spent


def profile_steps(engine, model, options: ProfileOptions, progress: Callable[[str], None] = lambda _: None) -> dict:
    """Runs on the MLX thread that owns `engine` (built over `model`)."""
    vocab = model.args.vocab_size if hasattr(model, "args") else 32000
    results: dict = {"options": asdict(options), "mlxrt": {}, "mlx_lm": {}}
    for n in options.concurrency:
        prompts = _prompts(n, options.prompt_tokens, min(vocab, 30000), options.seed + n)
        for stack in ("mlx_lm", "mlxrt"):
            results[stack][f"c{n}"] = asdict(_profile_stack(stack, engine, model, prompts, options, progress))
    return results


def _profile_stack(stack: str, engine, model, prompts: list[list[int]], options: ProfileOptions, progress: Callable[[str], None]) -> StepTimes:
    """One stack at one concurrency: its steps as they run, then profiled."""
    total = options.warm + options.steps
    label = f"c{len(prompts)}: {stack}"

    def make(sampler: Callable[[mx.array], mx.array] = _argmax) -> Any:
        if stack == "mlxrt":
            return _EngineRun(engine, prompts, total)
        if len(prompts) == 1:
            return _GenerateStepRun(model, prompts[0], total, sampler)
        return _BatchGeneratorRun(model, prompts, total, sampler)

    progress(f"{label}, steps as they run")
    times, _ = _time(make, options, None)
    progress(f"{label}, profiled")
    clock = Clock()
    patches = Patches(clock)
    try:
        patches.model(model)
        _patch_stack(patches, stack, engine)
        if stack == "mlx_lm":
            patches.function(mx, "logsumexp", "sampling")
            profiled, spent = _time(lambda: make(_sampling_clocked(clock)), options, clock)
        else:
            with engine.uncompiled():  # a compiled lone-row step is one traced graph
                profiled, spent = _time(make, options, clock)
    finally:
        patches.undo()
    return StepTimes(
        step_ms=round(statistics.median(times) * 1000, 2),
        profiled_ms=round(statistics.fmean(profiled) * 1000, 2),
        pieces_ms=_ms_per_step(spent),
    )


def _sampling_clocked(clock: Clock) -> Callable[[mx.array], mx.array]:
    def sample(logprobs: mx.array) -> mx.array:
        clock.enter("sampling", logprobs)
        out = None
        try:
            out = _argmax(logprobs)
            return out
        finally:
            clock.leave(out)

    return sample


def _patch_stack(patches: Patches, stack: str, engine) -> None:
    if stack == "mlxrt":
        from engine.kv import slots as slot_kinds
        from engine.sampler import BatchSampler

        patches.method(BatchSampler, "sample", "sampling")
        kinds: list[type] = [slot_kinds.FullSlots, slot_kinds.WindowSlots, *(type(slots) for slots in engine.batch_slots)]
    else:
        from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

        kinds = [KVCache, RotatingKVCache, BatchKVCache, BatchRotatingKVCache]
    for kind in kinds:
        patches.method(kind, "update_and_fetch", "kv write")
        patches.method(kind, "make_mask", "mask")


def format_profile(results: dict) -> str:
    lines = []
    for key in results["mlxrt"]:
        ours, theirs = results["mlxrt"][key], results["mlx_lm"][key]
        baseline = "generate_step" if key == "c1" else "BatchGenerator"
        lines.append(f"{key}: ms per decode step, mlxrt vs mlx-lm {baseline}")
        lines.append(f"  {'piece':<12} {'mlxrt':>9} {'mlx-lm':>9}")
        for name in CATEGORIES:
            lines.append(f"  {name:<12} {ours['pieces_ms'][name]:>9.2f} {theirs['pieces_ms'][name]:>9.2f}")
        lines.append(f"  {'profiled':<12} {ours['profiled_ms']:>9.2f} {theirs['profiled_ms']:>9.2f}")
        ratio = theirs["step_ms"] / ours["step_ms"] if ours["step_ms"] else float("nan")
        lines.append(f"  {'step':<12} {ours['step_ms']:>9.2f} {theirs['step_ms']:>9.2f}   (mlxrt speed {ratio:.2f}x)")
    return "\n".join(lines)


async def run_profile(config, options: ProfileOptions) -> dict:
    """Build the configured model's engine on an MLX thread and profile it against mlx-lm's
    loops over the same model object."""
    from actors.mlx_thread import MlxThread
    from engine.build import EngineSpec, build_engine
    from runtime import env
    from runtime.grammar import GrammarCache
    from runtime.progress import Progress

    progress = Progress("profile")

    def make_grammars(tokenizer, info):
        return GrammarCache.for_model(tokenizer, info, config.limits)

    def run() -> dict:
        built = build_engine(EngineSpec(model=config.model, kv=config.kv), env.home(), make_grammars, progress=progress.step)
        results = profile_steps(built.engine, built.loaded.model, options, progress.step)
        info = built.info
        results["model"] = {
            "path": info.path,
            "type": info.model_type,
            "params": info.num_parameters,
            "layers": info.num_layers,
            "kv_bits": config.kv.bits,
            "block_size": config.kv.block_size,
        }
        return results

    thread = MlxThread(name="mlx-profile")
    thread.start()
    try:
        results = await thread.run(run)
    finally:
        await thread.stop()
    progress.done("profile finished")
    return results
