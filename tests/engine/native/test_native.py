"""mlxrt's CPU kernels (`engine.native`): built on this machine, and bit for bit MLX's own results
(mlx-lm's `swiglu`, `mx.exp`, `mx.softmax(precise=True)`, `mx.fast.scaled_dot_product_attention`)
on random, extreme and special inputs; used only inside the engine's step; an engine's tokens
the same with and without them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import activations

from engine import lanes, native
from engine.engine import Engine
from engine.kv.layout import probe_layout

_SWIGLU = activations.swiglu


def _array(values) -> mx.array:
    return mx.array(np.asarray(values, dtype=np.float32))


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b, equal_nan=True).item())


def _specials() -> np.ndarray:
    """Zeros, infinities, NaN, the exp's cut-offs (+-88) and rounding points (half-integers of
    x * log2(e)), denormals, and float32's extremes, with their neighbours."""
    base = [0.0, -0.0, np.inf, -np.inf, np.nan, 88.0, -88.0, 1e-45, -1e-45, 1e-38, 3.4028235e38, -3.4028235e38, 1.0, -1.0]
    base += [(k + 0.5) / 1.442695 for k in range(-130, 130)]
    values = np.array(base, dtype=np.float32)
    with np.errstate(over="ignore"):  # (the neighbours of float32's extremes are infinities)
        around = [np.nextafter(values, np.float32(np.inf)), np.nextafter(values, np.float32(-np.inf))]
    return np.concatenate([values, *around])


def test_the_kernels_build_load_and_pass_their_own_check(kernels):
    assert kernels.supported
    assert native.check(kernels) is None
    assert native.loaded() is kernels
    assert native.build().exists()  # (built once: a second call finds it)


def test_exp_and_swiglu_on_random_bit_patterns_and_specials(kernels):
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    for values in (bits, _specials(), rng.standard_normal(4099).astype(np.float32) * 30):
        x = mx.array(values)
        assert _equal(kernels.exp(x), mx.exp(x))
        up = mx.array(rng.standard_normal(values.shape).astype(np.float32))
        assert _equal(kernels.swiglu(x, up), _SWIGLU(x, up))


@pytest.mark.parametrize("size", [1, 7, 8, 9, 15, 16, 17, 1536, 1543])
def test_swiglu_every_tail_length_and_strided_inputs(kernels, size):
    gate, up = mx.random.normal((3, size), key=mx.random.key(size)) * 6, mx.random.normal((3, size), key=mx.random.key(size + 1))
    assert _equal(kernels.swiglu(gate, up), _SWIGLU(gate, up))
    wide = mx.random.normal((size, 6), key=mx.random.key(2)) * 6
    assert _equal(kernels.swiglu(wide.T, wide.T[::-1]), _SWIGLU(wide.T, wide.T[::-1]))  # (not row-contiguous)


def test_views_are_copied_when_evaluated_not_by_a_node_in_the_graph(kernels, tmp_path):
    """The primitives take their inputs as they are: a traced or lazy input that turns out
    contiguous costs no copy node (a decode step had ~400), and one that does not (transposed,
    reversed, broadcast, an offset slice) is copied when evaluated, with MLX's own results."""
    gate, up = mx.random.normal((4, 96), key=mx.random.key(3)), mx.random.normal((96,), key=mx.random.key(4))

    def step(gate, up):
        return kernels.swiglu(gate * 2, mx.broadcast_to(up, gate.shape))  # (a lazy input; a stride-0 one)

    out = mx.compile(step)(gate, up)
    dot = tmp_path / "step.dot"
    mx.export_to_dot(str(dot), out)
    assert "Contiguous" not in dot.read_text()
    assert _equal(out, _SWIGLU(gate * 2, mx.broadcast_to(up, gate.shape)))
    wide = mx.random.normal((7, 96, 5), key=mx.random.key(5))
    for view in (wide[2, :, 1:4].T, wide[::-2, 3, :].T[::-1], wide[:, 10:74, 2]):
        rows = mx.random.normal(view.shape, key=mx.random.key(6))
        assert _equal(kernels.swiglu(view, rows), _SWIGLU(view, rows))
        assert _equal(kernels.swiglu(rows, view), _SWIGLU(rows, view))
        assert _equal(kernels.softmax(view), mx.softmax(view, axis=-1, precise=True))


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (4, 8), (9, 127), (2, 3, 4, 2051), (72, 127, 127)])
def test_softmax_as_mlxs_precise_softmax(kernels, shape):
    scores = mx.random.normal(shape, key=mx.random.key(len(shape))) * 9
    assert _equal(kernels.softmax(scores), mx.softmax(scores, axis=-1, precise=True))
    assert _equal(kernels.softmax(scores.swapaxes(-1, -2)), mx.softmax(scores.swapaxes(-1, -2), axis=-1, precise=True))


