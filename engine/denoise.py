"""The denoising engine (MLX thread): diffusion language models' requests, a denoising step at a
time, under the same `step(plan) -> StepOutcome` contract as the autoregressive engine.

A request's prompt prefills into its own encoder cache in the scheduler's chunks (all of it,
the last token too: a canvas attends to the whole prompt). Then its answer is made a canvas at a time:
a canvas of random tokens over `canvas_length` positions is refined by denoising steps, each one
forward of the decoder over the canvas and one unit of work the scheduler plans beside other
work (`StepPlan.denoise`), so a long denoise never freezes the device. A step reveals the
positions whose token is confident enough (mlx-vlm's confidence-threshold rule, the model's
linear temperature schedule, self-conditioning on the previous step's logits); the canvas ends
when every position is revealed, when it is stable and confident (the model's stopping config),
or at the last step, and its tokens are the request's next output (up to an end token or
`max_tokens`). The finished canvas then extends the encoder cache and the next canvas starts.

Each request draws its random tokens from its own key (seeded by the request's seed), split as
MLX's global generator splits its key, so a request's answer equals mlx-vlm's
`stream_diffusion_generate` after `mx.random.seed(seed)`, whatever runs beside it.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import structlog

from engine.errors import EngineInvariantError
from protocols.errors import ModelLoadError
from protocols.model import AdmitRequest, DenoiseReport, DeviceMemory, PrefillReport, PrefillWork, RowOutput, StepOutcome, StepPlan

log = structlog.get_logger("engine.denoise")

# mlx-vlm's defaults (`mlx_vlm.generate.common`, `stream_diffusion_generate`).
DEFAULT_MAX_STEPS = 48
DEFAULT_MIN_CANVAS = 64
DEFAULT_THRESHOLD = 0.9


def _reference() -> Any:
    """mlx-vlm's denoising loop module, whose rules each step applies (not importable as an
    attribute: `mlx_vlm.generate` is also a function's name)."""
    return importlib.import_module("mlx_vlm.generate.diffusion")


def generation_config(model: Any) -> dict[str, Any]:
    config = model.config.generation_config
    return config if isinstance(config, dict) else {}


def check_model(model: Any) -> None:
    """Refuse (`ModelLoadError`) a diffusion model whose sampler mlx-vlm's loop does not run."""
    sampler = generation_config(model).get("sampler_config")
    name = sampler.get("_cls_name", "EntropyBoundSamplerConfig") if isinstance(sampler, dict) else "EntropyBoundSamplerConfig"
    if name != "EntropyBoundSamplerConfig":
        raise ModelLoadError(f"diffusion sampler {name!r} is not served (mlx-vlm's loop runs EntropyBoundSamplerConfig)")


@dataclass(frozen=True)
class DenoiseSettings:
    """A request's denoising rules: the model's generation config, the request's overrides,
    then mlx-vlm's defaults, resolved as `stream_diffusion_generate` resolves them."""

    max_canvas: int
    min_canvas: int
    max_steps: int
    threshold: float
    temperature: float
    schedule: dict[str, float] | None
    stopping: dict[str, Any] | None

    @classmethod
    def resolve(cls, model: Any, admit: AdmitRequest) -> DenoiseSettings:
        options = admit.denoise
        assert options is not None
        generation = generation_config(model)
        canvas = int(model.config.canvas_length)
        max_canvas = min(canvas, options.canvas_length or canvas)
        schedule = generation.get("linear_temperature_schedule_config")
        if not isinstance(schedule, dict) or not schedule:
            keys = {"t_min": generation.get("t_min", 0.4), "t_max": generation.get("t_max", 0.8)}
            schedule = keys if ("t_min" in generation or "t_max" in generation) else {"t_min": 0.4, "t_max": 0.8}
        stopping = generation.get("diffusion_stopping_config")
        if not isinstance(stopping, dict) or not stopping:
            stopping = {key: generation[key] for key in ("confidence_threshold", "stability_threshold") if key in generation} or None
        return cls(
            max_canvas=max_canvas,
            min_canvas=min(max_canvas, options.min_canvas_length or DEFAULT_MIN_CANVAS),
            max_steps=options.max_steps or int(generation.get("max_denoising_steps") or DEFAULT_MAX_STEPS),
            threshold=DEFAULT_THRESHOLD if options.threshold is None else options.threshold,
            temperature=admit.sampling.temperature,
            schedule=schedule,
            stopping=stopping,
        )


