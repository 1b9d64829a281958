"""Vision-language models through mlx-vlm (MLX thread): a model directory whose config has a
`vision_config` is loaded with mlx-vlm's classes and served as the engine serves an mlx-lm
model. Its language model takes the engine's caches (mlx-vlm's are mlx-lm's), decodes from
token ids like any text model, and prefills an image prompt from input embeddings that the
model's own `get_input_embeddings` makes (vision tower, projector, merge at the image token
positions), sliced per prefill chunk (`engine.prefill`).

Families are served only where that holds exactly (greedy tokens equal to mlx-vlm's own
`generate`, alone and batched): Idefics3 (and SmolVLM, its subclass), Gemma 3 (sliding windows
between global layers; image features scaled and pad tokens zeroed by its own
`get_input_embeddings`, causal as in mlx-vlm) and Qwen2.5-VL (mRoPE). Qwen2.5-VL's language
model keeps positions and deltas on the module and reads them with `.item()`; here its body is
called with explicit positions instead: an image prompt's (time, height, width) positions from
the model's `get_rope_index`, sliced per prefill chunk, and after the prompt each row's cache
position plus its image's delta (`Step.shifts`, per row of the batch). Other families are
refused with a typed error.

The vision tower does not run in one piece: `start_tower` builds the whole image path (tower,
projector, merge) as MLX's lazy graph with every encoder layer's attention and layer output
noted, and `TowerRun` evaluates a few of these stages per scheduler step, sized to take about
as long as a prefill chunk, so rows that are decoding keep stepping while a large image is
encoded. The graph is the one the model's own `get_input_embeddings` builds, evaluated in
pieces, so the result is the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from protocols.errors import ModelLoadError

VISION_FAMILIES = ("idefics3", "smolvlm", "gemma3", "qwen2_5_vl")
# Prefill chunks shorter than this are not timed for sizing tower units (their time is mostly
# the forward's per-call cost, not its compute).
MIN_TIMED_CHUNK = 32
# Families whose rotary positions the engine passes (mRoPE: time, height and width positions over
# an image, then text positions shifted by the image's delta).
EXPLICIT_POSITIONS = ("qwen2_5_vl",)
# Where each family keeps its vision encoder's layers (or blocks).
TOWER_LAYERS = {
    "idefics3": "vision_model.encoder.layers",
    "smolvlm": "vision_model.encoder.layers",
    "gemma3": "vision_tower.vision_model.encoder.layers",
    "qwen2_5_vl": "vision_tower.blocks",
}


def is_vision_config(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict)


class VisionLanguageModel(nn.Module):
    """mlx-vlm's model, called as the engine calls an mlx-lm model: `model(ids, cache=...)`
    returns logits; `input_embeddings` replaces the ids' embeddings for a prefill chunk."""

    def __init__(self, vlm: nn.Module, model_type: str) -> None:
        super().__init__()
        self.vlm = vlm
        self.model_type = model_type
        self.explicit_positions = model_type in EXPLICIT_POSITIONS
        self._lm_params: int | None = None
        # Seconds a prompt token of a prefill chunk takes here (moving average, `note_prefill`):
        # what a tower unit is sized against.
        self.prefill_s_per_token: float | None = None

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """A prefill chunk of `num_tokens` took `seconds` (evaluated); chunks too short to time
        the model's compute rather than its per-call cost are left out."""
        if num_tokens < MIN_TIMED_CHUNK:
            return
        rate = seconds / num_tokens
        self.prefill_s_per_token = rate if self.prefill_s_per_token is None else 0.5 * (self.prefill_s_per_token + rate)

    @property
    def layers(self) -> list[nn.Module]:
        return self.vlm.language_model.layers

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None, positions: mx.array | None = None) -> mx.array:
        language = self.vlm.language_model
        if not self.explicit_positions:
            return language(inputs, inputs_embeds=input_embeddings, cache=cache).logits
        # The body with explicit positions: the language model's own call keeps positions and
        # deltas on the module (one request at a time) and reads them back with `.item()`.
        if positions is None:
            positions = self._positions(inputs, cache)
        hidden = language.model(inputs, inputs_embeds=input_embeddings, cache=cache, position_ids=positions)
        return language.lm_head(hidden) if hasattr(language, "lm_head") else language.model.embed_tokens.as_linear(hidden)

    @staticmethod
    def _positions(inputs: mx.array, cache: Any) -> mx.array:
        """Text positions (3, rows, tokens): each row's cache position, plus its shift (an image's
        delta) where the engine's batch gives one."""
        rows, length = inputs.shape
        first = cache[0] if cache else None
        offset = first.offset if first is not None else 0
        steps = mx.arange(length, dtype=mx.int32)[None]
        base = steps + offset if isinstance(offset, int) else steps + offset.astype(mx.int32)[:, None]
        shifts = getattr(first, "position_shifts", None)
        if shifts is not None:
            base = base + shifts[:, None]
        return mx.broadcast_to(base[None], (3, rows, length))

    def prompt_positions(self, prompt_ids: list[int], arrays: dict[str, Any]) -> tuple[mx.array, int]:
        """An image prompt's positions (3, 1, prompt) and the shift of positions after it, by the
        model's own rule (`get_rope_index`)."""
        grid = mx.array(arrays["image_grid_thw"]) if "image_grid_thw" in arrays else None
        mask = mx.array(arrays["attention_mask"]) if "attention_mask" in arrays else None
        positions, deltas = self.vlm.language_model.get_rope_index(mx.array(prompt_ids)[None], grid, None, mask)
        mx.eval(positions, deltas)
        return positions, int(deltas.reshape(-1)[0].item())

    def make_cache(self) -> list[Any]:
        """mlx-lm's caches in the language model's own pattern (Gemma 3: sliding windows
        between global layers), so the engine reads the layout as it reads any model's."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        make = getattr(self.vlm.language_model, "make_cache", None)
        if make is None:
            return [KVCache() for _ in self.layers]
        caches: list[Any] = []
        for cache in make():
            if type(cache).__name__ == "KVCache":
                caches.append(KVCache())
            elif type(cache).__name__ == "RotatingKVCache":
                caches.append(RotatingKVCache(max_size=cache.max_size, keep=cache.keep))
            else:
                raise ModelLoadError(f"{self.model_type}: its {type(cache).__name__} layers are not served")
        return caches

    def embed_prompt(self, prompt_ids: list[int], arrays: dict[str, Any]) -> mx.array:
        """The prompt's input embeddings (1, len(prompt_ids), hidden), images merged in with
        the model's own rules; the processor's arrays passed as mlx-vlm's `generate` does
        (its attention mask as `mask`)."""
        extra = {("mask" if name == "attention_mask" else name): mx.array(value) for name, value in arrays.items() if name != "pixel_values"}
        return self.vlm.get_input_embeddings(mx.array(prompt_ids)[None], mx.array(arrays["pixel_values"]), **extra).inputs_embeds

    def start_tower(self, prompt_ids: list[int], arrays: dict[str, Any]) -> TowerRun:
        """The prompt's image path as a lazy graph (nothing computed yet), with each vision
        encoder layer's output and its cost noted, to be evaluated a unit at a time."""
        layers = self._tower_layers()
        original = list(layers)
        stages: list[tuple[mx.array, int]] = []
        # Each layer's attention is a stage of its own (about half a layer's work): a unit can
        # end between a layer's attention and its feed-forward.
        attentions = [(layer, name, layer[name]) for layer in original for name in _ATTENTION if name in layer]
        inner = {id(layer): _num_params(attention) for layer, _, attention in attentions}
        try:
            for layer, name, attention in attentions:
                layer[name] = _Noted(attention, stages)
            layers[:] = [_Noted(layer, stages, inner=inner.get(id(layer), 0)) for layer in original]
            embeds = self.embed_prompt(prompt_ids, arrays)
        finally:
            layers[:] = original
            for layer, name, attention in attentions:
                layer[name] = attention
        return TowerRun(stages, embeds, self._token_cost, lambda: self.prefill_s_per_token)

    def _tower_layers(self) -> list[Any]:
        module: Any = self.vlm
        for name in TOWER_LAYERS[self.model_type].split("."):
            module = getattr(module, name)
        return module

    @property
    def _token_cost(self) -> int:
        """A prompt token's cost through the language model, in the units `_layer_cost` uses."""
        if self._lm_params is None:
            self._lm_params = sum(_num_params(layer) for layer in self.layers)
        return self._lm_params

    def warm_up(self, prompt_ids: list[int], arrays: dict[str, Any]) -> None:
        """The vision tower and merge once (MLX compiles their kernels), and a forward of the
        result."""
        embeds = self.embed_prompt(prompt_ids, arrays)
        positions = self.prompt_positions(prompt_ids, arrays)[0] if self.explicit_positions else None
        mx.eval(self(mx.array(prompt_ids)[None], input_embeddings=embeds, positions=positions))


