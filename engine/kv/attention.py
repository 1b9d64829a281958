"""Lets a cache attend by itself where it can do better than the keys it returned.

mlx-lm's models call `mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values,
cache=..., scale=..., mask=...)`, a name each model module imports. `install(model)` rebinds
that name, in the modules the model's layers come from, to `attend`: it asks the cache first
(`cache.attend(queries, keys, values, scale, mask)`) and calls mlx-lm's own function, unchanged,
whenever the cache has no such method or declines (returns None). Other users of those modules
(mlx-lm's own caches, a baseline in the same process) see no change: a cache without the method
takes the original path.

What the engine's caches do with it:
- every decode step's attention on the CPU backend (`decode_attention`): one query per row
  over grouped KV heads as one matrix product per KV head, where MLX's CPU attention runs one
  matrix-vector product per query head and so reads each KV head's keys and values once per
  query head sharing it. The same operations per element; only the matrix product's kernel
  differs, so float32 results agree to rounding (within 3e-7 here; half precision bit for bit)
  and the tokens stay mlx-lm's (tests/engine/test_attention.py, the parity suite). 1.6-1.8x
  faster attention at 2,048-8,192 positions with three query heads per KV head (docs/benchmarks/log.md);
- paged KV's decode steps read each row's blocks in place (`engine.kv.paged`).
While the engine steps, both (and the prefill's attention, through `engine.lanes.attention`) are
split over two CPU lanes by rows or KV heads (`engine.lanes`), bit for bit the unsplit result.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base

from engine import lanes
from engine.rebind import rebind

_ORIGINAL = base.scaled_dot_product_attention


def attend(queries, keys, values, cache, scale: float, mask, sinks=None):
    hook = getattr(cache, "attend", None)
    if hook is not None and sinks is None:
        out = hook(queries, keys, values, scale, mask)
        if out is not None:
            return out
    if sinks is None and not hasattr(cache, "bits"):
        out = lanes.attention(queries, keys, values, scale, mask)
        return out if out is not None else lanes.sdpa(queries, keys, values, scale, mask)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model) -> list[str]:
    """Route the model's attention calls through `attend`; returns the modules rebound."""
    return rebind(model, "scaled_dot_product_attention", _ORIGINAL, attend)


DECLINED = object()


def stacked_mask(queries: mx.array, kv_heads: int, mask):
    """The mask `decode_attention` applies to these queries (None: none; a causal mask by name
    is none for one query, the last position), or `DECLINED` where it does not apply: several
    queries per row, as many KV heads as query heads, a mask that differs between heads or
    queries."""
    heads, num_queries = queries.shape[1:3]
    if num_queries != 1 or kv_heads == heads or heads % kv_heads:
        return DECLINED
    if isinstance(mask, str):
        return None if mask == "causal" else DECLINED
    if mask is not None and (mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] != 1):
        return DECLINED
    return mask


def stack_queries(queries: mx.array, kv_heads: int, scale: float) -> mx.array:
    """`[rows, heads, 1, dim]` queries scaled (MLX's first op) as `[rows, kv_heads, heads per KV
    head, dim]`: each KV head's query heads the rows of one matrix product."""
    rows, heads, _, dim = queries.shape
    return (mx.array(scale, queries.dtype) * queries).reshape(rows, kv_heads, heads // kv_heads, dim)


def decode_attention(queries: mx.array, keys, values, scale: float, mask) -> mx.array | None:
    """MLX's own attention for one query per row (`[rows, heads, 1, dim]`) over grouped KV heads
    (`[rows, kv_heads, positions, dim]`), with each KV head's query heads stacked as the rows of
    one matrix product, on the CPU backend; None where that does not apply (the caller runs
    `mx.fast.scaled_dot_product_attention`): another device (Metal has a fused kernel), several
    queries per row, as many KV heads as query heads, quantized keys, or a mask that differs
    between heads or queries.

    Mirrors MLX's CPU path (`mlx/fast.cpp`'s fallback: scale the queries, scores, a boolean mask
    by `where` with the type's lowest value or an additive one by addition, precise softmax,
    values) operation for operation."""
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array) or mx.default_device() != mx.cpu:
        return None
    rows, heads = queries.shape[:2]
    mask = stacked_mask(queries, keys.shape[1], mask)
    if mask is DECLINED:
        return None

    def stacked(queries: mx.array, keys: mx.array, values: mx.array, mask) -> mx.array:
        rows, heads = queries.shape[:2]
        scores = stack_queries(queries, keys.shape[1], scale) @ keys.swapaxes(-1, -2)
        if mask is not None:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype)) if mask.dtype == mx.bool_ else scores + mask
        scores = lanes.softmax(scores)
        return (scores @ values).reshape(rows, heads, 1, -1)

    if lanes.enabled() and rows * heads * keys.shape[2] >= lanes.MIN_ELEMENTS:
        split = lanes.split_attention(stacked, queries, keys, values, mask)
        if split is not None:
            return split
    return stacked(queries, keys, values, mask)
