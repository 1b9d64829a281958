"""One request's KV out of the decode batch: trimmed copies, prefix views, checkpoint tensors.

A request's KV outside the batch (prefilling, parked, a saved prefix entry) is a list of
per-layer mlx-lm caches. These helpers copy, slice and (de)serialize such lists; they
run on the MLX thread and return evaluated arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import safetensors.numpy
from mlx_lm.models.cache import KVCache

from engine.batch import LayerGeometry
from engine.sequence import EngineInvariantError


def trimmed(caches: Sequence[Any], length: int) -> list[KVCache]:
    """Contiguous copies of the first `length` positions (a prefix entry of its own)."""
    out = []
    for cache in caches:
        copy = KVCache()
        copy.keys = mx.contiguous(cache.keys[..., :length, :])
        copy.values = mx.contiguous(cache.values[..., :length, :])
        copy.offset = length
        out.append(copy)
    mx.eval([c.state for c in out])
    return out


def prefix_view(entry: Sequence[Any], length: int) -> list[KVCache]:
    """Caches that read an entry's first `length` positions without copying them.

    Each cache gets its own array objects (slices): `a[...] = b` rebinds the array object
    `a` in place, so sharing the entry's objects would let a request's writes leak into
    the entry. The slices end exactly at the prefix, so the first write reallocates and
    the entry's buffers are never touched.
    """
    out = []
    for saved in entry:
        cache = KVCache()
        cache.keys, cache.values, cache.offset = saved.keys[..., :length, :], saved.values[..., :length, :], length
        out.append(cache)
    return out


def nbytes(caches: Sequence[Any]) -> int:
    return sum(c.nbytes for c in caches)


def to_tensors(caches: Sequence[Any], length: int) -> bytes:
    """safetensors bytes of the first `length` positions: keys_<layer>, values_<layer>.

    Stored as float32: numpy has no bfloat16, and the widening is exact (restore narrows back).
    """
    tensors = {}
    for layer, cache in enumerate(caches):
        tensors[f"keys_{layer}"] = np.array(cache.keys[..., :length, :].astype(mx.float32))
        tensors[f"values_{layer}"] = np.array(cache.values[..., :length, :].astype(mx.float32))
    return safetensors.numpy.save(tensors)


def from_tensors(data: bytes, geometry: Sequence[LayerGeometry], length: int) -> list[KVCache]:
    """Per-layer caches of `length` positions from `to_tensors` bytes, in the model's dtype."""
    tensors = safetensors.numpy.load(data)
    caches = []
    for layer, shape in enumerate(geometry):
        cache = KVCache()
        cache.keys = mx.array(tensors[f"keys_{layer}"]).astype(shape.dtype)
        cache.values = mx.array(tensors[f"values_{layer}"]).astype(shape.dtype)
        cache.offset = length
        if cache.keys.shape != (1, shape.num_heads, length, shape.key_dim):
            raise EngineInvariantError(f"checkpoint layer {layer} has shape {cache.keys.shape}")
        caches.append(cache)
    return caches
