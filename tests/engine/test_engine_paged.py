"""The engine's paged decode: the compiled step over paged layers against the op-by-op step (with
mlxrt's kernel and without), retraces that compile no new kernel, rows appending unequal counts,
admission failures that give back every block, and a run that grows the pool to stay one run."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.kv.layout import probe_layout
from policies.layout import with_kv_blocks
from protocols.model import StepPlan
from tests.support.batches import op_step, paged_batch, slot_batch
from tests.support.engine_driver import Driver, admit_request, random_prompts
from tests.support.mlx_reference import greedy_tokens, load_reference


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "mlx-ops"])
@pytest.mark.parametrize("name,rows", [("tiny", 1), ("tiny", 2), ("tiny-gemma3", 1), ("tiny-lfm2", 1)])
def test_the_compiled_step_over_paged_layers_matches_the_op_by_op_step(name, rows, kernels, monkeypatch):
    """A paged batch's compiled one-token step (its pools written in place, each row reading
    its own scattered blocks; with mlxrt's paged kernel or over a gathered copy): the logits
    and greedy tokens of the op-by-op paged step, across a pool growth and the growth of the
    attended blocks past `MIN_TRACED_BLOCKS`; traced once per such geometry, not per step."""
    import mlx.core as mx

    from engine import compiled, lanes, native
    from engine.batch import MIN_TRACED_BLOCKS
    from engine.compiled import compile_decode_step

    if kernels and native.load() is None:
        pytest.skip("mlxrt's CPU kernels are not built on this machine")
    traces: list[int] = []

    class Counted(compiled._Masks):
        def __init__(self, *args):
            traces.append(1)
            super().__init__(*args)

    monkeypatch.setattr(compiled, "_Masks", Counted)
    model, _ = load_reference(f"builtin:{name}")
    layout = with_kv_blocks(probe_layout(model), 4)
    edge = MIN_TRACED_BLOCKS * 4  # the positions the first traced width holds
    prompts = random_prompts([edge - 5, 9][:rows])
    step = compile_decode_step(model, layout)
    traced, built = paged_batch(model, layout, prompts), paged_batch(model, layout, prompts)
    tokens = [p[-1] for p in prompts]
    with lanes.parallel(kernels):
        for i in range(12):
            if i == 3:  # (the first row attends past `edge` from step 6)
                for batch in (traced, built):
                    assert batch.pool is not None
                    batch.pool.allocate(batch.pool.allocator.num_free + 1)  # (the pool grows)
            a = traced.forward_one(step, mx.array(tokens, dtype=mx.uint32))
            b = op_step(model, built, tokens)
            assert mx.allclose(a, b, atol=1e-4).item()
            tokens = mx.argmax(a, axis=-1).tolist()
            assert tokens == mx.argmax(b, axis=-1).tolist()
    assert traced.lengths == built.lengths and max(traced.lengths) > edge
    assert len(traces) == 3  # the first geometry, the grown pool, the wider blocks


_RETRACE_SCRIPT = """
import json, pathlib, sys
import runtime  # noqa: F401
import mlx.core as mx
from engine import lanes, native
from engine.batch import MIN_TRACED_BLOCKS
from engine.compiled import compile_decode_step
from engine.kv.layout import probe_layout
from policies.layout import with_kv_blocks
from tests.support.batches import paged_batch
from tests.support.engine_driver import random_prompts
from tests.support.mlx_reference import load_reference