def test_softmax_rows_with_masked_infinite_and_nan_entries(kernels):
    lowest = np.finfo(np.float32).min
    rows = _array(
        [
            [0.0, lowest, lowest, 1.0, 2.0, lowest, 3.0, -1.0, 0.5],
            [lowest] * 9,
            [-np.inf, 0.0, 1.0, -np.inf, 2.0, 3.0, 4.0, 5.0, 6.0],
            [np.inf, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
            [np.nan, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
            [1e30, -1e30, 0.0, 88.0, -88.0, 100.0, 1e-30, 7.0, 8.0],
        ]
    )
    assert _equal(kernels.softmax(rows), mx.softmax(rows, axis=-1, precise=True))


_MASKS = ["none", "causal", "bool", "additive"]


@pytest.mark.parametrize("mask_kind", _MASKS)
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "queries", "keys"), [(8, 9, 3, 17, 17), (16, 9, 3, 1, 140), (1, 4, 4, 5, 12), (2, 6, 2, 3, 9)])
def test_attention_is_mlxs_cpu_attention(kernels, mask_kind, rows, heads, kv_heads, queries, keys):
    key = mx.random.key(rows * 100 + queries)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    # (queries as the models make them: a transposed view)
    q = mx.random.normal((rows, queries, heads, 32), key=k1).swapaxes(1, 2)
    k, v = mx.random.normal((rows, kv_heads, keys, 32), key=k2), mx.random.normal((rows, kv_heads, keys, 32), key=k3)
    mask: str | mx.array | None = {"none": None, "causal": "causal"}.get(mask_kind)
    if mask_kind == "bool":
        mask = mx.random.uniform(shape=(rows, 1, queries, keys), key=k4) > 0.3
    elif mask_kind == "additive":
        mask = mx.random.normal((queries, keys), key=k4)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.17, mask=mask)
    if isinstance(mask, mx.array):
        got = kernels.scaled_dot_product_attention(q, k, v, scale=0.17, mask=mask)
    else:
        got = kernels.scaled_dot_product_attention(q, k, v, scale=0.17, mask_mode=mask or "")
    assert _equal(got, expected)


def test_bad_input_is_a_typed_error(kernels):
    half = mx.ones((2, 8), dtype=mx.float16)
    with pytest.raises(ValueError, match="float32"):
        kernels.swiglu(half, half)
    with pytest.raises(ValueError, match="one shape"):
        kernels.swiglu(mx.ones((2, 8)), mx.ones((2, 9)))
    with pytest.raises(ValueError, match="float32"):
        kernels.softmax(half)


def test_only_the_engines_step_uses_them_and_only_for_float32(kernels):
    gate = mx.ones((4, 16))
    assert lanes.kernels(gate) is None  # outside a step: mlx-lm's own code
    with lanes.parallel():
        assert lanes.kernels(gate) is kernels
        assert lanes.kernels(gate.astype(mx.bfloat16)) is None
        with lanes.suspended():  # (a compiled step's trace: one stream, the kernels stay)
            assert lanes.kernels(gate) is kernels
    with lanes.parallel(False):
        assert lanes.kernels(gate) is None


def test_off_where_told(monkeypatch):
    monkeypatch.setattr(native, "_loaded", native._UNSET)
    monkeypatch.setenv("MLXRT_NATIVE", "0")
    assert native.load() is None and native.loaded() is None


