"""The engine driven directly with plans (no actors), on tiny built-in models of each layer
kind: full attention (`tiny`), sliding windows (`tiny-gemma3`), convolution state (`tiny-lfm2`),
gated-delta state with experts (`tiny-qwen3next`)."""

from __future__ import annotations

import pytest

from engine.engine import Engine, EngineInvariantError
from engine.kv.layout import probe_layout
from policies.layout import with_kv_blocks
from protocols.model import PrefillWork, StepPlan
from tests.support.batches import op_step, slot_batch
from tests.support.engine_driver import Driver, admit_request, random_prompts
from tests.support.mlx_reference import greedy_ids, greedy_tokens, load_reference

# "-paged": the model's float full-attention layers in a block pool (`kv.block_size`). Full,
# paged, sliding and convolution-state layers stay in `make test-fast`; paged windows and
# gated-delta state with experts are slow-marked.
SLOW = pytest.mark.slow


@pytest.fixture(
    scope="module",
    params=["tiny", "tiny-paged", "tiny-gemma3", pytest.param("tiny-gemma3-paged", marks=SLOW), "tiny-lfm2-paged", pytest.param("tiny-qwen3next", marks=SLOW)],
)
def model_and_tokenizer(request):
    return load_reference(f"builtin:{request.param.removesuffix('-paged')}")


@pytest.fixture
def block_size(request) -> int:
    return 16 if request.node.callspec.params["model_and_tokenizer"].endswith("-paged") else 0


@pytest.fixture
def engine(model_and_tokenizer, block_size):
    model, _ = model_and_tokenizer
    layout = probe_layout(model)
    return Engine(model, with_kv_blocks(layout, block_size) if block_size else layout)


def _run_and_check_parity(engine, model_and_tokenizer) -> tuple[Driver, list[list[int]]]:
    """Seven prompts of several lengths (none meets an end token) batched through `engine`,
    each stream equal to mlx-lm's greedy one; only their prefix entries remain."""
    prompts = random_prompts([1, 2, 7, 8, 9, 30, 17])
    driver = Driver(engine)
    driver.admit(*(admit_request(str(i), p) for i, p in enumerate(prompts)))
    driver.run()
    for i, p in enumerate(prompts):
        assert driver.tokens[str(i)] == greedy_tokens(*model_and_tokenizer, p, 12)
    driver.assert_only_prefixes_remain()
    return driver, prompts


def test_batched_engine_matches_mlx_lm(engine, model_and_tokenizer):
    driver, prompts = _run_and_check_parity(engine, model_and_tokenizer)
    # Each saved entry holds exactly the tokens whose KV it covers: prompt + fed tokens.
    for entry in driver.saved:
        i = int(entry.entry_id.split("#")[0])
        assert entry.tokens == (prompts[i] + driver.tokens[str(i)])[: len(entry.tokens)]
        assert len(prompts[i]) - 1 <= len(entry.tokens) <= len(prompts[i]) + 12


def test_the_warm_up_leaves_nothing_behind_and_changes_no_token(engine, model_and_tokenizer):
    model, _ = model_and_tokenizer
    assert engine.warm_up(model.args.vocab_size) > 0
    assert engine.kv_tokens() == {} and engine.kv_bytes() == 0, "no request and no prefix entry is left"
    _run_and_check_parity(engine, model_and_tokenizer)


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_release_frees_kv_and_leaves_others_unchanged(engine, model_and_tokenizer, when):
    prompts = random_prompts([40, 5, 11])
    driver = Driver(engine)
    driver.admit(*(admit_request(str(i), p, max_tokens=16) for i, p in enumerate(prompts)))
    victim = "0"
    for _ in range(3 if when == "prefill" else 8):
        driver.step(driver.plan())
    assert victim in engine.kv_tokens()
    assert (driver.left[victim] > 0) == (when == "prefill")
    outcome = driver.step(driver.plan(release=[victim]))
    assert outcome.released == [victim]
    assert victim not in outcome.kv_tokens
    driver.tokens.pop(victim)
    driver.run()
    for i in (1, 2):
        assert driver.tokens[str(i)] == greedy_tokens(*model_and_tokenizer, prompts[i], 16)
    driver.assert_only_prefixes_remain()


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_short_generations_finish_by_length(engine, model_and_tokenizer, max_tokens):
    prompt = random_prompts([6])[0]
    driver = Driver(engine)
    driver.admit(admit_request("a", prompt, max_tokens=max_tokens))
    driver.run()
    expected = greedy_tokens(*model_and_tokenizer, prompt, max_tokens)
    assert driver.tokens["a"] == expected
    assert driver.finish["a"] == ("length" if len(expected) == max_tokens else "stop")