@dataclass
class Canvas:
    """One canvas being denoised: mlx-vlm's loop state between two of its steps."""

    length: int
    current: mx.array
    reveal: mx.array
    draft: mx.array
    argmax: mx.array
    masks: dict[str, Any]  # the decoder's attention masks by layer type (over cache and canvas)
    offset: int  # the canvas's first position (the encoder cache's length)
    logits_fns: tuple[Any, Any]
    step: int  # the schedule's step, counting down to 1
    self_conditioning: Any = None
    history: list[mx.array] = field(default_factory=list)


@dataclass
class DenoiseRow:
    """One admitted denoising request."""

    admit: AdmitRequest
    settings: DenoiseSettings
    cache: list[Any]
    key: mx.array
    self_conditioning_context: Any
    num_prefilled: int = 0
    num_generated: int = 0
    kv_tokens: int = 0
    canvas: Canvas | None = None
    canvases: int = 0  # canvases started
    # The last finished canvas, not yet in the encoder cache (the next canvas adds it).
    pending: mx.array | None = None

    def next_key(self) -> mx.array:
        """The next key of this request's sequence (as MLX's global generator: split, keep the
        first half, use the second)."""
        self.key, used = mx.random.split(self.key)
        return used


class Denoiser:
    """Steps of denoising requests on one diffusion model (`StepPlan.prefill` and `.denoise`):
    what every family's engine shares (the step, admission, release, the figures the model
    actor asks for). A family's engine makes its rows and runs their prefill and steps."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._rows: dict[str, Any] = {}
        self._peak_bytes = 0
        # The denoising steps of the step being run (`StepOutcome.denoised`).
        self._reports: list[DenoiseReport] = []

    # -- the step ---------------------------------------------------------------------------

    def step(self, plan: StepPlan) -> StepOutcome:
        started = time.perf_counter()
        released = [rid for rid in plan.release if self._rows.pop(rid, None) is not None]
        for admit in plan.admit:
            if admit.request_id in self._rows:
                raise EngineInvariantError(f"request {admit.request_id!r} admitted twice")
            if admit.denoise is None:
                raise EngineInvariantError("a diffusion model's requests are denoising requests")
            self._rows[admit.request_id] = self._new_row(admit)
        outputs: list[RowOutput] = []
        prefilled = [self._prefill(work) for work in plan.prefill if work.request_id in self._rows]
        for output in self._denoise([self._denoising(rid) for rid in plan.denoise]):
            outputs.append(output)
            if output.finish_reason is not None:
                del self._rows[output.request_id]
        if not self._rows:
            mx.clear_cache()
        kv_bytes = self.kv_bytes()
        self._peak_bytes = max(self._peak_bytes, kv_bytes)
        reports, self._reports = self._reports, []
        return StepOutcome(
            outputs=outputs,
            prefilled=prefilled,
            released=released,
            denoised=reports,
            num_decode_rows=0,
            kv_tokens=self.kv_tokens(),
            kv_bytes=kv_bytes,
            kv_peak_bytes=self._peak_bytes,
            step_s=time.perf_counter() - started,
            device=DeviceMemory(active=mx.get_active_memory(), peak=mx.get_peak_memory(), cache=mx.get_cache_memory()),
        )

    def _denoising(self, rid: str) -> Any:
        row = self._rows.get(rid)
        if row is None:
            raise EngineInvariantError(f"denoise for unknown request {rid!r}")
        return row

    def _new_row(self, admit: AdmitRequest) -> Any:
        raise NotImplementedError

    def _prefill(self, work: PrefillWork) -> PrefillReport:
        raise NotImplementedError

    def _denoise(self, rows: list[Any]) -> list[RowOutput]:
        raise NotImplementedError

    # -- what the model actor asks of an engine ---------------------------------------------

    def warm_up(self, vocab_size: int) -> float:
        """A throwaway request through prefill and two canvases' first steps, so MLX compiles
        their kernels before the model reports ready. Leaves nothing behind."""
        from protocols.api import DenoisingOptions, SamplingParams

        started = time.perf_counter()
        prompt = [i % vocab_size for i in range(1, 9)]
        admit = AdmitRequest(
            request_id="warm-up",
            prompt_ids=prompt,
            max_tokens=2,
            sampling=SamplingParams(),
            seed=0,
            stop_token_ids=[],
            save_prefix=False,
            denoise=DenoisingOptions(max_steps=2, canvas_length=1, min_canvas_length=1),
        )
        self.step(StepPlan(admit=[admit], prefill=[PrefillWork(request_id="warm-up", num_tokens=len(prompt))]))
        for _ in range(8):
            if "warm-up" not in self._rows:
                break
            self.step(StepPlan(denoise=["warm-up"]))
        self.step(StepPlan(release=["warm-up"]))
        self._peak_bytes = 0
        return time.perf_counter() - started

    def reset(self) -> None:
        self._rows.clear()
        mx.clear_cache()

    def kv_tokens(self) -> dict[str, int]:
        return {rid: row.kv_tokens for rid, row in self._rows.items() if row.kv_tokens}

    def kv_bytes(self) -> int:
        return sum(sum(a.nbytes for c in row.cache for a in _state_arrays(c)) for row in self._rows.values())

    def drop_prefixes(self, entry_ids: list[str]) -> None:
        """(No prefix entries are kept for denoising requests.)"""

    def export_prefix(self, entry_id: str, spans: list[tuple[int, int]], whole: bool) -> list[dict]:
        raise KeyError(entry_id)


class DenoiseEngine(Denoiser):
    """DiffusionGemma's requests: an encoder cache per request and canvases denoised by
    mlx-vlm's confidence-threshold rule (the module's docstring)."""

    def __init__(self, model: Any) -> None:
        check_model(model)
        super().__init__(model)
        self._vocab = int(model.config.text_config.vocab_size)

    def _new_row(self, admit: AdmitRequest) -> DenoiseRow:
        return DenoiseRow(
            admit=admit,
            settings=DenoiseSettings.resolve(self._model, admit),
            cache=self._model.make_cache(),
            key=mx.random.key(admit.seed),
            self_conditioning_context=self._model.diffusion_prepare_self_conditioning(),
        )

    def _prefill(self, work: PrefillWork) -> PrefillReport:
        row = self._rows[work.request_id]
        end = row.num_prefilled + work.num_tokens
        prompt = row.admit.prompt_ids
        if work.num_tokens <= 0 or end > len(prompt):
            raise EngineInvariantError(f"prefill to {end} outside the prompt of {len(prompt)}")
        self._encode(row, prompt[row.num_prefilled : end])
        row.num_prefilled = end
        return PrefillReport(request_id=row.admit.request_id, processed_tokens=end, total_tokens=len(prompt))

    def _encode(self, row: DenoiseRow, ids: list[int] | mx.array) -> None:
        """Extend the request's encoder cache by `ids` (prompt tokens, or a finished canvas)."""
        tokens = mx.array(ids)[None] if isinstance(ids, list) else ids
        row.cache = self._model.diffusion_prefill_cache(
            tokens, attention_mask=None, cache=row.cache, pixel_values=None, mm_token_type_ids=None, prefill_step_size=None, chunk_prefill=False
        )
        mx.eval([c.state for c in row.cache])
        row.kv_tokens += tokens.shape[1]

    # -- denoising --------------------------------------------------------------------------

    def _denoise(self, rows: list[DenoiseRow]) -> list[RowOutput]:
        """One denoising step of each request (starting a canvas first where none is open); the
        outputs of the canvases that ended. Canvases of the same length (and the same kind of
        self-conditioning input) go through one batched decoder forward."""
        groups: dict[tuple[int, bool], list[DenoiseRow]] = {}
        for row in rows:
            if row.canvas is None:
                row.canvas = self._start_canvas(row)
            groups.setdefault((row.canvas.length, row.canvas.self_conditioning is None), []).append(row)
        logits = {id(row): one for group in groups.values() for row, one in zip(group, self._forward(group))}
        settled = []
        for row in rows:
            canvas = cast(Canvas, row.canvas)
            step = row.settings.max_steps - canvas.step + 1
            output = self._settle(row, logits[id(row)])
            # (An ended canvas is final at every position.)
            settled.append((row, output, step, canvas.length, mx.sum(canvas.reveal) if output is None else None))
        mx.eval(
            [
                c
                for row, *_ in settled
                if (open_canvas := row.canvas) is not None
                for c in (open_canvas.current, open_canvas.reveal, open_canvas.draft, open_canvas.self_conditioning)
            ]
        )
        for row, _, step, length, revealed in settled:
            shown = length if revealed is None else cast(int, revealed.item())
            self._reports.append(DenoiseReport(request_id=row.admit.request_id, canvas=row.canvases, step=step, revealed=shown, positions=length))
        return [output for _, output, *_ in settled if output is not None]

    def _forward(self, rows: list[DenoiseRow]) -> list[mx.array]:
        """The decoder's logits over each row's canvas: a lone row through mlx-vlm's own logits
        function; several in one forward whose dense weights are read once for all of them, attention
        (each row over its own encoder cache, with its own masks and positions), router and
        experts row by row: each row's computation is a lone row's forward, so its tokens are
        the same."""
        canvases = [cast(Canvas, row.canvas) for row in rows]
        if len(rows) == 1:
            canvas = canvases[0]
            plain, conditioned = canvas.logits_fns
            return [plain(canvas.current) if canvas.self_conditioning is None else conditioned(canvas.current, canvas.self_conditioning)]
        conditioning = None if canvases[0].self_conditioning is None else mx.concatenate([c.self_conditioning for c in canvases])
        layers = [_LayerRows([row.cache[i] for row in rows], [c.masks for c in canvases], [c.offset for c in canvases]) for i in range(len(rows[0].cache))]
        with _by_row(self._model.model.decoder.layers, len(rows)):
            logits = self._model.diffusion_decoder_logits(
                mx.concatenate([c.current for c in canvases]), cache=layers, self_conditioning=conditioning, decoder_attention_mask={}
            )
        return [logits[i : i + 1] for i in range(len(rows))]

    def _settle(self, row: DenoiseRow, logits: mx.array) -> RowOutput | None:
        """mlx-vlm's step rule on the canvas's logits: reveal what is confident enough; the
        canvas's output when it ends."""
        canvas, settings, ref = cast(Canvas, row.canvas), row.settings, _reference()
        temperature = ref._diffusion_linear_temperature(canvas.step, settings.max_steps, settings.schedule)
        if temperature is not None:
            logits = logits / temperature
        canvas.argmax = mx.argmax(logits, axis=-1).astype(mx.int32)
        if canvas.step == 1:
            return self._end_canvas(row)
        denoised = canvas.argmax if settings.temperature <= 0 else self._sample(row, logits)
        unrevealed = ~canvas.reveal
        confidence = ref._diffusion_token_probability(logits, denoised)
        accept = ref._diffusion_confidence_transfer_mask(confidence, unrevealed, settings.threshold, force_all=False)
        accepted = mx.where(accept, denoised, canvas.draft)
        canvas.current = mx.where(canvas.reveal | accept, accepted, self._random_canvas(row, canvas.length))
        canvas.reveal = canvas.reveal | accept
        canvas.draft = mx.where(accept, accepted, canvas.draft)
        if bool(mx.all(canvas.reveal).item()):
            return self._end_canvas(row)
        if ref._diffusion_stable_and_confident(canvas.argmax, logits, canvas.history, settings.stopping):
            return self._end_canvas(row)
        canvas.self_conditioning = self._model.diffusion_self_conditioning(logits, row.self_conditioning_context)
        canvas.step -= 1
        return None

    def _start_canvas(self, row: DenoiseRow) -> Canvas:
        """The next canvas: the prompt's last token (first canvas) or the finished canvas
        (later ones) into the encoder cache, then random tokens over the canvas's positions."""
        if row.num_prefilled < len(row.admit.prompt_ids):
            raise EngineInvariantError(f"denoising before the prompt of {row.admit.request_id!r} is prefilled")
        if row.pending is not None:
            self._encode(row, row.pending)
            row.pending = None
        settings = row.settings
        row.canvases += 1
        remaining = row.admit.max_tokens - row.num_generated
        length = min(settings.max_canvas, max(remaining, settings.min_canvas))
        current = self._random_canvas(row, length)
        masks = self._model.diffusion_decoder_masks(current, row.cache, None)
        fns = _reference()._make_diffusion_decoder_logits_fns(self._model, row.cache, masks, compile_graph=False)
        reveal = mx.zeros(current.shape, dtype=mx.bool_)
        return Canvas(
            length=length,
            current=current,
            reveal=reveal,
            draft=current,
            argmax=current,
            masks=masks,
            offset=_cache_offset(row.cache),
            logits_fns=fns,
            step=settings.max_steps,
        )

    def _end_canvas(self, row: DenoiseRow) -> RowOutput:
        """The canvas's tokens as the request's output, up to an end token or `max_tokens`."""
        canvas = row.canvas
        assert canvas is not None
        row.canvas = None
        tokens: list[int] = []
        for token in cast(list[int], canvas.argmax[0].tolist()):
            row.num_generated += 1
            if token in row.admit.stop_token_ids:
                return RowOutput(request_id=row.admit.request_id, token_ids=tokens, finish_reason="stop", stop_token_id=token)
            tokens.append(token)
            if row.num_generated >= row.admit.max_tokens:
                return RowOutput(request_id=row.admit.request_id, token_ids=tokens, finish_reason="length")
        row.pending = canvas.argmax
        return RowOutput(request_id=row.admit.request_id, token_ids=tokens)

    def _random_canvas(self, row: DenoiseRow, length: int) -> mx.array:
        return mx.random.randint(0, self._vocab, (1, length), key=row.next_key()).astype(mx.int32)

    def _sample(self, row: DenoiseRow, logits: mx.array) -> mx.array:
        from mlx_vlm.sample_utils import clamp_temperature

        temperature = clamp_temperature(row.settings.temperature)
        scaled = logits.astype(mx.float32)
        if temperature != 1.0:
            scaled = scaled / temperature
        return mx.random.categorical(scaled, key=row.next_key()).astype(mx.int32)


