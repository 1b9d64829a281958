"""mlxrt's quantized product (`engine/native/quantized.h`): `mx.quantized_matmul` for affine 4- and
8-bit weights within float rounding, on both instruction sets, one row to a prefill's many, with
or without its helper thread; refused typed where it does not apply; checked at load; and the
quantized layers that use it inside the engine's step (`engine.lanes`)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine import lanes, native


@pytest.fixture(params=["avx512", "avx2"])
def isa(request, kernels):
    """Each instruction set the product has (AVX-512 only where this CPU has it)."""
    on = kernels.set_avx512(request.param == "avx512")
    if request.param == "avx512" and not on:
        kernels.set_avx512(True)
        pytest.skip("this CPU has no AVX-512")
    yield request.param
    kernels.set_avx512(True)


def _normal(rng, *shape: int) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def _quantized(rng, features: int, width: int, group: int, bits: int):
    return mx.quantize(_normal(rng, features, width), group_size=group, bits=bits)


def _close(got: mx.array, expected: mx.array, x: mx.array, w, group: int, bits: int) -> None:
    """Within float rounding: a relative 1e-5 of the products' magnitudes (sum |x| |w|)."""
    assert got.shape == expected.shape and got.dtype == mx.float32
    dense = mx.dequantize(*w, group_size=group, bits=bits)
    magnitude = (mx.abs(x).reshape(-1, x.shape[-1]) @ mx.abs(dense).T).max().item()
    assert mx.abs(got - expected).max().item() <= 1e-5 * magnitude


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 23, 24, 40])
def test_the_product_is_mlxs_quantized_matmul_within_rounding(kernels, isa, bits, group, rows):
    rng = np.random.default_rng(rows * 100 + group + bits)
    w = _quantized(rng, 1048, 384, group, bits)  # (1,048 features: uneven tails of every tile and half)
    x = _normal(rng, rows, 384)
    expected = mx.quantized_matmul(x, *w, transpose=True, group_size=group, bits=bits)
    for helped in (True, False):
        _close(kernels.quantized_matmul(x, *w, group_size=group, bits=bits, helped=helped), expected, x, w, group, bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [24, 100, 256, 257])
def test_wide_inputs_take_the_tiles_up_to_256_rows_then_the_panels(kernels, bits, rows):
    """Inputs of 2,048 or more go through the tiles up to 256 rows (their panels would leave the
    cache), through dequantized panels and BLAS past that: mlx's product within rounding either way."""
    rng = np.random.default_rng(rows + bits)
    w = _quantized(rng, 200, 2048, 64, bits)
    x = _normal(rng, rows, 2048)
    expected = mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=bits)
    for helped in (True, False):
        _close(kernels.quantized_matmul(x, *w, group_size=64, bits=bits, helped=helped), expected, x, w, 64, bits)


def test_leading_dimensions_views_and_a_bias_free_layer(kernels):
    rng = np.random.default_rng(1)
    w = _quantized(rng, 96, 256, 64, 4)
    x = _normal(rng, 2, 3, 256)
    expected = mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)
    _close(kernels.quantized_matmul(x, *w, group_size=64, bits=4), expected, x, w, 64, 4)
    view = _normal(rng, 256, 5).T  # (a transposed view: copied contiguous first)
    _close(kernels.quantized_matmul(view, *w, group_size=64, bits=4), mx.quantized_matmul(view, *w, transpose=True, group_size=64, bits=4), view, w, 64, 4)


