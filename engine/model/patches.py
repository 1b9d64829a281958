"""Fix-ups, applied at load, for mlx-lm model code that only ever sees one sequence
(patches to mlx-lm's layer classes; LoRA adapters are `engine.lora`).

mlx-lm's generation passes a model one row's mask; the decode batch passes a mask per row
(`[rows, 1, queries, keys]`). Layer code that splits attention heads into more axes than
that mask broadcasts against gets the mask it expects here, and computes what mlx-lm
computes for each row alone.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2


class _Gemma2Attention(gemma2.Attention):
    """Gemma 2 computes grouped-query scores as `[B, kv_heads, repeats, L, S]`: a per-row
    4-D mask needs a heads axis more."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        if isinstance(mask, mx.array) and mask.ndim == 4 and self.repeats > 1:
            mask = mx.expand_dims(mask, 2)
        return super().__call__(x, mask, cache)


_ADAPTED: dict[type, type] = {gemma2.Attention: _Gemma2Attention}


def adapt_for_batches(model: nn.Module) -> int:
    """Swap each layer that needs it for its adapted class (same weights); returns how many."""
    count = 0
    for _, module in model.named_modules():
        adapted = _ADAPTED.get(type(module))
        if adapted is not None:
            module.__class__ = adapted
            count += 1
    return count
