"""Quantized KV in the decode batch: fidelity against mlx-lm's own `QuantizedKVCache`, and the
stored form surviving every way out of the batch (extract, prefix views, checkpoint tensors)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from actors.disk_tier import assemble
from engine.batch import DecodeBatch
from engine.kv import caches
from engine.kv.layout import probe_layout
from engine.kv.quantized import QuantizedKV, new_caches
from policies.layout import full_token_bytes, kv_format, with_kv_quantization
from tests.support.mlx_reference import load_reference
from tools.bench_kv import forced_logprobs_batch, forced_logprobs_mlx_lm, greedy_continuations, mean_abs_error

PROMPT, FORCED = 40, 48


@pytest.fixture(scope="module")
def tiny_kv():
    model, _ = load_reference("builtin:tiny-kv")
    rng = random.Random(11)
    prompts = [[rng.randrange(4, 1000) for _ in range(PROMPT + 7 * i)] for i in range(3)]
    # The float run's greedy choices: the forced continuation every run is scored on.
    return model, probe_layout(model), prompts, greedy_continuations(model, prompts, FORCED)


@pytest.mark.parametrize("bits", [8, pytest.param(4, marks=pytest.mark.slow)])
def test_logprob_error_is_within_twice_mlx_lms_quantized_cache(tiny_kv, bits):
    model, float_layout, prompts, forced = tiny_kv
    layout, kept_float = with_kv_quantization(float_layout, bits, 64, 0)
    assert not kept_float and kv_format(layout) == f"int{bits}/g64/start0"
    reference = [forced_logprobs_mlx_lm(model, p, f, make_prompt_cache(model)) for p, f in zip(prompts, forced)]
    theirs = [forced_logprobs_mlx_lm(model, p, f, [QuantizedKVCache(group_size=64, bits=bits) for _ in layout]) for p, f in zip(prompts, forced)]
    ours = forced_logprobs_batch(model, layout, prompts, forced)
    floats = forced_logprobs_batch(model, float_layout, prompts, forced)
    assert mean_abs_error(floats, reference) < 1e-4  # the float batch is the reference, up to rounding
    mlx_error, our_error = mean_abs_error(theirs, reference), mean_abs_error(ours, reference)
    assert mlx_error > 0 and our_error > 0  # both really quantize
    assert our_error <= 2 * mlx_error, f"{bits}-bit KV: mean |dlogprob| {our_error:.4f} vs mlx-lm's {mlx_error:.4f}"


def test_a_float_head_below_quantized_start_is_closer_to_float(tiny_kv):
    model, float_layout, prompts, forced = tiny_kv
    reference = forced_logprobs_batch(model, float_layout, prompts, forced)

    def error(start: int) -> float:
        layout, _ = with_kv_quantization(float_layout, 4, 64, start)
        return mean_abs_error(forced_logprobs_batch(model, layout, prompts, forced), reference)

    assert error(PROMPT) < error(0)
    assert error(PROMPT + 14 + FORCED + 1) < 1e-5  # every position below the start: float attention


def test_the_stored_form_survives_extract_views_and_checkpoint_tensors(tiny_kv):
    model, float_layout, prompts, _ = tiny_kv
    layout, _ = with_kv_quantization(float_layout, 8, 32, 20)
    prompt = prompts[1]
    cache = new_caches(model, layout)
    model(mx.array(prompt[:30])[None], cache=cache)
    model(mx.array(prompt[30:])[None], cache=cache)  # a second chunk crossing nothing, past the start
    n = len(prompt)
    assert all(type(c) is QuantizedKV and c.offset == n for c in cache)

    def same(a: QuantizedKV, b: QuantizedKV, length: int) -> bool:
        assert a.keys and b.keys and a.values and b.values
        packed = all(mx.array_equal(x[:, :, :length], y[:, :, :length]).item() for x, y in zip(a.keys + a.values, b.keys + b.values))
        kept = min(length, 20)
        heads = all(mx.array_equal(x[:, :, :kept], y[:, :, :kept]).item() for x, y in ((a.head_keys, b.head_keys), (a.head_values, b.head_values)))
        return packed and heads

    # A float cache quantized at once equals the same positions written in pieces.
    keys, values = mx.random.normal((1, 2, n, 64), key=mx.random.key(1)), mx.random.normal((1, 2, n, 64), key=mx.random.key(2))
    float_cache = KVCache()
    float_cache.update_and_fetch(keys, values)
    pieces = QuantizedKV(layout[0])
    for start, end in ((0, 7), (7, 8), (8, 31), (31, n)):
        pieces.update_and_fetch(keys[:, :, start:end], values[:, :, start:end])
    assert same(QuantizedKV.from_float(float_cache, layout[0], n), pieces, n)

    batch = DecodeBatch(layout)
    batch.add_row("a", caches.prefix_view(cache, n - 5), n - 5)
    batch.add_row("b", cache, n)
    extracted = batch.extract("b")
    assert all(same(x, c, n) for x, c in zip(extracted, cache))
    restored = caches.from_tensors(caches.to_tensors(extracted, layout, n), layout, n)
    assert all(same(r, c, n) for r, c in zip(restored, cache))
    assert all(same(x, c, n - 5) for x, c in zip(batch.extract("a"), cache))
    # What it costs: 8-bit, group 32, float32 scales: 1 + 8/32 bytes per element, against 4.
    assert full_token_bytes(layout) * 16 == full_token_bytes(float_layout) * 5


@pytest.mark.parametrize("start", [0, 20])
def test_disk_chunks_concatenate_back_into_the_cache(tiny_kv, start):
    """The disk tier's chunks (`chunk_arrays`, read back with `assemble`) hold exactly the
    positions a checkpoint would, quantized form and float head included, cut where asked."""
    import safetensors.numpy

    model, float_layout, prompts, _ = tiny_kv
    for layout in (float_layout, with_kv_quantization(float_layout, 8, 32, start)[0]):
        prompt = prompts[2]
        cache = new_caches(model, layout)
        model(mx.array(prompt)[None], cache=cache)
        n = len(prompt)
        spans = [(0, 16), (16, 32), (32, 48)]
        chunks = [safetensors.numpy.load(safetensors.numpy.save(arrays)) for arrays in caches.chunk_arrays(cache, layout, spans)]
        whole = caches.from_tensors(caches.to_tensors(cache, layout, 40), layout, 40)
        joined = caches.from_arrays(assemble(chunks, layout, 40, whole=False), layout, 40)
        live = caches.tensor_arrays(cache, layout, 40)
        for restored in (whole, joined):  # (a transposed float head was once stored scrambled)
            assert all(c.offset == 40 for c in restored)
            arrays = caches.tensor_arrays(restored, layout, 40)
            assert arrays.keys() == live.keys() and all((arrays[name] == live[name]).all() for name in live)
        assert n > 48
