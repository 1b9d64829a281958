"""Two CPU lanes (`engine.lanes`): split pieces are bit for bit the unsplit ones. (With mlxrt's
CPU kernels off: where they are loaded the SwiGLU runs whole, tests/engine/native/test_native.py.)"""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx_lm.models import activations

from engine import lanes, native
from engine.kv.attention import decode_attention

_SWIGLU = activations.swiglu


def _normal(shape, seed: int, dtype=mx.float32) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


@pytest.fixture(autouse=True)
def mlx_ops_only(monkeypatch) -> None:
    monkeypatch.setattr(native, "_loaded", None)


@pytest.fixture
def splits(monkeypatch) -> list[int]:
    """Counts the pieces split (the size of the axis split) while a test runs."""
    seen: list[int] = []
    halves = lanes.halves

    def counted(fn, first, rest, axis):
        seen.append(axis)
        return halves(fn, first, rest, axis)

    monkeypatch.setattr(lanes, "halves", counted)
    return seen


@pytest.mark.parametrize("shape", [(8, 127, 1536), (16, 1, 1536), (3, 5, 4096), (1, 9, 1024)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_swiglu_split_by_tokens_is_mlx_lms_bit_for_bit(shape, dtype, splits):
    gate, x = _normal(shape, 1, dtype), _normal(shape, 2, dtype)
    with lanes.parallel():
        got = lanes.swiglu(gate, x)
    assert splits == [0]
    assert got.shape == shape and got.dtype == dtype
    assert mx.array_equal(got, _SWIGLU(gate, x)).item()


def test_small_pieces_and_calls_outside_a_step_are_not_split(splits):
    gate, x = _normal((1, 1, 1536), 1), _normal((1, 1, 1536), 2)
    with lanes.parallel():
        assert mx.array_equal(lanes.swiglu(gate, x), _SWIGLU(gate, x)).item()  # 1,536 elements
    big_gate, big_x = _normal((8, 64, 1536), 3), _normal((8, 64, 1536), 4)
    assert mx.array_equal(lanes.swiglu(big_gate, big_x), _SWIGLU(big_gate, big_x)).item()
    with lanes.parallel(), lanes.suspended():
        lanes.swiglu(big_gate, big_x)
    assert splits == []
    assert not lanes.enabled()


def test_the_switch_is_per_thread(splits):
    """Another thread (a baseline on its own MLX thread) sees mlx-lm's code while one steps."""
    seen: list[bool] = []
    with lanes.parallel():
        thread = threading.Thread(target=lambda: seen.append(lanes.enabled()))
        thread.start()
        thread.join()
        assert lanes.enabled()
    assert seen == [False]


def _masks(rows: int, heads: int, queries: int, positions: int, dtype):
    # Row r's query i sees the positions up to its own less r (left padding), and position 0.
    position = mx.arange(positions)[None, None, None, :]
    visible = (position <= (mx.arange(queries)[:, None] + positions - queries - mx.arange(rows)[:, None, None, None])) | (position == 0)
    return {
        "none": None,
        "causal": "causal",
        "bool": visible,
        "additive": mx.where(visible, 0.0, -1e9).astype(dtype),
        "per head": mx.broadcast_to(visible, (rows, heads, queries, positions)),
    }


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "queries", "positions"), [(4, 9, 3, 33, 40), (3, 8, 8, 24, 24), (1, 9, 3, 48, 80), (1, 8, 2, 40, 40)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_prefill_attention_split_by_rows_or_kv_heads_is_mlxs_bit_for_bit(rows, heads, kv_heads, queries, positions, dtype, splits):
    """Rows split in two where there are several, a lone row's KV heads (with their query
    heads) otherwise; every kind of mask the models pass."""
    q = _normal((rows, heads, queries, 64), 1, dtype)
    k, v = _normal((rows, kv_heads, positions, 64), 2, dtype), _normal((rows, kv_heads, positions, 64), 3, dtype)
    for name, mask in _masks(rows, heads, queries, positions, dtype).items():
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        with lanes.parallel():
            got = lanes.attention(q, k, v, 0.125, mask)
        assert got is not None, name
        assert mx.array_equal(got, expected).item(), name
    assert splits == [0 if rows > 1 else 1] * 5


@pytest.mark.parametrize(("rows", "positions"), [(16, 190), (5, 700), (1, 700), (4, 4096)])
def test_decode_attention_split_is_the_unsplit_bit_for_bit(rows, positions, splits):
    """Rows split in two; a lone row, and rows whose products OpenBLAS threads (3 query heads
    x 4,096 positions x 64), are not split (`lanes.THREADED_PRODUCT`)."""
    q = _normal((rows, 9, 1, 64), 1)
    k, v = _normal((rows, 3, positions, 64), 2), _normal((rows, 3, positions, 64), 3)
    mask = mx.arange(positions)[None, None, None, :] < (positions - mx.arange(rows))[:, None, None, None]
    for m in (None, mask):
        expected = decode_attention(q, k, v, 0.125, m)
        with lanes.parallel():
            got = decode_attention(q, k, v, 0.125, m)
        assert got is not None and expected is not None
        assert mx.array_equal(got, expected).item()
    assert splits == ([0] * 2 if rows > 1 and positions < 4096 else [])


@pytest.mark.parametrize("rows", [4, 1])
def test_a_mask_of_fewer_dimensions_aligns_to_the_right(rows, splits):
    """A `[queries, keys]` mask whose query count equals the rows (or heads) is not split
    along them: it broadcasts over both."""
    q = _normal((rows, 4, 4, 64), 1)
    k, v = _normal((rows, 4, 1000, 64), 2), _normal((rows, 4, 1000, 64), 3)
    mask = mx.arange(1000)[None, :] <= mx.array([996, 997, 998, 999])[:, None]  # [4, 1000]
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    with lanes.parallel():
        got = lanes.attention(q, k, v, 0.125, mask)
    assert got is not None and mx.array_equal(got, expected).item()
    assert splits == [0 if rows > 1 else 1]


@pytest.mark.parametrize(("rows", "queries", "positions", "split"), [(8, 127, 127, False), (1, 256, 256, False), (1, 512, 2048, True), (2, 64, 64, True)])
def test_prefill_halves_whose_products_openblas_threads_are_split_only_when_large(rows, queries, positions, split, splits):
    """Products over `THREADED_PRODUCT` (m x n x k: a row's queries x positions x 64) and under
    `LARGE_PRODUCT` stay whole; the result is the same either way."""
    q = _normal((rows, 9, queries, 64), 1)
    k, v = _normal((rows, 3, positions, 64), 2), _normal((rows, 3, positions, 64), 3)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    with lanes.parallel():
        got = lanes.attention(q, k, v, 0.125, "causal")
    assert (got is not None) == split and len(splits) == split
    assert mx.array_equal(got if got is not None else lanes.sdpa(q, k, v, 0.125, "causal"), expected).item()


def test_what_cannot_be_split_is_left_to_the_caller():
    q = _normal((1, 4, 64, 64), 1)
    k, v = _normal((1, 1, 64, 64), 2), _normal((1, 1, 64, 64), 3)  # one row, one KV head
    with lanes.parallel():
        assert lanes.attention(q, k, v, 0.125, "causal") is None
        assert lanes.attention(q, (k, k, k), (v, v, v), 0.125, None) is None  # quantized keys
    assert lanes.attention(_normal((4, 4, 64, 64), 1), _normal((4, 4, 64, 64), 2), _normal((4, 4, 64, 64), 3), 0.125, None) is None  # outside a step


def test_install_rebinds_the_models_modules_only():
    from mlx_lm.models import llama

    from tests.support.mlx_reference import load_reference

    model, _ = load_reference("builtin:tiny")
    assert "mlx_lm.models.llama" in lanes.install(model) or llama.swiglu is lanes.swiglu
    assert llama.swiglu is lanes.swiglu
    assert activations.swiglu is _SWIGLU  # mlx-lm's own function, for everyone else


def test_install_leaves_the_module_that_defines_a_function_alone():
    """gpt-oss has a module class of `mlx_lm.models.activations` (`SwigluOAI`), the module that
    defines `swiglu`: installing it rebinds its own module's name, never mlx-lm's for everyone."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from runtime import env
    from tests.support.families import build

    model, _ = load(str(build("gpt_oss", env.home())))
    assert any(type(m).__module__ == activations.__name__ for _, m in model.named_modules()) and tree_flatten(model.parameters())
    rebound = lanes.install(model)
    assert activations.__name__ not in rebound and activations.swiglu is _SWIGLU


def _assert_greedy_tokens_are_mlx_lms(block_size: int, max_tokens: int, compiled: bool = True) -> None:
    """Three requests batched on `builtin:tiny` (KV in blocks of `block_size`, or rows): the
    engine's greedy tokens are mlx-lm's (`compiled`: the engine's compiled decode step)."""
    from engine.engine import Engine
    from engine.kv.layout import probe_layout
    from policies.layout import with_kv_blocks
    from tests.support.engine_driver import Driver, admit_request, random_prompts
    from tests.support.mlx_reference import greedy_tokens, load_reference

    model, tokenizer = load_reference("builtin:tiny")
    layout = probe_layout(model)
    engine = Engine(model, with_kv_blocks(layout, block_size) if block_size else layout, compiled=compiled)
    prompts = random_prompts([9, 14, 5])
    driver = Driver(engine)
    driver.admit(*(admit_request(name, prompt, max_tokens=max_tokens) for name, prompt in zip("abc", prompts)))
    driver.run()
    for name, prompt in zip("abc", prompts):
        assert driver.tokens[name] == greedy_tokens(model, tokenizer, prompt, max_tokens)


def test_an_engines_tokens_with_every_piece_split_are_mlx_lms(monkeypatch, splits):
    """A batched prefill and decode steps with the thresholds at nothing: every swiglu and
    attention of the engine's forwards split, the same greedy tokens as mlx-lm's."""
    monkeypatch.setattr(lanes, "MIN_ELEMENTS", 1)
    _assert_greedy_tokens_are_mlx_lms(block_size=0, max_tokens=6)
    assert 0 in splits


def test_a_paged_batch_decodes_through_the_compiled_step_with_mlx_lms_tokens(monkeypatch):
    """Paged KV's batched decode steps run the compiled step (no graph built per step; each row
    attends over its own blocks in place); the tokens are mlx-lm's."""
    from engine.batch import DecodeBatch

    widths: list[int] = []
    forward_one = DecodeBatch.forward_one

    def counted(self, compiled, tokens):
        widths.append(len(self))
        return forward_one(self, compiled, tokens)

    monkeypatch.setattr(DecodeBatch, "forward_one", counted)
    _assert_greedy_tokens_are_mlx_lms(block_size=4, max_tokens=8)
    assert 3 in widths


def test_a_paged_batchs_halves_gather_and_attend_over_their_own_blocks(monkeypatch, splits):
    """Paged KV's decode steps built op by op (an engine without its compiled step, as in a
    distributed world) on two lanes: each half of the rows reads its own blocks (the batch's
    gathered copy is never evaluated); the tokens are mlx-lm's."""
    from engine.kv import paged

    halves_read: list[int] = []
    attend_halves = paged.PagedSlots._attend_halves

    def counted(self, step, blocks, queries, scale, mask):
        halves_read.append(step.num_rows)
        return attend_halves(self, step, blocks, queries, scale, mask)

    monkeypatch.setattr(paged.PagedSlots, "_attend_halves", counted)
    monkeypatch.setattr(lanes, "MIN_ELEMENTS", 1)
    _assert_greedy_tokens_are_mlx_lms(block_size=4, max_tokens=8, compiled=False)
    assert 3 in halves_read
