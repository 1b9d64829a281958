"""A decode step's attention with grouped query heads stacked (`engine.kv.attention`)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest

from engine.kv.attention import decode_attention


def _inputs(rows: int, heads: int, kv_heads: int, positions: int, dim: int, dtype=mx.float32):
    keys = [mx.random.key(i) for i in range(3)]
    q = mx.random.normal((rows, heads, 1, dim), key=keys[0]).astype(dtype)
    # Keys and values as the slots hand them over: the first positions of a larger buffer.
    k = mx.random.normal((rows, kv_heads, positions + 9, dim), key=keys[1]).astype(dtype)[:, :, :positions]
    v = mx.random.normal((rows, kv_heads, positions + 9, dim), key=keys[2]).astype(dtype)[:, :, :positions]
    return q, k, v


def _mask(kind: str, rows: int, positions: int, dtype):
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    # Rows at different lengths (the batch's right-padded rows): row i sees positions <= its own.
    visible = mx.arange(positions)[None, None, None, :] <= mx.array([positions - 1 - 3 * i for i in range(rows)])[:, None, None, None]
    return visible if kind == "bool" else mx.where(visible, 0.0, -1e9).astype(dtype)


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "positions", "dim", "mask"),
    [
        *(
            (rows, heads, kv, positions, 64, mask)
            for rows, (heads, kv), positions, mask in itertools.product([1, 4], [(9, 3), (16, 2)], [5, 2100], ["none", "bool", "add", "causal"])
        ),
        (4, 8, 2, 300, 128, "bool"),
        (1, 8, 2, 300, 128, "none"),
    ],
)
def test_it_equals_mlx_attention_to_rounding(rows, heads, kv_heads, positions, dim, mask):
    """MLX's own attention for the same inputs, to within float32 rounding (the matrix
    product's kernel differs: one matrix-matrix product per KV head instead of one
    matrix-vector product per query head)."""
    q, k, v = _inputs(rows, heads, kv_heads, positions, dim)
    m = _mask(mask, rows, positions, mx.float32)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=m)
    got = decode_attention(q, k, v, dim**-0.5, m)
    assert got is not None and got.shape == expected.shape == (rows, heads, 1, dim)
    assert mx.allclose(got, expected, atol=2e-6, rtol=1e-5).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_equals_mlx_attention(dtype):
    q, k, v = _inputs(2, 9, 3, 300, 64, dtype)
    m = _mask("bool", 2, 300, dtype)
    got = decode_attention(q, k, v, 0.125, m)
    assert got is not None and got.dtype == dtype
    assert mx.array_equal(got, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)).item()


def test_it_declines_what_it_does_not_cover():
    """None (the caller runs MLX's attention) for several queries per row, one KV head per
    query head, quantized keys, a mask per head or per query, an unknown mask string, and
    any device but the CPU."""
    q, k, v = _inputs(2, 8, 2, 40, 64)
    assert decode_attention(mx.concatenate([q, q], axis=2), k, v, 0.125, None) is None
    q4, k4, v4 = _inputs(2, 4, 4, 40, 64)
    assert decode_attention(q4, k4, v4, 0.125, None) is None
    assert decode_attention(q, (k, k, k), (v, v, v), 0.125, None) is None
    assert decode_attention(q, k, v, 0.125, mx.ones((2, 8, 1, 40), dtype=mx.bool_)) is None
    assert decode_attention(q, k, v, 0.125, "sliding") is None
    assert decode_attention(q, k, v, 0.125, None) is not None
    if mx.metal.is_available():
        with mx.stream(mx.gpu):
            assert decode_attention(q, k, v, 0.125, None) is None


def test_the_engines_decode_steps_attend_with_stacked_heads(monkeypatch):
    """Both decode paths (a lone row's compiled step, a batch's step) go through it, and the
    tokens stay mlx-lm's (the parity tests cover every family)."""
    from engine import compiled
    from engine.engine import Engine
    from engine.kv import slots
    from engine.kv.layout import probe_layout
    from tests.support.engine_driver import Driver, admit_request, random_prompts
    from tests.support.mlx_reference import greedy_tokens, load_reference

    calls: list[int] = []

    def counted(queries, keys, values, scale, mask):
        calls.append(queries.shape[0])
        return decode_attention(queries, keys, values, scale, mask)

    monkeypatch.setattr(slots, "decode_attention", counted)
    monkeypatch.setattr(compiled, "decode_attention", counted)
    model, tokenizer = load_reference("builtin:tiny")
    engine = Engine(model, probe_layout(model))
    prompts = random_prompts([7, 12])
    driver = Driver(engine)
    driver.admit(admit_request("a", prompts[0], max_tokens=4), admit_request("b", prompts[1], max_tokens=10))
    driver.run()
    assert driver.tokens["a"] == greedy_tokens(model, tokenizer, prompts[0], 4)
    assert driver.tokens["b"] == greedy_tokens(model, tokenizer, prompts[1], 10)
    assert 2 in calls and 1 in calls  # batched steps, then "b" alone (traced once per shape)
