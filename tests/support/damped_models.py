"""Built-in models with damped token mixers: models that copy text they have seen.

A random model never repeats its context; scaling each layer's token-mixer output down makes
its logits depend mostly on the current token, so greedy decoding repeats earlier text, as a
model asked to repeat it would (fast-forwarding and prompt-lookup speculation need such copies).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import safetensors.numpy

from tests.support.config import builtin_dir

# The output projections of each layer's token mixer (attention, gated delta, convolution).
MIXER_OUTPUTS = ("self_attn.o_proj.weight", "self_attn.out_proj.weight", "linear_attn.out_proj.weight", "conv.out_proj.weight")


def damped_model(name: str, scale: float, target: Path, head_scale: float = 1.0) -> str:
    """A built-in model with its token mixers' outputs scaled by `scale`, written to `target`. At 0
    each token's logits depend on that token alone, so greedy decoding repeats text it has seen, as a
    model asked to repeat earlier text does (a random model never copies anything); a small scale
    keeps the context's (and the recurrent state's) influence, so copies break off somewhere.
    `head_scale` multiplies the final norm's weights: its logits, so sampling follows them."""
    source = builtin_dir(name)
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, target / path.name)
    for path in source.glob("*.safetensors"):
        weights = safetensors.numpy.load_file(str(path))
        factors = {key: scale if key.endswith(MIXER_OUTPUTS) else head_scale if key == "model.norm.weight" else 1.0 for key in weights}
        damped = {key: w * np.asarray(factors[key], w.dtype) if factors[key] != 1.0 else w for key, w in weights.items()}
        safetensors.numpy.save_file(damped, str(target / path.name), metadata={"format": "mlx"})
    return str(target)
