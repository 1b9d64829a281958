"""Block diffusion (LLaDA2-MoE) on the MLX thread: a request's answer unmasked a block at a time,
a denoising step at a time, under the denoising engine's `step(plan)` contract.

The sequence is cut into blocks of `block_length` positions from position 0. The prompt's whole
blocks are prefilled into the request's cache, one forward per block (each block attends to
itself and everything before it); the block holding the prompt's tail and the first answer
positions is the first one denoised. A block starts with every answer position masked (the
model's mask token); each denoising step forwards the block over the cache, takes each position's
token and its probability (greedy, or a sample at the request's temperature), and unmasks the
masked positions whose probability passes the threshold (the most probable one if none does).
A block ends when nothing is masked or after `max_steps` steps; it is then forwarded into the
cache and its answer positions are the request's next output (up to an end token or
`max_tokens`).

This is the loop of mlx-vlm's `LanguageModel.generate` for `llada2_moe` (with `eos_early_stop`,
as `stream_diffusion_generate` runs it), one step per scheduler unit; tokens equal its output.
A request samples from its own key (seeded by its seed), split as MLX's global generator splits
its key, so a seeded answer equals mlx-vlm's after `mx.random.seed(seed)`, whatever runs beside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from engine.denoise import Denoiser
from engine.errors import EngineInvariantError
from protocols.model import AdmitRequest, DenoiseReport, PrefillReport, PrefillWork, RowOutput

# mlx-vlm's defaults (`stream_diffusion_generate` for model-driven families, `generate`'s own).
DEFAULT_BLOCK_LENGTH = 32
DEFAULT_STEPS = 32
DEFAULT_THRESHOLD = 0.95
DEFAULT_MAX_POST_STEPS = 16
DEFAULT_STABILITY_STEPS = 2


@dataclass(frozen=True)
class BlockSettings:
    """A request's block rules: its overrides, then the model config's tuned defaults, then
    mlx-vlm's, resolved as `stream_diffusion_generate` and `generate` resolve them."""

    block_length: int
    steps: int
    threshold: float
    min_threshold: float
    editing_threshold: float | None
    max_transfer_per_step: int | None
    max_post_steps: int
    stability_steps: int
    temperature: float

    @classmethod
    def resolve(cls, model: Any, admit: AdmitRequest) -> BlockSettings:
        options = admit.denoise
        assert options is not None
        config = model.config

        def tuned(name: str, default: Any) -> Any:
            value = getattr(config, f"default_diffusion_{name}", None)
            return default if value is None else value

        block = options.canvas_length or getattr(config, "default_block_length", None) or DEFAULT_BLOCK_LENGTH
        steps = options.max_steps or getattr(config, "default_diffusion_steps", None) or DEFAULT_STEPS
        threshold = float(options.threshold if options.threshold is not None else tuned("threshold", DEFAULT_THRESHOLD))
        min_threshold = tuned("min_threshold", None)
        min_threshold = threshold if min_threshold is None else min(threshold, max(0.0, float(min_threshold)))
        editing = tuned("editing_threshold", None)
        capped = tuned("max_transfer_per_step", None)
        return cls(
            block_length=int(block),
            steps=max(1, min(int(steps), max(1, admit.max_tokens))),
            threshold=threshold,
            min_threshold=min_threshold,
            editing_threshold=None if editing is None else float(editing),
            max_transfer_per_step=None if capped is None else min(int(block), max(1, int(capped))),
            max_post_steps=max(0, int(tuned("max_post_steps", DEFAULT_MAX_POST_STEPS))),
            stability_steps=max(0, int(tuned("stability_steps", DEFAULT_STABILITY_STEPS))),
            temperature=admit.sampling.temperature,
        )


@dataclass
class Block:
    """The block being denoised: the loop's state between two of its steps."""

    index: int
    tokens: mx.array  # (1, block_length): the block's current tokens
    prompt_mask: mx.array  # the block's positions that hold prompt tokens
    caches: list[Any]  # read-only views of the request's cache
    steps: int = 0
    post_steps: int = 0
    stable_steps: int = 0
    eos_index: int | None = None


@dataclass
class BlockRow:
    """One admitted request of a block-diffusion model."""

    admit: AdmitRequest
    settings: BlockSettings
    cache: list[Any]
    key: mx.array
    num_prefilled: int = 0
    kv_tokens: int = 0
    num_generated: int = 0
    next_block: int = 0
    block: Block | None = None
    last_steps: int = 0  # the steps of the last block that ended

    @property
    def prompt_length(self) -> int:
        return len(self.admit.prompt_ids)


