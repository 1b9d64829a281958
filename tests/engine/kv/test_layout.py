"""Layer layouts probed from a model's own caches; unknown kinds refused at load, by layer."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from engine.kv.layout import probe_layout
from protocols.errors import ModelLoadError
from runtime import Runtime, env
from tests.support.config import make_config
from tests.support.families import UNSUPPORTED, build


class _Model:
    """Just enough of a model for `probe_layout`: its caches, and a forward that fills them."""

    def __init__(self, make):
        self._make = make

    def make_cache(self):
        return self._make()

    def __call__(self, inputs, cache):
        for c in cache:
            _fill(c)
        return mx.zeros((1, 1, 8))


def _fill(cache) -> None:
    if isinstance(cache, CacheList):
        for child in cache.caches:
            _fill(child)
    elif isinstance(cache, ArraysCache):
        cache[0] = mx.zeros((1, 3, 6))
        cache[1] = mx.zeros((1, 2, 4, 4), dtype=mx.bfloat16)
    else:
        cache.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 4)))


def test_layouts_of_full_window_state_and_list_layers():
    model = _Model(lambda: [KVCache(), RotatingKVCache(max_size=32), ArraysCache(2), CacheList(ArraysCache(2), KVCache())])
    full, window, state, pair = probe_layout(model)
    assert (full.kind, full.heads, full.key_dim, full.value_dim, full.dtype) == ("full", 2, 8, 4, "float32")
    assert (window.kind, window.window) == ("window", 32)
    assert state.kind == "state" and [(s.shape, s.dtype) for s in state.states] == [([3, 6], "float32"), ([2, 4, 4], "bfloat16")]
    assert pair.kind == "list" and [p.kind for p in pair.parts] == ["state", "full"]


@pytest.mark.parametrize(
    ("make", "where", "what"),
    [
        (lambda: [KVCache(), ChunkedKVCache(chunk_size=64)], "layer 1", "ChunkedKVCache"),
        (lambda: [QuantizedKVCache()], "layer 0", "QuantizedKVCache"),
        (lambda: [KVCache(), KVCache(), CacheList(KVCache(), QuantizedKVCache())], "layer 2.1", "QuantizedKVCache"),
        (lambda: [RotatingKVCache(max_size=32, keep=4)], "layer 0", "keep=4"),
    ],
    ids=["chunked", "quantized", "inside-a-list", "kept-sinks"],
)
def test_a_cache_kind_the_batch_cannot_hold_is_refused_naming_the_layer(make, where, what):
    with pytest.raises(ModelLoadError) as caught:
        probe_layout(_Model(make))
    assert where in str(caught.value) and what in str(caught.value)


@pytest.mark.parametrize("family", list(UNSUPPORTED))
async def test_opening_a_family_the_batch_cannot_hold_is_a_typed_refusal(family):
    directory = build(family, env.home())
    with pytest.raises(ModelLoadError, match=r"layer \d+: cache class \w+ is not supported"):
        async with Runtime.open(make_config(str(directory))):
            pass