kernels = lambda: sorted(p.name for p in pathlib.Path(sys.argv[1]).rglob("*.so"))
model, _ = load_reference("builtin:tiny")
layout = with_kv_blocks(probe_layout(model), 4)
seen = []
with lanes.parallel(native.load() is not None):
    for rows in (1, 2):
        prompts = random_prompts([MIN_TRACED_BLOCKS * 4 - 2, 9][:rows])
        batch, step = paged_batch(model, layout, prompts), compile_decode_step(model, layout)
        tokens = mx.array([p[-1] for p in prompts], dtype=mx.uint32)
        mx.eval(batch.forward_one(step, tokens))
        first = kernels()
        for i in range(6):  # wider blocks from the second step on, then a grown pool
            if i == 3:
                batch.pool.allocate(batch.pool.allocator.num_free + 1)
            mx.eval(batch.forward_one(step, tokens))
        seen.append([first, kernels()])
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_the_compiled_paged_step_retraced_at_a_new_width_or_pool_compiles_no_new_kernel(tmp_path):
    """MLX compiles the step's fused elementwise ops with g++ once per set of scalar constants
    (on the CPU backend, into `$TMPDIR`, once per process): a retrace for wider blocks or a
    grown pool must find every kernel it needs made already, or a request would wait on g++
    after the load's warm-up. (A fresh process, so that no kernel is loaded already.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        pytest.skip("only the CPU backend compiles kernels with g++")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(repo)}
    result = subprocess.run([sys.executable, "-c", _RETRACE_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env, cwd=repo, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (one_first, one_after), (two_first, two_after) = json.loads(result.stdout.strip().splitlines()[-1])
    assert one_first and one_after == one_first  # a lone row: a slice update
    assert two_after == two_first  # two rows: a scatter


def test_a_lone_paged_request_decodes_through_the_compiled_step_with_mlx_lms_tokens():
    """A paged engine's lone request decodes with the compiled step (not building the
    model's graph each step), past a widening of its attended blocks, with mlx-lm's tokens."""
    from engine.batch import MIN_TRACED_BLOCKS

    model, tokenizer = load_reference("builtin:tiny")
    engine = Engine(model, with_kv_blocks(probe_layout(model), 4))
    assert engine._decode_step is not None
    calls: list[int] = []
    step = engine._decode_step

    def counted(*args):
        calls.append(args[0].shape[0])
        return step(*args)

    engine._decode_step = counted
    prompt = random_prompts([MIN_TRACED_BLOCKS * 4 - 6])[0]
    driver = Driver(engine)
    driver.admit(admit_request("a", prompt, max_tokens=16))
    driver.run()
    assert driver.tokens["a"] == greedy_tokens(model, tokenizer, prompt, 16)
    assert len(calls) >= 15 and set(calls) == {1}  # (every token after the first, which the prefill samples)


@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3", "tiny-lfm2", "nemotron_h"])
def test_rows_appending_different_counts_equal_appending_one_at_a_time(name):
    """Known tokens of unequal counts appended over some rows in one call (the jump-forward
    and fill path) leave each row as appending alone does. nemotron_h's SSM ignores the
    caches' lengths, so its rows must never be forwarded padded."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from runtime import env
    from tests.support.families import FAMILIES, build

    if name in FAMILIES:
        model, _ = load(str(build(name, env.home())))
        model.set_dtype(mx.float32)
    else:
        model, _ = load_reference(f"builtin:{name}")
    layout = probe_layout(model)
    prompts = random_prompts([20, 33, 27])
    spans = {0: [5, 6, 7], 2: [9, 10, 11, 12, 13, 14, 15, 16]}
    together, alone = slot_batch(model, layout, prompts), slot_batch(model, layout, prompts)
    together.forward_rows(model, list(spans), [[prompts[r][-1], *span[:-1]] for r, span in spans.items()])
    for r, span in spans.items():
        alone.forward_rows(model, [r], [[prompts[r][-1], *span[:-1]]])
    assert together.lengths == alone.lengths
    last = [spans[0][-1], prompts[1][-1], spans[2][-1]]
    a, b = op_step(model, together, last), op_step(model, alone, last)
    assert mx.allclose(a, b, atol=1e-4).item()


@pytest.mark.parametrize("failure", ["adapter", "draft"])
def test_a_request_failing_at_admission_gives_back_everything_it_took(failure):
    """A request seeded from a prefix entry (the entry's full blocks shared, its partial one
    copied) that fails later in its admission (an adapter unloaded since it was admitted; a
    draft model that is not loaded) ends with `error` and holds no block, no reference."""
    import msgspec

    from protocols.model import SpecPlan

    model, _ = load_reference("builtin:tiny")
    engine = Engine(model, with_kv_blocks(probe_layout(model), 16))
    prompt = random_prompts([40])[0]
    driver = Driver(engine)
    driver.admit(admit_request("a", prompt, max_tokens=4))
    driver.run()
    (entry,) = driver.saved
    before = engine.pool_stats()
    cause = {"adapter": {"adapter": "gone", "adapter_digest": "x"}, "draft": {"spec": SpecPlan(method="draft")}}[failure]
    for i in range(4):
        admit = msgspec.structs.replace(admit_request(f"b{i}", [*prompt, 7]), prefix_entry=entry.entry_id, prefix_tokens=len(prompt) - 1, **cause)
        (output,) = engine.step(StepPlan(admit=[admit])).outputs
        assert output.finish_reason == "error"
    assert engine.pool_stats() == before
    assert engine.kv_tokens() == {} and all(a.users == 0 for a in engine.adapters.infos())
    engine.drop_prefixes([entry.entry_id])
    assert engine.pool_stats().used == 0


@pytest.mark.parametrize("budget", [0, 64])
def test_a_run_that_reaches_the_pools_end_grows_the_pool_to_stay_one_run(budget):
    """A table extended past the pool's last block grows the pool (within the budget) rather than
    continuing in free blocks elsewhere, so its positions stay one run, read in place; at the
    budget it takes the free blocks elsewhere."""
    from engine.kv.paged import BlockPool, contiguous_run

    model, _ = load_reference("builtin:tiny")
    pool = BlockPool(with_kv_blocks(probe_layout(model), 4), max_blocks=budget)
    first = pool.allocate(56)
    table = pool.allocate(8)
    assert pool.allocator.capacity == 64 and table == list(range(56, 64))
    pool.release(first)
    table += pool.allocate(8, after=table[-1])
    if budget:
        assert pool.allocator.capacity == 64 and table[8:] == list(range(8))
    else:
        assert pool.allocator.capacity > 64 and contiguous_run(table, len(table)) == 56
