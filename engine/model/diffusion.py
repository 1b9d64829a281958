"""Diffusion language models through mlx-vlm (loading: plain Python, safe off the MLX thread).

A model directory whose config names a diffusion family is loaded with mlx-vlm's classes and
served by the denoising engine (`engine.denoise`): its answers are denoised a canvas at a time
instead of decoded a token at a time. Served exactly (equal to mlx-vlm's own
`stream_diffusion_generate`): DiffusionGemma, text prompts (its vision tower is loaded with it
and unused: image prompts are refused, as a text model refuses them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.nn as nn

from protocols.errors import ModelLoadError

DIFFUSION_FAMILIES = ("diffusion_gemma",)
# Families mlx-vlm also ships that are not served yet (their loops differ).
KNOWN_DIFFUSION = ("llada2_moe", "nemotron_labs_diffusion")


def is_diffusion_config(config: dict[str, Any]) -> bool:
    return config.get("model_type") in (*DIFFUSION_FAMILIES, *KNOWN_DIFFUSION)


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
