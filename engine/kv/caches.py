"""One request's caches out of the decode batch: copies, prefix views, checkpoint tensors.

A request's state outside the batch (prefilling, parked, a saved prefix entry) is a list of
mlx-lm caches, one per layer, of the layer's kind: `KVCache` (full attention), a
`RotatingKVCache` (sliding window), an `ArraysCache` (recurrent state) or a `CacheList` of
those. Only full attention can be cut at any position; windows and states are used at
their own length. These run on the MLX thread and return evaluated arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import safetensors.numpy
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from engine.errors import EngineInvariantError
from engine.kv.layout import DTYPES
from engine.kv.paged import PagedKV, PagedRef
from engine.kv.quantized import QuantizedKV
from policies.layout import leaves, tensor_shapes
from protocols.model import LayerLayout


def evaluate(caches: Sequence[Any]) -> None:
    states: Any = tree_flatten([c.state for c in caches])
    mx.eval([a for _, a in states if isinstance(a, mx.array)])


def length_of(cache) -> int:
    """Positions a cache has consumed (0 for a state, which has no positions of its own)."""
    if type(cache) is CacheList:
        return max((length_of(c) for c in cache.caches), default=0)
    return int(getattr(cache, "offset", 0) or 0)


def _cut(source: Any, length: int, copy: bool) -> Any:
    """The cache over its first `length` positions: sliced (full attention), else as it is
    (a window or a state is only ever used at its own length)."""
    cache: Any = source  # (mlx-lm's caches type their arrays as None until first written)
    if type(cache) is PagedRef:
        return cache  # its positions are in blocks (`engine.kv.prefixes`)
    if type(cache) is PagedKV:
        return PagedRef(cache.ordinal)  # the blocks are held by whoever keeps this
    if type(cache) is QuantizedKV:
        return cache.cut(length, copy)
    if type(cache) is KVCache:
        full = KVCache()
        keys, values = source.keys[..., :length, :], source.values[..., :length, :]
        full.keys, full.values = (mx.contiguous(keys), mx.contiguous(values)) if copy else (keys, values)
        full.offset = length
        return full
    if type(cache) is CacheList:
        return CacheList(*(_cut(c, length, copy) for c in cache.caches))
    if type(cache) is RotatingKVCache:
        window: Any = RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
        if source.keys is not None:
            window.keys, window.values = mx.array(source.keys), mx.array(source.values)
        window.offset, window._idx = cache.offset, cache._idx
        return window
    if isinstance(cache, ArraysCache):
        state = ArraysCache(len(cache.cache))
        state.cache = [mx.array(a) if a is not None else None for a in cache.cache]
        return state
    raise EngineInvariantError(f"cannot copy a {type(cache).__name__}")


def trimmed(caches: Sequence[Any], length: int) -> list:
    """Copies of the caches over their first `length` positions (a prefix entry of its own)."""
    out = [_cut(c, length, copy=True) for c in caches]
    evaluate(out)
    return out


def prefix_view(entry: Sequence[Any], length: int) -> list:
    """Caches that start a request from an entry's first `length` positions, never writing
    into the entry: full attention reads slices of it (`a[...] = b` rebinds the array object,
    and a slice ending at `length` makes the first write reallocate); windows and states are
    copied (mlx-lm updates them in place)."""
    return [_cut(c, length, copy=False) for c in entry]


def nbytes(caches: Sequence[Any]) -> int:
    return sum(c.nbytes for c in caches)


def to_tensors(caches: Sequence[Any], layout: Sequence[LayerLayout], length: int) -> bytes:
    """safetensors bytes of caches covering `length` positions, named by `policies.layout`.

    Stored as float32: numpy has no bfloat16, and the widening is exact (restore narrows back).
    """
    return safetensors.numpy.save(tensor_arrays(caches, layout, length))


def tensor_arrays(caches: Sequence[Any], layout: Sequence[LayerLayout], length: int, start: int = 0) -> dict[str, np.ndarray]:
    """The arrays `to_tensors` stores, as numpy copies (safe to hand to another thread); with
    `start` (full-attention layouts), only positions `start:length` of each."""
    flat = dict(_leaf_caches(caches, layout))
    tensors = {}
    for name, shape in tensor_shapes(layout, length).items():
        layer, _, field = name.rpartition(".")
        if field in ("packed", "scales", "biases") or type(flat.get(layer)) is QuantizedKV:
            tensors[name] = _quantized_tensor(flat, name, shape, start)
            continue
        cache = flat[layer]
        if field in ("keys", "values"):
            keys, values = _in_order(cache)
            array = keys if field == "keys" else values
            # Full attention: the first `length` positions; a window: its last ones, up to `length`.
            array = array[..., start:length, :] if type(cache) is KVCache else array[..., array.shape[2] - shape[2] :, :]
        else:
            array = cache[int(field.removeprefix("state"))]
        tensors[name] = array.astype(mx.float32)
    mx.eval(list(tensors.values()))  # one evaluation for all of them, then plain copies
    return {name: _numpy(array) for name, array in tensors.items()}


def chunk_arrays(caches: Sequence[Any], layout: Sequence[LayerLayout], spans: Sequence[tuple[int, int]]) -> list[dict[str, np.ndarray]]:
    """Per span `(start, end)`, the positions `start:end` of every tensor `to_tensors` would store
    for `end` positions (full attention only: each position's KV is its own, so chunks of one
    sequence concatenate back into it). Numpy copies, safe to hand to another thread."""
    return [tensor_arrays(caches, layout, end, start) for start, end in spans]


_PARTS = {"packed": 0, "scales": 1, "biases": 2}


def _numpy(array: mx.array) -> np.ndarray:
    """A C-ordered numpy copy. (`np.array` keeps an MLX array's axis order, which is transposed
    where MLX wrote a transposed projection into it; safetensors writes the buffer as if it were
    C-ordered, so such a copy was stored scrambled.)"""
    return np.ascontiguousarray(np.array(array))


def _quantized_tensor(flat: dict, name: str, shape: tuple[int, ...], start: int = 0) -> mx.array:
    """A quantized layer's tensor: `<layer>.<keys|values>.<packed|scales|biases>`, or its float
    head `<layer>.<keys|values>` (scales and biases widened to float32 like float KV), from
    position `start`."""
    path, _, last = name.rpartition(".")
    if last in _PARTS:
        layer, _, field = path.rpartition(".")
        cache = flat[layer]
        array = (cache.keys if field == "keys" else cache.values)[_PARTS[last]][:, :, start : shape[2]]
        return array if last == "packed" else array.astype(mx.float32)
    cache = flat[path]
    head = cache.head_keys if last == "keys" else cache.head_values
    return head[:, :, start : max(start, shape[2])].astype(mx.float32)


def from_tensors(data: bytes, layout: Sequence[LayerLayout], length: int) -> list:
    """Per-layer caches of `length` positions from `to_tensors` bytes, in the model's dtypes."""
    return from_arrays(safetensors.numpy.load(data), layout, length)