def _state_arrays(cache: Any) -> list[mx.array]:
    if getattr(cache, "keys", None) is None:
        return []
    state = cache.state
    return [a for a in (state if isinstance(state, (list, tuple)) else [state]) if isinstance(a, mx.array)]


def _cache_offset(cache: list[Any]) -> int:
    """The position after the encoder cache (the decoder's canvas offset, as mlx-vlm takes it)."""
    return int(getattr(cache[0], "offset", 0)) if getattr(cache[0], "keys", None) is not None else 0


@dataclass(frozen=True)
class _LayerRows:
    """A decoder layer's per-row inputs in a batched denoising forward: each row's encoder cache
    of the layer, its masks (by layer type) and its canvas's offset. Has no `keys`, so the
    decoder takes no offset or masks of its own from it."""

    caches: list[Any]
    masks: list[dict[str, Any]]
    offsets: list[int]


class _RowAttention:
    """A decoder layer's attention, run row by row over a batch's hidden states (each row its
    own encoder cache, mask and positions) with mlx-vlm's own attention module."""

    def __init__(self, attention: Any) -> None:
        self.attention = attention

    def __call__(self, h: mx.array, mask: Any, rows: _LayerRows, *, decoder: bool, offset: int | None = None) -> mx.array:
        layer_type = self.attention.layer_type
        return mx.concatenate(
            [self.attention(h[i : i + 1], rows.masks[i].get(layer_type), rows.caches[i], decoder=decoder, offset=rows.offsets[i]) for i in range(h.shape[0])]
        )