def test_what_it_does_not_take_is_refused_typed(kernels):
    rng = np.random.default_rng(2)
    w, scales, biases = _quantized(rng, 64, 128, 32, 4)
    x = _normal(rng, 1, 128)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        kernels.quantized_matmul(x, w, scales, biases, group_size=32, bits=3)
    with pytest.raises(ValueError, match="groups of 32, 64 or 128"):
        kernels.quantized_matmul(x, w, scales, biases, group_size=16, bits=4)
    with pytest.raises(ValueError, match="do not match"):
        kernels.quantized_matmul(_normal(rng, 1, 96), w, scales, biases, group_size=32, bits=4)
    with pytest.raises(ValueError, match="float32"):
        kernels.quantized_matmul(x.astype(mx.float16), w, scales, biases, group_size=32, bits=4)
    with pytest.raises(ValueError, match="uint32"):
        kernels.quantized_matmul(x, w.astype(mx.int32), scales, biases, group_size=32, bits=4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_biases_the_scales_times_a_power_of_two_give_the_same_bits_through_the_ratio(kernels, isa, bits, group, rows):
    """GGUF's Q4_0 and Q8_0 biases are -8 and -128 times their scales: given that ratio, a lone row's
    product takes the biases' term from the scales, the same values (a power of two's scaling is
    exact); other rows and AVX-512's tiles read the biases as before."""
    rng = np.random.default_rng(rows * 10 + group + bits)
    w, scales, _ = _quantized(rng, 1048, 384, group, bits)
    ratio = -float(2 ** (bits - 1))
    biases = scales * ratio
    x = _normal(rng, rows, 384)
    expected = kernels.quantized_matmul(x, w, scales, biases, group_size=group, bits=bits)
    _close(expected, mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group, bits=bits), x, (w, scales, biases), group, bits)
    assert mx.array_equal(kernels.quantized_matmul(x, w, scales, biases, group_size=group, bits=bits, bias_ratio=ratio), expected)


def test_a_lone_row_given_the_ratio_reads_no_biases(kernels, isa):
    """(Biases of NaNs: a lone row on AVX2 given the ratio never reads them.)"""
    if isa != "avx2":
        pytest.skip("AVX-512's tiles read the biases")
    rng = np.random.default_rng(5)
    w, scales, _ = _quantized(rng, 300, 256, 32, 8)
    x = _normal(rng, 1, 256)
    expected = kernels.quantized_matmul(x, w, scales, scales * -128.0, group_size=32, bits=8)
    poisoned = mx.full(scales.shape, float("nan"))
    assert mx.array_equal(kernels.quantized_matmul(x, w, scales, poisoned, group_size=32, bits=8, bias_ratio=-128.0), expected)


def test_a_ratio_that_is_not_a_power_of_two_is_refused(kernels):
    rng = np.random.default_rng(6)
    w, scales, biases = _quantized(rng, 64, 128, 32, 4)
    x = _normal(rng, 1, 128)
    for ratio in (3.0, -7.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="power of two"):
            kernels.quantized_matmul(x, w, scales, biases, group_size=32, bits=4, bias_ratio=ratio)


def test_the_load_check_refuses_a_product_off_by_more_than_rounding(kernels):
    names = ("swiglu", "rms_norm", "rope", "softmax", "scaled_dot_product_attention")
    wrong = SimpleNamespace(**{name: getattr(kernels, name) for name in names})
    wrong.quantized_matmul = lambda x, w, s, b, group_size, bits: kernels.quantized_matmul(x, w, s, b, group_size=group_size, bits=bits) * 1.001
    assert native.check(wrong) == "quantized_matmul (4 bits, groups of 32, 1 rows)"
    wrong.quantized_matmul = kernels.quantized_matmul
    assert native.check(wrong) is None


def _layers(rng, bits: int = 4, group: int = 32):
    linear = nn.QuantizedLinear(256, 72, bias=True, group_size=group, bits=bits)
    linear.update({"weight": _quantized(rng, 72, 256, group, bits)[0]})
    embedding = nn.QuantizedEmbedding(500, 256, group_size=group, bits=bits)
    mx.eval(linear.parameters(), embedding.parameters())
    return linear, embedding


@pytest.mark.parametrize("rows", [1, 6, 30])
def test_quantized_layers_use_the_kernel_inside_the_step_and_mlxs_outside(kernels, rows):
    """Inside `lanes.parallel()` the layers' products are the kernel's (within rounding of MLX's);
    outside, they are MLX's own, bit for bit."""
    rng = np.random.default_rng(rows)
    linear, embedding = _layers(rng)
    x = _normal(rng, rows, 256)
    expected_linear, expected_head = linear(x), embedding.as_linear(x)
    model = nn.Sequential(linear, embedding)
    lanes.install(model)
    assert isinstance(linear, lanes.KernelQuantizedLinear) and isinstance(embedding, lanes.KernelQuantizedEmbedding)
    assert mx.array_equal(linear(x), expected_linear) and mx.array_equal(embedding.as_linear(x), expected_head)
    with lanes.parallel():
        inside_linear, inside_head = linear(x), embedding.as_linear(x)
        ids = mx.array([[3, 499, 7]])
        assert mx.array_equal(embedding(ids), nn.QuantizedEmbedding.__call__(embedding, ids))  # (lookups stay MLX's)
    assert not mx.array_equal(inside_head, expected_head)  # (another summation order: the kernel ran)
    _close(inside_linear - linear.bias, expected_linear - linear.bias, x, (linear.weight, linear.scales, linear.biases), 32, 4)
    _close(inside_head, expected_head, x, (embedding.weight, embedding.scales, embedding.biases), 32, 4)


