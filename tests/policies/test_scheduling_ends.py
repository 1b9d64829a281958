"""Tests for policies.scheduling: how requests end (early ends, finishes, failures) and a randomized
workload's invariants, driven by the fake engine of `tests.support.scheduling_sim` (see
test_scheduling.py for how it mirrors the engine)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.tracked import Ended, Phase, Tracked
from protocols.model import RowOutput, StepOutcome, StepPlan
from tests.support.scheduling_sim import FakeEngine, Sim, make_policy, make_tracked, prefill_tokens

# -- (i) early ends ------------------------------------------------------------------


def test_end_early_on_waiting_request_ends_now():
    policy = make_policy()
    a, b = make_tracked("a", prompt_len=3), make_tracked("b", prompt_len=3)
    policy.enqueue(a)
    policy.enqueue(b)
    ended = policy.end_early("a", "cancelled")
    assert ended == Ended(a, "cancelled")
    assert policy.admission_candidate() is b
    assert policy.counts()["waiting"] == 1


def test_end_early_on_admitted_not_yet_planned_request_ends_now():
    policy = make_policy()
    a = make_tracked("a", prompt_len=3)
    policy.enqueue(a)
    policy.admit(a, 0.0)
    assert policy.has_work()
    assert policy.end_early("a", "stop") == Ended(a, "stop")
    assert not policy.has_work()


def test_end_early_on_unknown_request_is_none():
    assert make_policy().end_early("nope", "cancelled") is None


@pytest.mark.parametrize("reason", ["cancelled", "stop"])
def test_end_early_on_active_request_releases_it_next_step(reason):
    sim = Sim(make_policy())
    sim.add(make_tracked("r", prompt_len=1, max_tokens=50))
    sim.add(make_tracked("other", prompt_len=1, max_tokens=5))
    sim.admit_all()
    sim.step()
    sim.step()
    assert sim.tokens["r"] == [1000]

    assert sim.policy.end_early("r", reason) is None
    assert sim.policy.end_early("r", "cancelled") is None  # the first reason sticks
    assert sim.policy.get("r").phase is Phase.RELEASING
    record = sim.step()
    assert record.plan.release == ["r"]
    assert record.outcome.released == ["r"]
    assert [(e.tracked.request_id, e.reason) for e in record.ended] == [("r", reason)]
    assert "r" not in {o.request_id for o in record.outcome.outputs}
    assert sim.policy.get("r") is None
    sim.run()
    assert sim.tokens["r"] == [1000]
    assert sim.ended["other"].reason == "length"
    assert all(s.plan.release == [] for s in sim.steps[3:])


def test_end_early_while_prefilling_stops_its_prefill():
    sim = Sim(make_policy(chunk_size=4, token_budget=4))
    sim.add(make_tracked("r", prompt_len=40, max_tokens=5))
    sim.admit_all()
    sim.step()
    assert sim.policy.end_early("r", "cancelled") is None
    record = sim.step()
    assert record.plan.release == ["r"] and record.plan.prefill == [] and record.plan.decode is False
    assert sim.ended["r"].reason == "cancelled"
    assert not sim.policy.has_work()


def test_release_reason_wins_over_engine_finish():
    sim = Sim(make_policy())
    sim.add(make_tracked("r", prompt_len=1, max_tokens=2))
    sim.admit_all()
    sim.step()
    sim.step()
    sim.policy.end_early("r", "stop")
    # The row's last token was already in flight: the engine ends it before the release lands.
    outcome = StepOutcome(
        outputs=[RowOutput(request_id="r", token_ids=[5], finish_reason="length")],
        prefilled=[],
        released=[],
        num_decode_rows=0,
        kv_tokens={},
        kv_bytes=0,
        step_s=0.0,
    )
    ended = sim.policy.apply(outcome, 10.0)
    assert [(e.tracked.request_id, e.reason) for e in ended] == [("r", "stop")]
    assert not sim.policy.has_work()


# -- (j) finishes ------------------------------------------------------------------


def test_stop_token_finish_passes_stop_token_id_through():
    engine = FakeEngine(tokens=lambda rid, i: 7 if (rid, i) == ("r", 2) else 1000 + i)
    sim = Sim(make_policy(), engine=engine)
    sim.add(make_tracked("r", prompt_len=3, max_tokens=10, stop_token_ids=[7, 8]))
    sim.run()
    ended = sim.ended["r"]
    assert (ended.reason, ended.stop_token_id) == ("stop", 7)
    assert sim.tokens["r"] == [1000, 1001]


def test_length_finish_has_no_stop_token_id():
    sim = Sim(make_policy())
    sim.add(make_tracked("r", prompt_len=3, max_tokens=3))
    sim.run()
    assert (sim.ended["r"].reason, sim.ended["r"].stop_token_id) == ("length", None)
    assert sim.policy.num_finished == 1


def test_outputs_for_unknown_requests_are_ignored():
    policy = make_policy()
    outcome = StepOutcome(
        outputs=[RowOutput(request_id="ghost", token_ids=[1], finish_reason="length")],
        prefilled=[],
        released=[],
        num_decode_rows=0,
        kv_tokens={},
        kv_bytes=0,
        step_s=0.0,
    )
    assert policy.apply(outcome, 0.0) == []
    assert policy.num_finished == 0


# -- (k) failures ------------------------------------------------------------------


def test_fail_all_ends_every_active_request_in_error():
    sim = Sim(make_policy(max_batch_size=2))
    for rid in ["a", "b", "waiting"]:
        sim.add(make_tracked(rid, prompt_len=20, max_tokens=5))
    sim.admit_all()
    sim.step()
    ended = sim.policy.fail_all("boom")
    assert sorted((e.tracked.request_id, e.reason) for e in ended) == [("a", "error"), ("b", "error")]
    assert not sim.policy.has_work()
    assert sim.policy.num_finished == 2
    assert sim.policy.admission_candidate() is sim.tracked["waiting"]
    assert sim.policy.fail_all("boom") == []


def test_fail_all_carries_the_error_code_and_forgotten_checkpoints_ride_the_next_plan():
    sim = Sim(make_policy(max_batch_size=2))
    sim.add(make_tracked("a", prompt_len=20, max_tokens=5))
    sim.admit_all()
    sim.step()
    sim.policy.forget_checkpoint("old-1")
    sim.policy.forget_checkpoint("old-2")
    sim.add(make_tracked("b", prompt_len=4, max_tokens=5))
    sim.admit_all()
    plan = sim.policy.plan(0.0)
    assert plan.forget_checkpoints == ["old-1", "old-2"]
    assert sim.policy.plan(0.0).forget_checkpoints == []  # said once
    ended = sim.policy.fail_all("rank 1 is gone", "unavailable")
    assert {(e.tracked.request_id, e.error, e.error_code) for e in ended} == {("a", "rank 1 is gone", "unavailable"), ("b", "rank 1 is gone", "unavailable")}


# -- a randomized workload ------------------------------------------------------------


@st.composite
def workloads(draw):
    chunk_size = draw(st.integers(1, 12))
    token_budget = draw(st.integers(1, 24))
    max_batch_size = draw(st.integers(1, 6))
    max_skips = draw(st.integers(1, 5))
    requests = draw(
        st.lists(
            st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(0, 10), st.integers(-1, 1)),
            min_size=1,
            max_size=8,
        )
    )
    return chunk_size, token_budget, max_batch_size, max_skips, requests


@settings(max_examples=150, deadline=None)
@given(workloads(), st.booleans(), st.booleans())
def test_random_workloads_complete_and_respect_invariants(workload, sync_after_prefill, run_ahead):
    chunk_size, token_budget, max_batch_size, max_skips, requests = workload
    sim = Sim(
        make_policy(max_batch_size=max_batch_size, chunk_size=chunk_size, token_budget=token_budget, max_skips=max_skips),
        engine=FakeEngine(sync_after_prefill=sync_after_prefill),
        run_ahead=run_ahead,
    )
    arrivals: dict[int, list[Tracked]] = {}
    for i, (prompt_len, max_tokens, arrival, priority) in enumerate(requests):
        tracked = make_tracked(f"r{i}", prompt_len=prompt_len, max_tokens=max_tokens, priority=priority)
        arrivals.setdefault(arrival, []).append(tracked)
    for step in range(2000):
        for tracked in arrivals.pop(step, []):
            sim.add(tracked)
        sim.admit_all()
        if sim.policy.has_work() or sim.ahead is not None:
            record = sim.step()
            assert prefill_tokens(record.plan) <= max(chunk_size, token_budget - record.num_decoding)
            assert record.outcome.num_decode_rows <= max_batch_size
        elif not arrivals:
            break
    assert not sim.policy.has_work() and not arrivals
    assert set(sim.ended) == {f"r{i}" for i in range(len(requests))}
    for i, (prompt_len, max_tokens, _, _) in enumerate(requests):
        rid = f"r{i}"
        assert sim.ended[rid].reason == "length"
        assert sim.tokens[rid] == [1000 + k for k in range(max_tokens)]
        chunks = sim.chunks_of(rid)
        full, rest = divmod(prompt_len - 1, chunk_size)
        assert chunks == [chunk_size] * full + ([rest] if rest else [])
        timeline = sim.tracked[rid].make_timeline()
        assert timeline.admitted <= timeline.first_token <= timeline.last_token
        if prompt_len > 1:
            assert timeline.admitted < timeline.prefill_started <= timeline.first_token
            assert sync_after_prefill or timeline.prefill_started < timeline.first_token
    assert sim.policy.num_finished == len(requests)
    assert sim.engine.seqs == {} and sim.engine.batch == []


def test_a_plan_is_made_ahead_only_while_every_admitted_request_just_decodes():
    policy = make_policy(max_batch_size=2, chunk_size=4)
    sim = Sim(policy, run_ahead=True)
    sim.add(make_tracked("a", prompt_len=9, max_tokens=6))
    sim.admit_all()
    prefilling = sim.step().plan
    assert not policy.plans_ahead(prefilling)  # admits and prefills
    sim.step()
    decoding = sim.step().plan
    assert decoding == StepPlan(decode=True) and policy.plans_ahead(decoding)
    # A request that could be admitted (a free batch slot) stops it; one that must wait does not.
    sim.add(make_tracked("b", prompt_len=11, max_tokens=2))
    assert not policy.plans_ahead(decoding)
    sim.add(make_tracked("c", prompt_len=3, max_tokens=2))
    sim.admit_all()
    assert sim.step().plan == StepPlan(decode=True)  # the plan made ahead runs first
    assert [a.request_id for a in sim.step().plan.admit] == ["b"]
    assert not policy.plans_ahead(decoding)  # "b" is prefilling
    for tracked in policy._active.values():
        tracked.phase = Phase.DECODING
    assert policy.admission_candidate() is None and policy.plans_ahead(decoding)
    policy.set_paused("b", True)
    assert not policy.plans_ahead(decoding)
    policy.set_paused("b", False)
    policy._active["b"].checkpoint_every = 4
    assert not policy.plans_ahead(decoding)


def test_with_plans_made_ahead_every_request_gets_the_same_tokens_and_chunks():
    results = []
    for run_ahead in (False, True):
        sim = Sim(make_policy(max_batch_size=3, chunk_size=4, token_budget=8), run_ahead=run_ahead)
        for i, (prompt_len, max_tokens) in enumerate([(9, 7), (3, 12), (14, 5), (2, 9)]):
            sim.add(make_tracked(f"r{i}", prompt_len=prompt_len, max_tokens=max_tokens))
        sim.run()
        ahead = sum(1 for record in sim.steps if record.plan == StepPlan(decode=True))
        results.append(({rid: (e.reason, sim.tokens[rid], sim.chunks_of(rid)) for rid, e in sim.ended.items()}, ahead))
    (plain, _), (ahead, decode_steps) = results
    assert ahead == plain and decode_steps > 0


def test_requests_ended_before_admission_count_as_finished():
    sim = Sim(make_policy(max_batch_size=1))
    for rid in ["running", "queued"]:
        sim.add(make_tracked(rid, prompt_len=20, max_tokens=5))
    sim.admit_all()
    ended = sim.policy.end_early("queued", "cancelled")
    assert ended is not None and ended.reason == "cancelled"
    assert sim.policy.num_finished == 1


def test_a_failed_step_keeps_an_ending_requests_reason_without_an_error():
    """A request the client cancelled ends as a cancel (its checkpoint goes as a cancel's does)."""
    sim = Sim(make_policy(max_batch_size=2))
    for rid in ["a", "b"]:
        sim.add(make_tracked(rid, prompt_len=20, max_tokens=5))
    sim.admit_all()
    sim.step()
    sim.policy.end_early("a", "cancelled")
    ended = {e.tracked.request_id: e for e in sim.policy.fail_all("boom")}
    assert (ended["a"].reason, ended["a"].error) == ("cancelled", None)
    assert (ended["b"].reason, ended["b"].error) == ("error", "boom")
