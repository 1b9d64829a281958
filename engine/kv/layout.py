"""Each layer's cache kind, read from the model's own caches at load.

`probe_layout` makes the model's prompt cache (`make_cache()` when the model has one),
forwards one token through it and records, per layer, what the engine must keep for a
request: full attention KV, a sliding window, recurrent state, or a list of these. A layer
of any other kind (quantized, chunked, concatenating caches...) is refused with a
`ModelLoadError` naming the layer and its cache class: never served approximately.

Also the array dtypes KV storage and checkpoints name (`DTYPES`, `dtype_name`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

from protocols.errors import ModelLoadError
from protocols.model import LayerLayout, StateArray


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


DTYPES = {name: getattr(mx, name) for name in ("float32", "float16", "bfloat16", "int32", "uint32", "int8", "uint8")}


def probe_layout(model: nn.Module) -> list[LayerLayout]:
    """Every layer's layout; raises `ModelLoadError` for a cache kind the engine cannot batch."""
    caches = make_prompt_cache(model)
    for index, cache in enumerate(caches):
        _check(cache, str(index))
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    return [_layout(cache) for cache in caches]


def _check(cache, where: str) -> None:
    if type(cache) is CacheList:
        for part, child in enumerate(cache.caches):
            _check(child, f"{where}.{part}")
        return
    if type(cache) is RotatingKVCache and cache.keep:
        raise ModelLoadError(f"layer {where}: RotatingKVCache with keep={cache.keep} (attention sinks kept in the window) is not supported")
    if type(cache) not in (KVCache, RotatingKVCache) and not isinstance(cache, ArraysCache):
        raise ModelLoadError(f"layer {where}: cache class {type(cache).__name__} is not supported for batched decoding")


def _layout(cache) -> LayerLayout:
    if type(cache) is CacheList:
        return LayerLayout(kind="list", parts=[_layout(child) for child in cache.caches])
    if isinstance(cache, ArraysCache):
        states = [StateArray(shape=list(a.shape[1:]), dtype=dtype_name(a.dtype)) if a is not None else StateArray(shape=[], dtype="") for a in cache.cache]
        return LayerLayout(kind="state", states=states)
    keys, values = cache.keys, cache.values
    common = {"heads": keys.shape[1], "key_dim": keys.shape[3], "value_dim": values.shape[3], "dtype": dtype_name(keys.dtype)}
    if type(cache) is RotatingKVCache:
        return LayerLayout(kind="window", window=cache.max_size, **common)
    return LayerLayout(kind="full", **common)