def test_an_engines_tokens_with_them_are_mlx_lms(kernels, monkeypatch):
    """Three requests batched on `builtin:tiny`, every SwiGLU, softmax and attention of the step
    through the kernels (counted): the greedy tokens are mlx-lm's."""
    from types import SimpleNamespace

    from tests.support.engine_driver import Driver, admit_request, random_prompts
    from tests.support.mlx_reference import greedy_tokens, load_reference

    calls: dict[str, int] = {}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return getattr(kernels, name)(*args, **kwargs)

        return call

    names = ("swiglu", "softmax", "scaled_dot_product_attention", "rms_norm", "rope", "paged_attention", "decode_attention", "pool_write")
    proxy = SimpleNamespace(**{name: counted(name) for name in names})
    model, tokenizer = load_reference("builtin:tiny")
    engine = Engine(model, probe_layout(model))
    monkeypatch.setattr(native, "_loaded", proxy)
    prompts = random_prompts([9, 14, 5])
    driver = Driver(engine)
    driver.admit(*(admit_request(name, prompt, max_tokens=8) for name, prompt in zip("abc", prompts)))
    driver.run()
    assert (
        calls.get("swiglu", 0) > 0
        and calls.get("rms_norm", 0) > 0
        and calls.get("rope", 0) > 0
        and calls.get("softmax", 0) + calls.get("scaled_dot_product_attention", 0) > 0
    ), calls
    for name, prompt in zip("abc", prompts):
        assert driver.tokens[name] == greedy_tokens(model, tokenizer, prompt, 8)


def test_a_paged_batchs_tokens_through_the_kernel_are_mlx_lms(kernels, monkeypatch):
    """Four requests of mixed lengths batched in blocks of 4 on `builtin:tiny` (llama): every
    decode step's attention through the kernels (counted: each row over its own positions, the
    compiled step's RoPEs, pool writes and attention as one primitive a layer); the greedy tokens
    are mlx-lm's."""
    from types import SimpleNamespace

    from policies.layout import with_kv_blocks
    from tests.support.engine_driver import Driver, admit_request, random_prompts
    from tests.support.mlx_reference import greedy_tokens, load_reference

    calls: list[int] = []
    fused: list[int] = []

    def paged_attention(queries, *args, **kwargs):
        calls.append(queries.shape[0])
        return kernels.paged_attention(queries, *args, **kwargs)

    def decode_attention(queries, *args, **kwargs):
        fused.append(queries.shape[0])
        return kernels.decode_attention(queries, *args, **kwargs)

    names = ("swiglu", "softmax", "scaled_dot_product_attention", "rms_norm", "rope", "pool_write")
    proxy = SimpleNamespace(paged_attention=paged_attention, decode_attention=decode_attention, **{name: getattr(kernels, name) for name in names})
    model, tokenizer = load_reference("builtin:tiny")
    engine = Engine(model, with_kv_blocks(probe_layout(model), 4))
    monkeypatch.setattr(native, "_loaded", proxy)
    monkeypatch.setattr(lanes, "MIN_ELEMENTS", 1)
    prompts = random_prompts([9, 14, 5, 30])
    driver = Driver(engine)
    driver.admit(*(admit_request(name, prompt, max_tokens=10) for name, prompt in zip("abcd", prompts)))
    driver.run()
    # The compiled step's attention (traced once per batch geometry) as one primitive a layer.
    assert not calls and {4, 3, 2, 1} <= set(fused), (calls, fused)
    for name, prompt in zip("abcd", prompts):
        assert driver.tokens[name] == greedy_tokens(model, tokenizer, prompt, 10)


def _recorded_run(monkeypatch, model, block_size: int, *, fused: bool) -> tuple[dict, dict]:
    """Four requests of mixed lengths (rows joining and leaving) greedily on `model` in paged
    blocks of `block_size`, with logprobs and three top alternatives; `fused=False`: the compiled
    step built node by node (`engine.compiled`'s fusions off). Returns the tokens and, per
    request, each token's (id, logprob, top alternatives)."""
    import contextlib

    from engine import compiled
    from policies.layout import with_kv_blocks
    from tests.support.engine_driver import Driver, admit_request, random_prompts

    prompts = random_prompts([9, 14, 5, 30])
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(compiled, "_fused_attention", lambda model, caches: contextlib.nullcontext())
        engine = Engine(model, with_kv_blocks(probe_layout(model), block_size))
        seen: dict[str, list] = {}
        driver = Driver(engine)
        original = driver.step

        def step(plan):
            outcome = original(plan)
            for row in outcome.outputs:
                seen.setdefault(row.request_id, []).extend((p.token_id, p.logprob, [(a.token_id, a.logprob) for a in p.top or []]) for p in row.logprobs or [])
            return outcome

        driver.step = step
        driver.admit(
            *(admit_request(name, prompt, max_tokens=12 - 2 * i, logprobs=True, top_logprobs=3) for i, (name, prompt) in enumerate(zip("abcd", prompts)))
        )
        driver.run()
        return driver.tokens, seen