class TowerRun:
    """One image prompt's tower, evaluated a unit at a time: each unit evaluates stages (a
    layer's attention, the rest of the layer; all of the prompt's images or tiles together, as
    the model batches them) until the next would pass the unit's budget (at least one), and the
    last unit the projector and merge.

    A unit's budget is `budget_tokens` prompt tokens of prefill. Once both rates are known (a
    prefill chunk timed by the model, a stage of this tower timed here) it is their time: the
    tower's attention over a thousand patches a tile runs at another speed per multiply-add
    than the language model (a CPU's exp, a GPU's kernels), so multiply-adds alone would
    misjudge it. Before that, multiply-adds, a prompt token's being the language model's
    parameter count."""

    def __init__(
        self,
        stages: list[tuple[mx.array, int]],
        embeds: mx.array,
        token_cost: int,
        prefill_rate: Callable[[], float | None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._stages = stages
        self._token_cost = max(token_cost, 1)
        self._prefill_rate = prefill_rate
        self._clock = clock
        self.embeds: mx.array | None = None
        self._pending: mx.array | None = embeds
        self.num_units = 0
        # What the stages evaluated so far cost and took: this tower's seconds per multiply-add.
        self._cost_done = 0
        self._seconds_done = 0.0

    @property
    def done(self) -> bool:
        return self.embeds is not None

    def advance(self, budget_tokens: int) -> bool:
        """One unit, worth about `budget_tokens` prompt tokens of the language model; True
        once the embeddings are made."""
        spent_cost, spent_s = 0, 0.0
        while self._stages and (spent_cost == 0 or self._fits(self._stages[0][1], spent_cost, spent_s, budget_tokens)):
            out, cost = self._stages.pop(0)
            started = self._clock()
            mx.eval(out)
            seconds = self._clock() - started
            spent_cost, spent_s = spent_cost + cost, spent_s + seconds
            self._cost_done, self._seconds_done = self._cost_done + cost, self._seconds_done + seconds
        if not self._stages and self._pending is not None:
            mx.eval(self._pending)
            self.embeds, self._pending = self._pending, None
        self.num_units += 1
        return self.done

    def _fits(self, cost: int, spent_cost: int, spent_s: float, budget_tokens: int) -> bool:
        """Whether a stage of `cost` still fits the unit after what it has spent."""
        prefill_rate = self._prefill_rate()
        if prefill_rate is not None and self._cost_done > 0:
            return spent_s + cost * self._seconds_done / self._cost_done <= budget_tokens * prefill_rate
        return spent_cost + cost <= budget_tokens * self._token_cost


class _Noted:
    """A vision encoder layer (or its attention) whose outputs and their costs are noted as the
    graph is built; `inner`: the parameters of a noted part inside it (its own stage, already
    costed there, attention's quadratic term included)."""

    def __init__(self, layer: Any, stages: list[tuple[mx.array, int]], inner: int = 0) -> None:
        self._layer = layer
        self._stages = stages
        self._params = _num_params(layer) - inner
        self._quadratic = not inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._layer(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        self._stages.append((first, _layer_cost(first, self._params, self._quadratic)))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


# A vision encoder layer's attention module, by family (SigLIP's `self_attn`, Qwen's `attn`).
_ATTENTION = ("self_attn", "attn")


def _num_params(module: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(value.size for _, value in cast(list[tuple[str, Any]], tree_flatten(module.parameters())))


def _layer_cost(out: mx.array, params: int, quadratic: bool = True) -> int:
    """An encoder layer's multiply-adds: its weights once per patch, and attention over each
    image's patches where the output keeps images apart (batch, patches, hidden)."""
    patches = out.size // out.shape[-1]
    attention = out.shape[0] * out.shape[1] ** 2 * out.shape[2] * 2 if quadratic and out.ndim == 3 else 0
    return patches * params + attention


def load_vision(directory: Path, config: dict[str, Any], lazy: bool) -> tuple[VisionLanguageModel, Any]:
    """The model and its processor (plain Python: safe off the MLX thread)."""
    model_type = str(config.get("model_type", "?"))
    if model_type not in VISION_FAMILIES:
        raise ModelLoadError(f"{directory}: vision-language family {model_type!r} is not served (served exactly: {', '.join(VISION_FAMILIES)})")
    try:
        from mlx_vlm.utils import load_model, load_processor
    except ImportError as exc:
        raise ModelLoadError(f"{directory}: a vision-language model needs mlx-vlm (make setup installs it): {exc}") from None
    try:
        vlm = load_model(directory, lazy=lazy)
        processor = load_processor(directory, add_detokenizer=False)
    except Exception as exc:  # mlx-vlm and transformers report missing files and bad weights variously
        raise ModelLoadError(f"{directory}: mlx-vlm cannot load it: {type(exc).__name__}: {exc}") from exc
    if not isinstance(config.get("image_token_id", config.get("image_token_index")), int):
        raise ModelLoadError(f"{directory}: config.json names no image_token_id")
    return VisionLanguageModel(vlm, model_type), processor