def from_arrays(tensors: dict[str, np.ndarray], layout: Sequence[LayerLayout], length: int) -> list:
    """Per-layer caches of `length` positions from the arrays `tensor_arrays` makes (or a
    disk tier's files hold), in the model's dtypes."""
    for name, shape in tensor_shapes(layout, length).items():
        if name not in tensors or tuple(tensors[name].shape) != shape:
            raise EngineInvariantError(f"checkpoint tensor {name} is missing or not shaped {shape}")
    return [_restore(tensors, str(i), layer, length) for i, layer in enumerate(layout)]


def _restore(tensors: dict, name: str, layer: LayerLayout, length: int) -> Any:
    if layer.kind == "list":
        return CacheList(*(_restore(tensors, f"{name}.{j}", part, length) for j, part in enumerate(layer.parts)))
    if layer.kind == "state":
        cache = ArraysCache(len(layer.states))
        for j, spec in enumerate(layer.states):
            if spec.dtype:
                cache[j] = mx.array(tensors[f"{name}.state{j}"]).astype(DTYPES[spec.dtype])
        return cache
    if layer.kind == "full" and layer.kv_bits:
        return _restore_quantized(tensors, name, layer, length)
    keys = mx.array(tensors[f"{name}.keys"]).astype(DTYPES[layer.dtype])
    values = mx.array(tensors[f"{name}.values"]).astype(DTYPES[layer.dtype])
    if layer.kind == "window":
        window: Any = RotatingKVCache(max_size=layer.window, keep=0)
        window.keys, window.values, window.offset, window._idx = keys, values, length, keys.shape[2]
        return window
    full = KVCache()
    full.keys, full.values, full.offset = keys, values, length
    return full


def _restore_quantized(tensors: dict, name: str, layer: LayerLayout, length: int) -> QuantizedKV:
    dtype = DTYPES[layer.dtype]
    cache = QuantizedKV(layer)

    def parts(field: str) -> list[mx.array]:
        words = mx.array(tensors[f"{name}.{field}.packed"])
        return [words, *(mx.array(tensors[f"{name}.{field}.{p}"]).astype(dtype) for p in ("scales", "biases"))]

    cache.keys, cache.values, cache.offset = parts("keys"), parts("values"), length
    if layer.kv_start:
        heads = []
        for field, dim in (("keys", layer.key_dim), ("values", layer.value_dim)):
            head = mx.zeros((1, layer.heads, layer.kv_start, dim), dtype)
            kept = min(length, layer.kv_start)
            head[:, :, :kept] = mx.array(tensors[f"{name}.{field}"]).astype(dtype)
            heads.append(head)
        cache.head_keys, cache.head_values = heads
    return cache


def _leaf_caches(caches: Sequence[Any], layout: Sequence[LayerLayout]):
    """(name, cache) of every non-list layer, named as `policies.layout.leaves` names them."""
    by_name = {}

    def walk(cache, name: str) -> None:
        if type(cache) is CacheList:
            for j, child in enumerate(cache.caches):
                walk(child, f"{name}.{j}")
        else:
            by_name[name] = cache

    for i, cache in enumerate(caches):
        walk(cache, str(i))
    return [(name, by_name[name]) for name, _ in leaves(layout)]


def _in_order(cache) -> tuple[mx.array, mx.array]:
    if type(cache) is RotatingKVCache:
        return cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
