"""The engine with a draft model, driven by plans: parked rows rejoin with their draft KV,
draft and target KV are released together, and the loader refuses drafts it cannot serve."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from engine.build import load_speculator
from engine.draft import DraftRunner
from engine.engine import Engine
from engine.kv.layout import probe_layout
from engine.model.loader import load_model
from engine.speculation import Speculator
from policies.speculation import SpeculationGate
from protocols.config import ModelConfig, SpeculativeConfig
from protocols.errors import ModelLoadError
from protocols.model import SpecPlan, StepPlan
from runtime import env
from tests.support.engine_driver import Driver, admit_request, random_prompts
from tests.support.mlx_reference import greedy_ids, load_reference


@pytest.fixture(scope="module")
def pair():
    return load_reference("builtin:tiny-spec"), load_reference("builtin:tiny-spec-draft")


def _engine(pair, max_batch: int = 8) -> Engine:
    (target, _), (draft, _) = pair
    speculator = Speculator(DraftRunner(draft, probe_layout(draft)), SpeculationGate(max_batch), draft_cost=0.5)
    return Engine(target, probe_layout(target), speculator=speculator)


PLAN = SpecPlan(method="draft", max_draft=3, adaptive=False)


def test_a_parked_speculating_row_rejoins_exactly(pair):
    engine = _engine(pair)
    prompts = random_prompts([30, 45, 12])
    driver = Driver(engine)
    driver.admit(*[admit_request(rid, p, max_tokens=40, spec=PLAN if rid != "c" else None) for rid, p in zip("abc", prompts)])
    while len(driver.tokens["a"]) < 6:
        driver.step(driver.plan())
    driver.step(StepPlan(park=["a"], decode=True))
    assert "a" not in engine._batch.row_ids
    held = len(driver.tokens["a"])
    for _ in range(4):
        driver.step(driver.plan())
    assert len(driver.tokens["a"]) == held, "a parked row's checked round was settled before it left"
    driver.step(StepPlan(unpark=["a"], decode=True))
    driver.run()
    for rid, prompt in zip("abc", prompts):
        assert driver.tokens[rid] == greedy_ids(pair[0][0], prompt, 40), rid
    assert engine.kv_tokens() == {} and engine.kv_bytes() == sum(e.num_bytes for e in driver.saved), "draft KV left with its requests"


def test_the_gate_stops_drafting_in_big_batches(pair):
    engine = _engine(pair, max_batch=2)
    prompts = random_prompts([20, 21, 22])
    driver = Driver(engine)
    driver.admit(*[admit_request(rid, p, max_tokens=16, spec=PLAN) for rid, p in zip("abc", prompts)])
    outcome = None
    while not driver.finish:
        outcome = driver.step(driver.plan())
    assert outcome is not None
    stats = {row.request_id: row.spec for row in outcome.outputs}
    assert all(s is not None and s.rounds == 0 for s in stats.values()), "three rows over a gate of two: no rounds"
    for rid, prompt in zip("abc", prompts):
        assert driver.tokens[rid] == greedy_ids(pair[0][0], prompt, 16)


def test_drafts_that_cannot_be_served_are_refused_at_load():
    root = env.home()
    target = load_model(ModelConfig(path="builtin:tiny"), root)
    with pytest.raises(ModelLoadError, match="recurrent"):
        load_speculator(target, SpeculativeConfig(draft="builtin:tiny-lfm2"), ModelConfig(path="builtin:tiny"), root)
    # A target whose vocabulary differs from the draft's (here: one more logit).
    wider = dataclasses.replace(target, info=msgspec.structs.replace(target.info, vocab_size=target.info.vocab_size + 1))
    with pytest.raises(ModelLoadError, match="vocabulary"):
        load_speculator(wider, SpeculativeConfig(draft="builtin:tiny-spec-draft"), ModelConfig(path="builtin:tiny"), root)
    speculator = load_speculator(target, SpeculativeConfig(draft="builtin:tiny-spec-draft"), ModelConfig(path="builtin:tiny"), root)
    assert speculator.draft is not None


def test_rows_admitted_into_a_big_batch_catch_up_when_it_shrinks(pair):
    """Admitted beside too many rows to speculate, a row's draft model has not prefilled its
    prompt; once the batch is small enough it catches up from the context and drafts."""
    engine = _engine(pair, max_batch=2)
    prompts = random_prompts([24, 24, 24])  # prefilled in the same steps: three rows join at once
    driver = Driver(engine)
    driver.admit(*[admit_request(rid, p, max_tokens=n, spec=PLAN) for rid, p, n in zip("abc", prompts, (40, 40, 6))])
    last = {}
    while len(driver.finish) < 3:
        for row in driver.step(driver.plan()).outputs:
            last[row.request_id] = row.spec
    assert last["a"].rounds > 0 and last["b"].rounds > 0 and last["c"].rounds == 0
    for rid, prompt, n in zip("abc", prompts, (40, 40, 6)):
        assert driver.tokens[rid] == greedy_ids(pair[0][0], prompt, n), rid