def test_install_gives_each_quantized_layer_its_bias_ratio_and_the_step_uses_it(kernels):
    """A layer whose biases are its scales times -2^(bits - 1) (GGUF's Q4_0, Q8_0) gets that ratio; an
    affine one (MLX's quantization, GGUF's Q4_1: a minimum a group) gets 0; the step's product is
    the same either way."""
    rng = np.random.default_rng(7)
    symmetric = nn.QuantizedLinear(256, 72, bias=False, group_size=32, bits=8)
    symmetric.biases = symmetric.scales * -128.0
    affine = nn.QuantizedLinear(256, 72, bias=False, group_size=32, bits=4)
    mx.eval(symmetric.parameters(), affine.parameters())
    lanes.install(nn.Sequential(symmetric, affine))
    assert getattr(symmetric, lanes.BIAS_RATIO) == -128.0 and getattr(affine, lanes.BIAS_RATIO) == 0.0
    x = _normal(rng, 1, 256)
    expected = kernels.quantized_matmul(x, symmetric.weight, symmetric.scales, symmetric.biases, group_size=32, bits=8)
    with lanes.parallel():
        assert mx.array_equal(symmetric(x), expected)
        if kernels.quantized_isa() == "avx2":  # (the ratio is what the step passes: biases of NaNs go unread)
            symmetric.biases = mx.full(symmetric.scales.shape, float("nan"))
            assert mx.array_equal(symmetric(x), expected)


def test_two_threads_products_at_once_share_the_helper_safely(kernels):
    """Products evaluated on two threads' streams at once (the helper serves one at a time; the
    other computes both halves itself): each result is the one computed alone."""
    import threading

    rng = np.random.default_rng(5)
    w = _quantized(rng, 2048, 1024, 64, 8)  # (2 MiB of 8-bit weights: the helper splits even one row)
    inputs = [_normal(rng, rows, 1024) for rows in (1, 4, 1, 4)]
    alone = [kernels.quantized_matmul(x, *w, group_size=64, bits=8) for x in inputs]
    mx.eval(alone)
    failures: list[str] = []

    def worker(index: int) -> None:
        with mx.stream(mx.new_stream(mx.cpu)):
            for _ in range(20):
                for i in (index, index + 2):
                    got = kernels.quantized_matmul(inputs[i], *w, group_size=64, bits=8)
                    if not mx.array_equal(got, alone[i]).item():
                        failures.append(f"input {i}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads) and failures == []


def test_back_to_back_shared_products_are_each_computed_once_and_whole(kernels):
    """A graph of shared products one after another, of 2 and 32 chunks in turn (the helper may
    still be claiming in one product's state when the next begins): each result bit for bit the
    product computed on the calling thread alone (the same tiles over the same features)."""
    rng = np.random.default_rng(11)
    weights = [_quantized(rng, 128, 512, 32, 4), _quantized(rng, 2048, 512, 32, 4)]
    inputs = [_normal(rng, rows, 512) for rows in (1, 3)]
    order = [(i % 2, (i // 2) % 2) for i in range(400)]
    shared = [kernels.quantized_matmul(inputs[x], *weights[w], group_size=32, bits=4) for w, x in order]
    alone = [kernels.quantized_matmul(inputs[x], *weights[w], group_size=32, bits=4, helped=False) for w, x in order]
    mx.eval(shared)
    mx.eval(alone)
    assert all(mx.array_equal(a, b).item() for a, b in zip(shared, alone))
