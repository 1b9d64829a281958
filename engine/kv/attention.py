"""Lets a cache attend by itself where it can do better than the keys it returned.

mlx-lm's models call `mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values,
cache=..., scale=..., mask=...)`, a name each model module imports. `install(model)` rebinds
that name, in the modules the model's layers come from, to `attend`: it asks the cache first
(`cache.attend(queries, keys, values, scale, mask)`; paged KV's decode steps read each row's
blocks in place, `engine.kv.paged`) and calls mlx-lm's own function, unchanged, whenever the cache
has no such method or declines (returns None). Other users of those modules see no change: a
cache without the method takes the original path.
"""

from __future__ import annotations

import sys

from mlx_lm.models import base

_ORIGINAL = base.scaled_dot_product_attention


def attend(queries, keys, values, cache, scale: float, mask, sinks=None):
    hook = getattr(cache, "attend", None)
    if hook is not None and sinks is None:
        out = hook(queries, keys, values, scale, mask)
        if out is not None:
            return out
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model) -> list[str]:
    """Route the model's attention calls through `attend`; returns the modules rebound."""
    names = {type(model).__module__} | {type(module).__module__ for _, module in model.named_modules()}
    rebound = []
    for name in sorted(names):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL:
            module.scaled_dot_product_attention = attend  # type: ignore[attr-defined]
            rebound.append(name)
    return rebound