def _family(family: str):
    from mlx_lm.utils import load

    from runtime import env
    from tests.support.families import build

    model, _ = load(str(build(family, env.home())))
    model.set_dtype(mx.float32)
    return model


@pytest.mark.parametrize(("family", "block_size"), [("llama", 4), ("llama", 16), ("qwen2", 16)])
def test_a_llama_layers_fused_decode_attention_gives_the_same_bits(kernels, monkeypatch, family, block_size):
    """The compiled step's llama (and qwen2) attention as three primitives a layer
    (`engine.compiled`'s `_FusedAttention`) against the same step built from its ~18 nodes: the
    same tokens and the same logprobs, bit for bit, alone and batched (rows joining and leaving)."""
    model = _family(family)
    calls: list[int] = []
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k), raising=False)
    fused_tokens, fused_logprobs = _recorded_run(monkeypatch, model, block_size, fused=True)
    assert calls, "the fused attention was not traced"
    tokens, logprobs = _recorded_run(monkeypatch, model, block_size, fused=False)
    assert fused_tokens == tokens and fused_logprobs == logprobs
    assert [len(logprobs[name]) for name in "abcd"] == [len(tokens[name]) for name in "abcd"] == [12, 10, 8, 6], (logprobs, tokens)


@pytest.mark.parametrize(
    ("family", "bits", "group", "block_size", "symmetric"),
    [("llama", 4, 32, 4, False), ("llama", 8, 64, 16, False), ("qwen2", 4, 32, 16, False), ("llama", 8, 32, 4, True)],
)
def test_a_quantized_llama_layer_fused_whole_gives_the_same_bits(kernels, monkeypatch, family, bits, group, block_size, symmetric):
    """The compiled step's quantized llama (and qwen2: biased queries, keys and values) decoder
    layer as four primitives (`normed_products`, two `pool_write`s, `layer_tail`) against the same
    step built node by node with the same kernels: the same tokens and logprobs with their top
    alternatives, bit for bit, alone and batched (rows joining and leaving). `symmetric`: biases
    -2^(bits - 1) times the scales (GGUF's Q8_0), which both take from the scales (`bias_ratio`)."""
    import mlx.nn as nn

    from engine import lanes

    model = _family(family)
    nn.quantize(model, group_size=group, bits=bits)
    if symmetric:
        for _, layer in model.named_modules():
            if isinstance(layer, nn.QuantizedLinear | nn.QuantizedEmbedding):
                layer.biases = layer.scales * -float(2 ** (bits - 1))
    calls: list[str] = []
    for name in ("normed_products", "layer_tail"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _name=name, _real=real, **k: calls.append(_name) or _real(*a, **k), raising=False)
    fused_tokens, fused_logprobs = _recorded_run(monkeypatch, model, block_size, fused=True)
    layers = len(model.layers)
    assert calls.count("normed_products") >= layers and calls.count("layer_tail") >= layers, calls
    calls.clear()
    tokens, logprobs = _recorded_run(monkeypatch, model, block_size, fused=False)
    assert not calls
    assert fused_tokens == tokens and fused_logprobs == logprobs
    assert [len(logprobs[name]) for name in "abcd"] == [len(tokens[name]) for name in "abcd"] == [12, 10, 8, 6], (logprobs, tokens)
    assert getattr(model.layers[0].self_attn.q_proj, lanes.BIAS_RATIO) == (-float(2 ** (bits - 1)) if symmetric else 0.0)


@pytest.mark.parametrize("shape", [(1, 1, 576), (16, 1, 576), (3, 127, 576), (2, 5, 7), (9, 64), (4, 1, 2, 33)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6, 0.5])
def test_rms_norm_as_mlxs(kernels, shape, eps):
    x = mx.random.normal(shape, key=mx.random.key(shape[-1])) * 4
    weight = mx.random.normal((shape[-1],), key=mx.random.key(7))
    assert _equal(kernels.rms_norm(x, weight, eps), mx.fast.rms_norm(x, weight, eps))
    assert _equal(kernels.rms_norm(x.swapaxes(0, -2), weight, eps), mx.fast.rms_norm(x.swapaxes(0, -2), weight, eps))