def test_stop_token_ends_without_delivering_it(engine, model_and_tokenizer):
    prompt = random_prompts([9])[0]
    expected = greedy_tokens(*model_and_tokenizer, prompt, 12)
    stop = expected[3]
    driver = Driver(engine)
    driver.admit(admit_request("a", prompt, stop=[stop]))
    outcomes = []
    for _ in range(40):
        if "a" in driver.finish:
            break
        outcomes.append(driver.step(driver.plan()))
    assert driver.finish["a"] == "stop"
    assert driver.tokens["a"] == expected[: expected.index(stop)]
    final = next(row for o in outcomes for row in o.outputs if row.finish_reason)
    assert final.stop_token_id == stop and final.token_ids == []


def test_logprobs_are_reported_for_requests_that_ask(engine):
    prompts = random_prompts([5, 5])
    driver = Driver(engine)
    driver.admit(admit_request("with", prompts[0], max_tokens=4, logprobs=True, top_logprobs=2), admit_request("without", prompts[1], max_tokens=4))
    rows = []
    for _ in range(20):
        if len(driver.finish) == 2:
            break
        rows += driver.step(driver.plan()).outputs
    with_lp = [r for r in rows if r.request_id == "with" and r.token_ids]
    assert with_lp and all(r.logprobs and r.logprobs[0].logprob <= 0 and len(r.logprobs[0].top) == 2 for r in with_lp)
    assert all(r.logprobs[0].top[0].token_id == r.token_ids[0] for r in with_lp)
    assert all(r.logprobs is None for r in rows if r.request_id == "without")


def test_invariant_violations_raise(engine):
    engine.step(StepPlan(admit=[admit_request("a", [1, 2, 3])]))
    with pytest.raises(EngineInvariantError):
        engine.step(StepPlan(admit=[admit_request("a", [1, 2, 3])]))
    with pytest.raises(EngineInvariantError):
        engine.step(StepPlan(prefill=[PrefillWork(request_id="a", num_tokens=3)]))
    with pytest.raises(EngineInvariantError):
        engine.step(StepPlan(prefill=[PrefillWork(request_id="nobody", num_tokens=1)]))
    engine.reset()
    assert engine.kv_tokens() == {}


def test_engine_refuses_other_threads(engine):
    import threading

    errors = []

    def step_off_thread() -> None:
        with pytest.raises(EngineInvariantError) as info:
            engine.step(StepPlan())
        errors.append(info.value)

    thread = threading.Thread(target=step_off_thread)
    thread.start()
    thread.join()
    assert errors


