"""Diffusion language models through mlx-vlm (loading: plain Python, safe off the MLX thread).

A model directory whose config names a diffusion family is loaded with mlx-vlm's classes and
served by a denoising engine: its answers are denoised a canvas (or block) at a time instead of
decoded a token at a time. Served exactly (equal to mlx-vlm's own `stream_diffusion_generate`),
text prompts: DiffusionGemma (`engine.denoise`: an encoder cache and canvases of random tokens;
its vision tower is loaded with it and unused: image prompts are refused, as a text model refuses
them) and LLaDA2-MoE (`engine.denoise_blocks`: one stack unmasking blocks of mask tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.kv.layout import dtype_name
from protocols.errors import ModelLoadError
from protocols.model import LayerLayout

DIFFUSION_FAMILIES = ("diffusion_gemma", "llada2_moe")
# Block diffusion: one stack over the prompt and the blocks (`engine.denoise_blocks`).
BLOCK_FAMILIES = ("llada2_moe",)
# Families mlx-vlm also ships that are not served yet (their loops differ).
KNOWN_DIFFUSION = ("nemotron_labs_diffusion",)
# mlx-vlm's block length for a model-driven family whose config names none.
DEFAULT_BLOCK_LENGTH = 32


def is_diffusion_config(config: dict[str, Any]) -> bool:
    return config.get("model_type") in (*DIFFUSION_FAMILIES, *KNOWN_DIFFUSION)


def is_block_diffusion(model_type: str) -> bool:
    return model_type in BLOCK_FAMILIES


def canvas_length(model: nn.Module) -> int:
    """The positions a denoising step works on: DiffusionGemma's canvas, LLaDA2's block."""
    config = model.config
    if is_block_diffusion(str(config.model_type)):
        return int(getattr(config, "default_block_length", None) or DEFAULT_BLOCK_LENGTH)
    return int(config.canvas_length)


def vocab_size(model: nn.Module) -> int:
    config = model.config
    return int(config.vocab_size if is_block_diffusion(str(config.model_type)) else config.text_config.vocab_size)


def diffusion_layout(model: nn.Module) -> list[LayerLayout]:
    """What a request's cache keeps per layer (MLX thread): probed from one token through the
    model's own caches (mlx-vlm's: sliding-window layers rotate, the others grow)."""
    if is_block_diffusion(str(model.config.model_type)):
        cache = model.make_cache()
        model.language_model.model(mx.array([[0]]), cache=cache)
    else:
        cache = model.diffusion_prefill_cache(
            mx.array([[0]]),
            attention_mask=None,
            cache=model.make_cache(),
            pixel_values=None,
            mm_token_type_ids=None,
            prefill_step_size=None,
            chunk_prefill=False,
        )
    mx.eval([c.state for c in cache if getattr(c, "keys", None) is not None])
    layers = []
    for c in cache:
        if getattr(c, "keys", None) is None:
            continue  # (a layer that reads another's cache)
        keys, values = c.keys, c.values
        common = {"heads": keys.shape[1], "key_dim": keys.shape[3], "value_dim": values.shape[3], "dtype": dtype_name(keys.dtype)}
        rotating = type(c).__name__ == "RotatingKVCache"
        layers.append(LayerLayout(kind="window", window=c.max_size, **common) if rotating else LayerLayout(kind="full", **common))
    return layers


def load_diffusion(directory: Path, config: dict[str, Any], lazy: bool) -> nn.Module:
    model_type = str(config.get("model_type", "?"))
    if model_type not in DIFFUSION_FAMILIES:
        raise ModelLoadError(f"{directory}: diffusion family {model_type!r} is not served (served exactly: {', '.join(DIFFUSION_FAMILIES)})")
    try:
        from mlx_vlm.utils import load_model
    except ImportError as exc:
        raise ModelLoadError(f"{directory}: a diffusion language model needs mlx-vlm (make setup installs it): {exc}") from None
    try:
        return load_model(directory, lazy=lazy)
    except Exception as exc:  # mlx-vlm reports missing files and bad weights variously
        raise ModelLoadError(f"{directory}: mlx-vlm cannot load it: {type(exc).__name__}: {exc}") from exc