def test_rms_norm_rows_of_zeros_extremes_and_nan(kernels):
    rows = _array([[0.0] * 9, [1e30, -1e30] + [0.0] * 7, [1e-30] * 9, [np.inf] + [1.0] * 8, [np.nan] + [1.0] * 8, _specials()[:9]])
    weight = _array(np.linspace(-2, 2, 9))
    assert _equal(kernels.rms_norm(rows, weight, 1e-5), mx.fast.rms_norm(rows, weight, 1e-5))
    with pytest.raises(ValueError, match="vector"):
        kernels.rms_norm(rows, mx.ones((8,)), 1e-5)


def test_the_models_norms_use_it_only_inside_the_step(kernels):
    import mlx.nn as nn

    layer = nn.RMSNorm(64)
    layer.weight = mx.random.normal((64,), key=mx.random.key(3))
    model = nn.Sequential(layer)
    lanes.install(model)
    assert type(layer) is lanes.KernelRMSNorm
    x = mx.random.normal((4, 64), key=mx.random.key(4))
    calls = []
    original = lanes.kernels

    def spy(*arrays):
        module = original(*arrays)
        calls.append(module is not None)
        return module

    lanes.kernels = spy  # type: ignore[assignment]
    try:
        outside = layer(x)
        with lanes.parallel():
            inside = layer(x)
    finally:
        lanes.kernels = original  # type: ignore[assignment]
    assert calls == [False, True]
    assert _equal(inside, outside) and _equal(outside, mx.fast.rms_norm(x, layer.weight, layer.eps))


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(
    ("shape", "dims", "base", "scale", "offset"),
    [
        ((16, 9, 1, 64), 64, 10000.0, 1.0, list(range(100, 1700, 100))),
        ((2, 3, 17, 64), 64, 100000.0, 1.0, 5),
        ((1, 4, 33, 32), 16, 500000.0, 0.25, 0),
        ((3, 11, 24), 24, 10000.0, 1.0, [7, 0, 12000]),
        ((2, 2, 3, 2, 8), 8, 10000.0, 2.0, 3),
        ((2, 2, 5, 16), 16, 10000.0, 1.0, [9_000_000, 1]),  # (angles past 2^23: libm's sine and cosine)
    ],
)
def test_rope_as_mlxs(kernels, traditional, shape, dims, base, scale, offset):
    x = mx.random.normal(shape, key=mx.random.key(dims)) * 3
    positions = mx.array(offset, dtype=mx.int32)
    expected = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=positions)
    assert _equal(kernels.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=positions), expected)
    if isinstance(offset, int):
        assert _equal(mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset), expected)


def test_rope_on_a_transposed_view_and_bad_offsets(kernels):
    x = mx.random.normal((2, 7, 4, 64), key=mx.random.key(9)).swapaxes(1, 2)  # ([rows, heads, tokens, dim] as models make it)
    positions = mx.array([3, 40], dtype=mx.int32)
    assert _equal(
        kernels.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=positions),
        mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=positions),
    )
    with pytest.raises(ValueError, match="offset"):
        kernels.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=mx.array([1, 2, 3]))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "one"])
@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "width", "block_size"), [(16, 9, 3, 140, 16), (3, 8, 2, 37, 4), (1, 4, 1, 16, 16), (2, 9, 3, 2100, 16)])
def test_paged_attention_is_decode_attention_over_the_gathered_blocks(kernels, mask_kind, layout, rows, heads, kv_heads, width, block_size):
    """Rows whose blocks are scattered (copied into a scratch run) or run contiguously (read in
    place, the first row's run one block short of the pool's end; the last row's run breaks
    after its first block, so it is copied), and rows wide enough for OpenBLAS to thread their
    products."""
    from engine.kv.attention import decode_attention
    from engine.kv.paged import gather_blocks

    per_row = -(-width // block_size) + 1  # (a spare block past the width, as a row may hold)
    dim, pool_blocks = 64, rows * per_row + 8
    k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(rows + width), 5)
    pool_keys = mx.random.normal((kv_heads, pool_blocks * block_size, dim), key=k1)
    pool_values = mx.random.normal((kv_heads, pool_blocks * block_size, dim), key=k2)
    if layout == "scattered":
        blocks = mx.random.permutation(pool_blocks, key=k3)[: rows * per_row].astype(mx.int32)
    else:
        runs = [pool_blocks - (r + 1) * per_row for r in range(rows)]
        table = [b for first in runs for b in range(first, first + per_row)]
        if rows > 1:
            table[(rows - 1) * per_row + 1] = 0  # (the last row's second block elsewhere)
        blocks = mx.array(table, dtype=mx.int32)
    queries = mx.random.normal((rows, heads, 1, dim), key=k4)
    mask = {
        "none": None,
        "bool": mx.random.uniform(shape=(rows, 1, 1, width), key=k5) > 0.2,
        "additive": mx.random.normal((rows, 1, 1, width), key=k5),
        "one": mx.random.uniform(shape=(1, 1, 1, width), key=k5) > 0.2,
    }[mask_kind]
    keys, values = gather_blocks(pool_keys, blocks, rows, width, block_size), gather_blocks(pool_values, blocks, rows, width, block_size)
    expected = decode_attention(queries, keys, values, 0.125, mask)
    assert expected is not None
    stacked = (mx.array(0.125, mx.float32) * queries).reshape(rows, kv_heads, heads // kv_heads, dim)
    got = kernels.paged_attention(stacked, pool_keys, pool_values, blocks, width=width, block_size=block_size, mask=mask).reshape(rows, heads, 1, -1)
    assert _equal(got, expected)
    with pytest.raises(ValueError, match="paged attention"):
        kernels.paged_attention(stacked, pool_keys, pool_values, blocks, width=per_row * block_size + 1, block_size=block_size)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (12, 1, 32), (16, 1, 64), (6, 2, 128), (4, 2, 32)])