def test_requests_seeded_from_one_prefix_never_change_it(engine, model_and_tokenizer):
    """Requests that start from one prefix entry write after it without touching it. A model
    whose caches can be cut back seeds from any prefix of an entry; the others only from a
    whole entry, which they keep at the end of every prompt."""
    import msgspec
    import numpy as np
    from mlx.utils import tree_flatten

    def arrays(entry_id: str) -> list:
        states = [c.state for c in engine._prefixes.caches_of(entry_id)]
        return [np.array(a) for _, a in tree_flatten(states) if a is not None]

    prompt = random_prompts([60])[0]
    driver = Driver(engine)
    driver.admit(admit_request("a", prompt, max_tokens=10))
    driver.run()
    if engine._trimmable:
        (entry,) = driver.saved
        seeds = (20, len(prompt) - 1)  # the shorter seed writes past position 20 first
    else:
        # At prefill's end, at the whole prompt (after the first token), and at release.
        assert sorted(len(e.tokens) for e in driver.saved)[:2] == [len(prompt) - 1, len(prompt)] and len(driver.saved) == 3
        (entry,) = [e for e in driver.saved if len(e.tokens) == len(prompt) - 1]
        seeds = (len(prompt) - 1, len(prompt) - 1)
    before = arrays(entry.entry_id)
    for i, n in enumerate(seeds):
        rid = f"b{i}"
        driver.admit(msgspec.structs.replace(admit_request(rid, prompt, max_tokens=10), prefix_entry=entry.entry_id, prefix_tokens=n))
        driver.left[rid] = len(prompt) - 1 - n
        driver.run()
        assert driver.tokens[rid] == driver.tokens["a"]
    after = arrays(entry.entry_id)
    assert len(before) == len(after) > 0 and all(np.array_equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("max_tokens", [1, 10])
def test_a_prompt_extending_another_seeds_from_its_whole_prompt_and_prefills_only_what_it_adds(engine, model_and_tokenizer, max_tokens):
    """An agent's next turn: its prompt is the last one plus new tokens (not what that one
    generated). The prefix lookup (whole entries where caches cannot be cut back) finds the
    entire first prompt, so only the new tokens are prefilled, and the tokens equal a cold run."""
    import msgspec

    from policies.prefix_index import PrefixIndex

    first, added = random_prompts([37, 13])
    driver = Driver(engine)
    driver.admit(admit_request("a", first, max_tokens=max_tokens))
    driver.run()
    index = PrefixIndex()
    for entry in driver.saved:
        index.insert(entry.entry_id, entry.tokens, entry.num_bytes, whole=not engine._trimmable)
    second = first + added
    match = index.lookup(second, len(second) - 1, whole=not engine._trimmable)
    assert match is not None and match.num_tokens == len(first)
    driver.admit(msgspec.structs.replace(admit_request("b", second, max_tokens=10), prefix_entry=match.entry_id, prefix_tokens=match.num_tokens))
    assert engine.kv_tokens()["b"] == len(first)
    driver.left["b"] = len(added) - 1  # the last prompt token is the first decode step's input
    driver.run()
    assert driver.tokens["b"] == greedy_ids(model_and_tokenizer[0], second, 10)
    driver.assert_only_prefixes_remain()


def test_a_parked_row_resumes_exactly_where_it_stopped(engine, model_and_tokenizer):
    # Rows past tiny-gemma3's 80-position rings (window 16 + margin) before and after the park.
    prompts = random_prompts([70, 95])
    driver = Driver(engine)
    driver.admit(admit_request("a", prompts[0], max_tokens=20), admit_request("b", prompts[1], max_tokens=20))
    while len(driver.tokens["a"]) < 4:
        driver.step(driver.plan())
    driver.step(StepPlan(park=["a"], decode=True))
    assert "a" not in engine._batch.row_ids and "a" in engine.kv_tokens()
    held = len(driver.tokens["a"])
    for _ in range(5):
        driver.step(driver.plan())
    assert len(driver.tokens["a"]) <= held + 1, "a parked row decodes at most its in-flight token"
    driver.step(StepPlan(unpark=["a"], decode=True))
    driver.run()
    for rid, prompt in zip("ab", prompts):
        assert driver.tokens[rid] == greedy_ids(model_and_tokenizer[0], prompt, 20)


def test_a_fill_append_leaves_the_cache_a_token_by_token_forward_builds(model_and_tokenizer):
    """Known tokens appended in one forward over some rows of a batch (the fast-forward
    path), then a whole-batch step, give the logits and greedy continuation of forwarding
    them one at a time."""
    import mlx.core as mx

    model, tokenizer = model_and_tokenizer
    geometry = probe_layout(model)
    prompt, bystander = tokenizer.encode("def f(x):\n    return"), tokenizer.encode("import os\nprint(os.sep)")
    span = tokenizer.encode(' {"name": "get_weather", "arguments": {')

    one_by_one = slot_batch(model, geometry, [prompt])
    for token in [prompt[-1], *span[:-1]]:
        op_step(model, one_by_one, [token])
    expected = op_step(model, one_by_one, [span[-1]])[0]

    appended = slot_batch(model, geometry, [prompt, bystander])
    appended.begin_step([len(span)], rows=[0])
    model(mx.array([[prompt[-1], *span[:-1]]], dtype=mx.uint32), cache=appended.layers)
    appended.end_step()
    fused = op_step(model, appended, [span[-1], bystander[-1]])
    assert appended.lengths[0] == one_by_one.lengths[0] == len(prompt) + len(span)
    assert mx.allclose(fused[0], expected, atol=1e-4).item()
    a, b = fused, expected[None]
    for _ in range(8):
        ta, tb = mx.argmax(a, axis=-1).tolist(), mx.argmax(b, axis=-1).tolist()
        assert ta[0] == tb[0]
        a, b = op_step(model, appended, ta), op_step(model, one_by_one, tb)


def test_a_rewound_tail_is_forgotten(model_and_tokenizer):
    """Rejected verify positions: after a rewind (and, for recurrent layers, a restore of the
    state from before them) the row decodes as if they were never written."""
    import mlx.core as mx

    model, tokenizer = model_and_tokenizer
    geometry = probe_layout(model)
    prompt = tokenizer.encode("class A:\n    pass")
    clean = slot_batch(model, geometry, [prompt])
    expected = op_step(model, clean, [prompt[-1]])
    dirty = slot_batch(model, geometry, [prompt])
    saved = dirty.snapshot("r0")
    dirty.begin_step([5], rows=[0])
    model(mx.array([[prompt[-1], 11, 12, 13, 14]], dtype=mx.uint32), cache=dirty.layers)
    dirty.end_step()
    dirty.restore("r0", saved)
    dirty.rewind("r0", 5)
    assert mx.allclose(op_step(model, dirty, [prompt[-1]]), expected, atol=1e-5).item()
    with pytest.raises(ValueError):
        dirty.rewind("r0", 10_000)


def test_the_compiled_one_token_step_matches_the_op_by_op_step(model_and_tokenizer):
    """Same logits and greedy tokens, rows at different positions, across a capacity growth
    (and, on tiny-gemma3, around its 80-slot rings)."""
    import mlx.core as mx

    from engine.compiled import compile_decode_step
    from engine.step import LEN_STEP

    model, tokenizer = model_and_tokenizer
    geometry = probe_layout(model)
    prompts = [tokenizer.encode("x = 1\n" * 400)[: LEN_STEP - 6], tokenizer.encode("def g():\n    pass")]
    compiled_step = compile_decode_step(model, geometry)
    traced, built = slot_batch(model, geometry, prompts), slot_batch(model, geometry, prompts)
    tokens = [p[-1] for p in prompts]
    for _ in range(12):  # the first row crosses the first capacity boundary
        a = traced.forward_one(compiled_step, mx.array(tokens, dtype=mx.uint32))
        b = op_step(model, built, tokens)
        assert mx.allclose(a, b, atol=1e-4).item()
        tokens = mx.argmax(a, axis=-1).tolist()
        assert tokens == mx.argmax(b, axis=-1).tolist()
    assert traced.lengths == built.lengths and traced.capacity[1] > LEN_STEP