class _RowTokens:
    """A decoder layer's router or experts, run row by row over a batch's flattened tokens.
    Their matmuls are small (a router's width is its number of experts; an expert's rows are the
    tokens routed to it) and BLAS picks a small-matrix path by shape, whose float order differs:
    a row alone is what mlx-vlm's loop computes."""

    def __init__(self, module: Any, rows: int) -> None:
        self.module, self.rows = module, rows

    def __call__(self, *arrays: mx.array) -> Any:
        n = arrays[0].shape[0] // self.rows
        outs = [self.module(*(a[i * n : (i + 1) * n] for a in arrays)) for i in range(self.rows)]
        if isinstance(outs[0], tuple):
            return tuple(mx.concatenate(list(parts)) for parts in zip(*outs))
        return mx.concatenate(outs)


@contextmanager
def _by_row(layers: list[Any], rows: int) -> Iterator[None]:
    """The decoder layers' attention, router and experts swapped for row-by-row ones while a
    batched forward's graph is built (the MLX thread's own model: nothing else runs it
    meanwhile)."""
    per_token = [name for name in ("router", "experts") if hasattr(layers[0], name)]
    originals = [{name: getattr(layer, name) for name in ("self_attn", *per_token)} for layer in layers]
    for layer, modules in zip(layers, originals):
        layer.self_attn = _RowAttention(modules["self_attn"])
        for name in per_token:
            setattr(layer, name, _RowTokens(modules[name], rows))
    try:
        yield
    finally:
        for layer, modules in zip(layers, originals):
            for name, module in modules.items():
                setattr(layer, name, module)