class BlockDenoiseEngine(Denoiser):
    """LLaDA2-MoE's requests (the module's docstring)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._lm = model.language_model
        self._mask = int(model.config.mask_token_id)
        eos = model.config.eos_token_id
        self._eos = set(eos) if isinstance(eos, (list, tuple, set)) else {eos}

    def _new_row(self, admit: AdmitRequest) -> BlockRow:
        from mlx_vlm.models.cache import StaticPrefixKVCache

        settings = BlockSettings.resolve(self._model, admit)
        block = settings.block_length
        num_blocks = (len(admit.prompt_ids) + admit.max_tokens + block - 1) // block
        caches = [StaticPrefixKVCache(num_blocks * block) for _ in self._lm.layers]
        row = BlockRow(admit=admit, settings=settings, cache=caches, key=mx.random.key(admit.seed))
        row.next_block = len(admit.prompt_ids) // block  # the prompt's whole blocks are prefilled
        return row

    def _prefill(self, work: PrefillWork) -> PrefillReport:
        """The scheduler's chunk of the prompt: each of the prompt's whole blocks it completes is
        forwarded into the cache (one forward per block, as mlx-vlm's loop prefills)."""
        row = cast(BlockRow, self._rows[work.request_id])
        end = row.num_prefilled + work.num_tokens
        prompt = row.admit.prompt_ids
        if work.num_tokens <= 0 or end > len(prompt):
            raise EngineInvariantError(f"prefill to {end} outside the prompt of {len(prompt)}")
        block = row.settings.block_length
        for start in range(row.kv_tokens, (end // block) * block, block):
            self._lm.model(mx.array([prompt[start : start + block]]), cache=row.cache)
            mx.eval([c.keys for c in row.cache])
            row.kv_tokens = start + block
        row.num_prefilled = end
        return PrefillReport(request_id=row.admit.request_id, processed_tokens=end, total_tokens=len(prompt))

    def _denoise(self, rows: list[Any]) -> list[RowOutput]:
        outputs = []
        for row in cast(list[BlockRow], rows):
            output = self._step(row)
            self._reports.append(self._report(row))
            if output is not None:
                outputs.append(output)
        return outputs

    def _report(self, row: BlockRow) -> DenoiseReport:
        """The step's progress: the block (counted from the request's first), its step, and its
        answer positions unmasked (all, once it ended)."""
        length = row.settings.block_length
        block = row.block
        index = row.next_block - 1 if block is None else block.index
        first = max(0, row.prompt_length - index * length)  # (the block's prompt positions)
        if block is None:
            revealed, step = length - first, row.last_steps
        else:
            revealed, step = cast(int, (block.tokens[0, first:] != self._mask).sum().item()), block.steps
        canvas = index - row.prompt_length // length + 1
        return DenoiseReport(request_id=row.admit.request_id, canvas=canvas, step=step, revealed=revealed, positions=length - first)

    def _step(self, row: BlockRow) -> RowOutput | None:
        """One iteration of mlx-vlm's block loop; the block's output once it ends."""
        if row.num_prefilled < row.prompt_length:
            raise EngineInvariantError(f"denoising before the prompt of {row.admit.request_id!r} is prefilled")
        if row.block is None:
            row.block = self._start_block(row)
        block, settings = row.block, row.settings
        if block.steps >= settings.steps:
            return self._end_block(row)
        block.steps += 1
        old = block.tokens
        active = old == self._mask
        has_active = bool(active.any().item())
        editing = settings.editing_threshold is not None
        if not has_active:
            if not editing:
                return self._end_block(row)  # the block is done once nothing is masked
            block.post_steps += 1
        if block.post_steps > settings.max_post_steps:
            return self._end_block(row)
        for view, cache in zip(block.caches, row.cache):
            view.reset_from_prefix(cache)
        logits = self._logits(old, block.caches)
        x0, x0_p = self._sample(row, logits)
        positions = mx.arange(settings.block_length)
        transfer = mx.zeros_like(active)
        if has_active:
            confidence = mx.where(active, x0_p, -mx.inf)
            progress = (block.steps - 1) / max(1, settings.steps - 1)
            step_threshold = settings.threshold - (settings.threshold - settings.min_threshold) * progress
            high = (confidence > step_threshold) & active
            _, best = _topk(confidence, 1)
            best_transfer = (positions[None, None, :] == best[..., None]).any(axis=1)
            transfer = high | (best_transfer & ~high.any(axis=1, keepdims=True))
            if settings.max_transfer_per_step is not None:
                _, capped = _topk(mx.where(transfer, confidence, -mx.inf), settings.max_transfer_per_step)
                transfer = transfer & (positions[None, None, :] == capped[..., None]).any(axis=1)
        editable = (~active) & (~block.prompt_mask[None, :])
        if block.eos_index is not None:
            editable = editable & (positions[None, :] <= block.eos_index)
        edit_confidence = mx.where(editable, x0_p, -mx.inf)
        threshold = settings.editing_threshold if settings.editing_threshold is not None else float("inf")
        edit = (edit_confidence > threshold) & editable & (x0 != old)
        block.tokens = mx.where(transfer | edit, x0, old)
        has_edit = bool(edit.any().item())
        if block.eos_index is None and not has_active:
            block.eos_index = next((i for i, t in enumerate(cast(list[int], block.tokens[0].tolist())) if t in self._eos), None)
        if not has_active and not has_edit:
            block.stable_steps += 1
            if block.stable_steps >= max(1, settings.stability_steps) or settings.stability_steps == 0:
                return self._end_block(row)
        else:
            block.stable_steps = 0
        mx.eval(block.tokens)
        # The loop's next iteration would end the block without a forward: end it in this step.
        if block.steps >= settings.steps or (not editing and not bool((block.tokens == self._mask).any().item())):
            return self._end_block(row)
        return None

    def _start_block(self, row: BlockRow) -> Block:
        from mlx_vlm.models.cache import StaticPrefixKVCache

        block = row.settings.block_length
        start = row.next_block * block
        prompt = row.admit.prompt_ids
        tokens = [prompt[i] if i < len(prompt) else self._mask for i in range(start, start + block)]
        prompt_mask = start + mx.arange(block) < len(prompt)
        return Block(index=row.next_block, tokens=mx.array([tokens]), prompt_mask=prompt_mask, caches=[StaticPrefixKVCache.from_prefix(c) for c in row.cache])

    def _end_block(self, row: BlockRow) -> RowOutput:
        """The block into the cache; its answer positions as the request's output."""
        block = row.block
        assert block is not None
        row.block, row.last_steps = None, block.steps
        self._lm.model(block.tokens, cache=row.cache)
        mx.eval([c.keys for c in row.cache])
        length = row.settings.block_length
        row.kv_tokens += length
        row.next_block += 1
        start = block.index * length
        first = max(0, row.prompt_length - start)  # (the block's prompt positions)
        rid, stops = row.admit.request_id, row.admit.stop_token_ids
        tokens: list[int] = []
        for token in cast(list[int], block.tokens[0, first:].tolist()):
            row.num_generated += 1
            if token in stops:
                return RowOutput(request_id=rid, token_ids=tokens, finish_reason="stop", stop_token_id=token)
            tokens.append(token)
            if row.num_generated >= row.admit.max_tokens:
                return RowOutput(request_id=rid, token_ids=tokens, finish_reason="length")
        return RowOutput(request_id=rid, token_ids=tokens)

    def _sample(self, row: BlockRow, logits: mx.array) -> tuple[mx.array, mx.array]:
        """Each position's token and its probability: mlx-vlm's sampler (no top-k or top-p: the
        requests have none), drawing from the request's own key as MLX's global generator draws
        from its key (split, keep the first half, draw with the second)."""
        temperature = row.settings.temperature
        if temperature == 0.0:
            return cast(tuple[mx.array, mx.array], self._lm._sample_with_temperature_topk_topp(logits, temperature=0.0))
        if temperature != 1.0:
            logits = logits / temperature
        row.key, draw = mx.random.split(row.key)
        token = mx.random.categorical(logits.astype(mx.float32), axis=-1, key=draw)
        probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
        return token, mx.take_along_axis(probs, token[..., None], axis=-1)[..., 0]

    def _logits(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        hidden = self._lm.model(tokens, cache=caches)
        if self._model.config.tie_word_embeddings:
            return self._lm.model.word_embeddings.as_linear(hidden)
        return self._lm.lm_head(hidden)


def _topk(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    from mlx_vlm.models.llada2_moe.language import _topk as topk

    return cast(tuple[mx.array, mx.array], topk(x, k))