@pytest.mark.parametrize("width", [1, 17, 400, 401, 530, 1100, 5300])
@pytest.mark.parametrize("block_size", [16, 4])
def test_paged_attention_own_products_are_openblas_bit_for_bit(kernels, heads, kv_heads, dim, width, block_size):
    """Where the kernel computes a step's scores and values itself (wide rows: OpenBLAS's packing
    path for the scores, its small-matrix kernel for the values), each result is the same bits as
    with every product `cblas_sgemm`'s, across the widths where OpenBLAS changes path (a query
    group's scores at 1,200 entries, the values at 10^6 multiply-adds), and with the rows shared
    with the helper thread, from blocks scattered in the pool (read where they are, sixteen positions
    of a block or four). With OpenBLAS and AVX-512 (this project's machines) the kernels are on; on
    AVX2 (OpenBLAS's Haswell and Zen kernels) for one to three query heads per KV head, where the
    kernel's check finds OpenBLAS's order (`attention_chains_cover`)."""
    from runtime import blas

    rows = 2
    per_row = -(-width // block_size)
    pool_blocks = rows * per_row + 2
    k1, k2, k3, k4 = mx.random.split(mx.random.key(width * dim), 4)
    pool_keys = mx.random.normal((kv_heads, pool_blocks * block_size, dim), key=k1)
    pool_values = mx.random.normal((kv_heads, pool_blocks * block_size, dim), key=k2)
    blocks = mx.random.permutation(pool_blocks, key=k3)[: rows * per_row].astype(mx.int32)
    stacked = mx.random.normal((rows, kv_heads, heads // kv_heads, dim), key=k4) * 0.2
    lengths = mx.array([width, max(1, width - 13)], dtype=mx.int32)

    def attend(chains: bool) -> tuple[mx.array, mx.array]:
        kernels.set_attention_chains(chains)
        whole = kernels.paged_attention(stacked, pool_keys, pool_values, blocks, width=width, block_size=block_size)
        ragged = kernels.paged_attention(stacked, pool_keys, pool_values, blocks, width=width, block_size=block_size, lengths=lengths)
        mx.eval(whole, ragged)
        return whole, ragged

    try:
        blas_only = attend(False)
        own = attend(True)
        on = kernels.set_attention_chains(True)
    finally:
        kernels.set_attention_chains(True)
    assert all(_equal(a, b) for a, b in zip(own, blas_only))
    if kernels.quantized_isa() == "avx512" and blas.status().state == "loaded":
        assert on
    scores, values, threaded_values = kernels.attention_chains_cover(heads // kv_heads, dim)
    if kernels.quantized_isa() == "avx2":
        assert on == kernels.attention_chains_cover(3, 64)[0]
        if heads // kv_heads > 3:  # (other kernels of OpenBLAS's: never claimed)
            assert not (scores or values or threaded_values)


@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize(("rows", "width", "block_size"), [(5, 140, 16), (3, 37, 4), (2, 2100, 16)])
def test_paged_attention_with_lengths_is_decode_attention_over_each_row_alone(kernels, layout, rows, width, block_size):
    """Rows of mixed lengths (the step's mask says only where each ends): each row attends over
    its own first `lengths[r]` positions, bit for bit `decode_attention` over that row alone
    (`PagedSlots._attend_rows`), the padded positions never read."""
    from engine.kv.attention import decode_attention
    from engine.kv.paged import gather_blocks

    heads, kv_heads, dim = 9, 3, 64
    per_row = -(-width // block_size)
    pool_blocks = rows * per_row + 4
    k1, k2, k3, k4 = mx.random.split(mx.random.key(width), 4)
    pool_keys = mx.random.normal((kv_heads, pool_blocks * block_size, dim), key=k1)
    pool_values = mx.random.normal((kv_heads, pool_blocks * block_size, dim), key=k2)
    if layout == "scattered":
        blocks = mx.random.permutation(pool_blocks, key=k3)[: rows * per_row].astype(mx.int32)
    else:
        blocks = mx.arange(rows * per_row, dtype=mx.int32)
    lengths = [width - (r * 997) % width for r in range(rows)]  # (the first row the full width)
    queries = mx.random.normal((rows, heads, 1, dim), key=k4)
    stacked = (mx.array(0.125, mx.float32) * queries).reshape(rows, kv_heads, heads // kv_heads, dim)
    got = kernels.paged_attention(
        stacked, pool_keys, pool_values, blocks, width=width, block_size=block_size, lengths=mx.array(lengths, dtype=mx.int32)
    ).reshape(rows, heads, 1, -1)
    for r, n in enumerate(lengths):
        own = blocks[r * per_row : (r + 1) * per_row]
        keys, values = gather_blocks(pool_keys, own, 1, n, block_size), gather_blocks(pool_values, own, 1, n, block_size)
        expected = decode_attention(queries[r : r + 1], keys, values, 0.125, None)
        assert expected is not None
        assert _equal(got[r : r + 1], expected), (r, n)
    with pytest.raises(ValueError, match="lengths"):
        kernels.paged_attention(stacked, pool_keys, pool_values, blocks, width=width, block_size=block_size, lengths=mx.array([1], dtype=mx.int32))


def test_a_failed_build_or_a_wrong_result_leaves_mlxs_ops(monkeypatch, tmp_path, kernels):
    """No compiler (here `CXX=false`): `load()` logs why and returns None, nothing raised; a
    module whose result differs from MLX's is refused by `check()`."""
    from types import SimpleNamespace

    monkeypatch.setattr(native, "_loaded", native._UNSET)
    monkeypatch.setattr(native, "build_dir", lambda fallback_dir=None: tmp_path / "build")
    monkeypatch.setenv("CXX", "false")
    assert native.load() is None and not (tmp_path / "build" / native._library_name()).exists()
    wrong = SimpleNamespace(swiglu=lambda gate, up: mx.zeros_like(gate))
    assert native.check(wrong) == "swiglu"
    off_by_one_ulp = SimpleNamespace(**{name: getattr(kernels, name) for name in ("swiglu", "rms_norm", "rope", "scaled_dot_product_attention")})
    off_by_one_ulp.softmax = lambda x: kernels.softmax(x) * mx.array(1.0000001, mx.float32)
    assert native.check(off_by_one_ulp) == "softmax"


def test_auto_block_size_is_paged_for_a_text_model_with_the_kernels_and_rows_elsewhere(kernels, monkeypatch):
    from types import SimpleNamespace

    from engine.model.loader import block_size
    from protocols.config import AUTO_BLOCK_SIZE, KvConfig

    text = SimpleNamespace(info=SimpleNamespace(denoising=False), model=object())
    diffusion = SimpleNamespace(info=SimpleNamespace(denoising=True), model=object())
    auto = KvConfig()
    assert auto.block_size == "auto"
    assert block_size(text, auto) == AUTO_BLOCK_SIZE  # type: ignore[arg-type]
    assert block_size(text, auto, sharded=True) == 0  # type: ignore[arg-type]
    assert block_size(diffusion, auto) == 0  # type: ignore[arg-type]
    assert block_size(text, KvConfig(block_size=0)) == 0 and block_size(text, KvConfig(block_size=64)) == 64  # type: ignore[arg-type]
    monkeypatch.setattr(native, "_loaded", None)
    assert block_size(text, auto) == 0  # type: ignore[arg-type]
