"""Tests for policies.scheduling: SchedulePolicy and Tracked, driven by a fake engine.

`FakeEngine` applies `StepPlan`s the way runtime/engine/engine.py does, minus
the arrays: release, admit, prefill, then a pipelined decode. A request whose
prompt is prefilled up to its last token (prompt_len - 1) joins the batch in
the decode of that step; the token dispatched then is read back one decode
step later, so its first `RowOutput` appears in the step after it joined. A
row whose in-flight token is its last leaves the batch before the next
dispatch; the row that reaches `max_tokens` ends with finish_reason "length",
a sampled stop token ends it with "stop" (the token is not in `token_ids`).
With `sync_after_prefill` (the engine's newer mode), a step that prefilled
reads its decode tokens back at once, so a row joining then gets its first
token in that same step; the policy must work the same under either mode.
"""

from __future__ import annotations

import pytest

from policies.tracked import Phase
from protocols.session import RequestTimeline
from tests.support.scheduling_sim import FakeEngine, Sim, make_policy, make_tracked, prefill_tokens

# -- Tracked -----------------------------------------------------------------------


def test_tracked_derived_values():
    tracked = make_tracked("r", prompt_len=10, max_tokens=5)
    assert tracked.request_id == "r"
    assert tracked.prefill_left == 9
    assert tracked.kv_tokens_needed == 15
    assert tracked.phase is Phase.WAITING


def test_tracked_stamp_keeps_the_first_time():
    tracked = make_tracked("r", prompt_len=3, submitted=0.5)
    tracked.stamp("admitted", 1.0)
    tracked.stamp("admitted", 2.0)
    assert tracked.make_timeline() == RequestTimeline(submitted=0.5, admitted=1.0)


# -- the fake engine mirrors the engine's pipelining -----------------------------------


def test_fake_engine_pipelining_at_plan_level():
    sim = Sim(make_policy(chunk_size=4, token_budget=8))
    sim.add(make_tracked("r", prompt_len=9, max_tokens=3))
    sim.run()
    # Prefill 8 tokens in two chunks; joins decode in the step of its last chunk (1),
    # first token one step later (2), third and last token with "length" (4).
    assert sim.chunks_of("r") == [4, 4]
    assert [s.plan.decode for s in sim.steps] == [False, True, True, True, True]
    assert sim.first_output_step("r") == 2
    assert sim.tokens["r"] == [1000, 1001, 1002]
    assert sim.ended["r"].reason == "length"
    assert sim.end_step("r") == 4
    assert sim.engine.seqs == {} and sim.engine.batch == []


def test_fake_engine_synchronous_after_prefill():
    sim = Sim(make_policy(chunk_size=4, token_budget=8), engine=FakeEngine(sync_after_prefill=True))
    sim.add(make_tracked("r", prompt_len=9, max_tokens=3))
    sim.run()
    # Joins in step 1 with its last chunk and reads its first token in that step;
    # step 2 refills the pipeline, steps 3 and 4 read the next two tokens.
    assert sim.first_output_step("r") == 1
    assert [len(s.outcome.outputs) for s in sim.steps] == [0, 1, 0, 1, 1]
    assert sim.tokens["r"] == [1000, 1001, 1002]
    assert sim.end_step("r") == 4
    assert sim.engine.seqs == {} and sim.engine.batch == [] and sim.engine.in_flight is None


# -- (a) token budget ------------------------------------------------------------------


def test_token_budget_never_stalls_decoding_rows_by_more_than_one_chunk():
    chunk_size, budget = 8, 12
    sim = Sim(make_policy(chunk_size=chunk_size, token_budget=budget))
    for i in range(3):
        sim.add(make_tracked(f"d{i}", prompt_len=1, max_tokens=30))
    sim.admit_all()
    sim.step()  # the three join the batch
    sim.add(make_tracked("long", prompt_len=100, max_tokens=2))
    sim.run()

    assert sim.chunks_of("long") == [8] * 12 + [3]
    for record in sim.steps:
        assert prefill_tokens(record.plan) <= max(chunk_size, budget - record.num_decoding)
    for i in range(3):
        rid = f"d{i}"
        assert sim.ended[rid].reason == "length"
        assert len(sim.tokens[rid]) == 30
        # One token in every step from the first output to the end: never stalled.
        first, last = sim.first_output_step(rid), sim.end_step(rid)
        assert last - first + 1 == 30
        for record in sim.steps[: last + 1]:
            assert record.plan.decode
    # The long prompt was being prefilled while the rows decoded.
    assert sim.end_step("long") > 13


@pytest.mark.parametrize(("num_decoding", "chunk_size", "budget"), [(3, 8, 12), (6, 4, 8), (2, 16, 4), (0, 8, 20)])
def test_prefill_tokens_bounded_by_chunk_or_remaining_budget(num_decoding, chunk_size, budget):
    sim = Sim(make_policy(max_batch_size=16, chunk_size=chunk_size, token_budget=budget))
    for i in range(num_decoding):
        sim.add(make_tracked(f"d{i}", prompt_len=1, max_tokens=50))
    for i, length in enumerate([40, 7, 23, 3, 61]):
        sim.add(make_tracked(f"p{i}", prompt_len=length, max_tokens=2))
    sim.run()
    assert all(e.reason == "length" for e in sim.ended.values())
    assert len(sim.ended) == num_decoding + 5
    for record in sim.steps:
        assert prefill_tokens(record.plan) <= max(chunk_size, budget - record.num_decoding)


# -- (b) one-token prompts -------------------------------------------------------------


def test_one_token_prompt_goes_straight_to_decoding():
    sim = Sim(make_policy())
    sim.add(make_tracked("one", prompt_len=1, max_tokens=2))
    sim.admit_all()
    record = sim.step()
    assert [a.request_id for a in record.plan.admit] == ["one"]
    assert record.plan.prefill == []
    assert record.plan.decode is True
    assert sim.policy.get("one").phase is Phase.DECODING
    sim.run()
    assert sim.chunks_of("one") == []
    assert sim.first_output_step("one") == 1
    assert sim.tokens["one"] == [1000, 1001]


# -- (c) shortest remaining first ----------------------------------------------------------


def test_short_prompt_overtakes_a_prefilling_long_one():
    sim = Sim(make_policy(chunk_size=8, token_budget=8))
    sim.add(make_tracked("long", prompt_len=100, max_tokens=2))
    sim.admit_all()
    sim.step()
    sim.step()
    assert sim.chunks_of("long") == [8, 8]

    sim.add(make_tracked("short", prompt_len=5, max_tokens=2))
    sim.admit_all()
    record = sim.step()
    assert record.plan.prefill[0].request_id == "short"
    assert record.plan.prefill[0].num_tokens == 4
    assert sim.policy.get("short").phase is Phase.DECODING
    sim.run()
    assert sim.end_step("short") < sim.first_output_step("long")
    assert sim.end_step("short") == 4
    assert sim.ended["long"].reason == sim.ended["short"].reason == "length"


def test_least_prompt_left_is_prefilled_first():
    sim = Sim(make_policy(chunk_size=4, token_budget=4))
    for rid, length in [("a", 30), ("b", 10), ("c", 20)]:
        sim.add(make_tracked(rid, prompt_len=length, max_tokens=1))
    sim.run()
    order = [w.request_id for s in sim.steps for w in s.plan.prefill]
    first_seen = sorted({rid: order.index(rid) for rid in "abc"}.items(), key=lambda kv: kv[1])
    assert [rid for rid, _ in first_seen] == ["b", "c", "a"]
    assert sim.end_step("b") < sim.end_step("c") < sim.end_step("a")


# -- (d) aging ---------------------------------------------------------------------


def _starvation(max_skips: int, num_steps: int, max_batch_size: int = 64) -> list[bool]:
    """A long prompt against a stream of short ones, one new per step; one chunk fits per step.

    Returns, per step, whether the long prompt (10 chunks) got a chunk."""
    sim = Sim(make_policy(max_batch_size=max_batch_size, max_queued=1000, chunk_size=4, token_budget=4, max_skips=max_skips))
    sim.add(make_tracked("long", prompt_len=41, max_tokens=1))
    got = []
    for i in range(num_steps):
        sim.add(make_tracked(f"s{i}", prompt_len=5, max_tokens=1))
        sim.admit_all()
        record = sim.step()
        got.append(any(w.request_id == "long" for w in record.plan.prefill))
        assert len(record.plan.prefill) == 1
    return got


def test_without_aging_a_long_prompt_starves():
    assert _starvation(max_skips=1000, num_steps=12) == [False] * 12


@pytest.mark.parametrize("max_skips", [1, 2, 3, 4])
def test_aging_gives_precedence_after_max_skips(max_skips):
    got = _starvation(max_skips=max_skips, num_steps=max_skips + 1)
    # Skipped exactly max_skips times in a row, then it goes first.
    assert got == [False] * max_skips + [True]


@pytest.mark.parametrize("max_skips", [2, 4])
def test_aging_repeats_under_light_backlog(max_skips):
    got = _starvation(max_skips=max_skips, num_steps=4 * (max_skips + 1), max_batch_size=3)
    assert got == ([False] * max_skips + [True]) * 4


@pytest.mark.parametrize("max_skips", [1, 2, 4])
def test_aging_prevents_starvation_under_sustained_load(max_skips):
    max_batch_size = 8
    got = _starvation(max_skips=max_skips, num_steps=90, max_batch_size=max_batch_size)
    # The long prompt's 10 chunks all get through, and it is never passed over for
    # longer than the batch can hold requests that were skipped as often as it was.
    assert sum(got) == 10
    last = max(i for i, g in enumerate(got) if g)
    gaps = "".join("X" if g else "." for g in got[: last + 1]).split("X")
    assert max(len(gap) for gap in gaps) <= max_skips + max_batch_size


def test_aged_request_goes_before_shorter_ones():
    sim = Sim(make_policy(chunk_size=4, token_budget=4, max_skips=2))
    sim.add(make_tracked("long", prompt_len=41, max_tokens=1))
    sim.add(make_tracked("s0", prompt_len=9, max_tokens=1))
    sim.admit_all()
    firsts = [sim.step().plan.prefill[0].request_id for _ in range(2)]
    assert firsts == ["s0", "s0"]
    assert sim.policy.get("long").num_skips == 2
    sim.add(make_tracked("s1", prompt_len=9, max_tokens=1))
    sim.admit_all()
    record = sim.step()
    assert [w.request_id for w in record.plan.prefill] == ["long"]
    assert sim.policy.get("long").num_skips == 0
    assert sim.policy.get("s1").num_skips == 1


# -- (e) chunk boundaries do not depend on the load ------------------------------------


def test_chunk_boundaries_independent_of_other_requests():
    def chunks(with_others: bool) -> list[int]:
        sim = Sim(make_policy(chunk_size=8, token_budget=10, max_skips=2))
        sim.add(make_tracked("target", prompt_len=45, max_tokens=3))
        if with_others:
            for i in range(4):
                sim.add(make_tracked(f"d{i}", prompt_len=1, max_tokens=20))
            for i, length in enumerate([3, 12, 70, 9]):
                sim.add(make_tracked(f"p{i}", prompt_len=length, max_tokens=5))
        sim.run()
        assert sim.ended["target"].reason == "length"
        return sim.chunks_of("target")

    alone = chunks(False)
    assert alone == [8, 8, 8, 8, 8, 4]
    assert chunks(True) == alone


# -- (f) batch size ------------------------------------------------------------------


def test_max_batch_size_limits_admission():
    sim = Sim(make_policy(max_batch_size=2))
    for rid in ["a", "b", "c"]:
        sim.add(make_tracked(rid, prompt_len=1, max_tokens=1 if rid == "a" else 5))
    assert sim.admit_all() == ["a", "b"]
    assert sim.policy.admission_candidate() is None
    assert sim.policy.counts() == {"waiting": 3, "prefilling": 0, "decoding": 0, "paused": 0, "held": 0}
    sim.step()
    assert sim.policy.admission_candidate() is None
    assert sim.policy.counts() == {"waiting": 1, "prefilling": 0, "decoding": 2, "paused": 0, "held": 0}
    sim.step()  # "a" produces its only token and ends
    assert sim.ended["a"].reason == "length"
    assert sim.policy.admission_candidate() is sim.tracked["c"]
    assert sim.admit_all() == ["c"]


# -- (g) priority ------------------------------------------------------------------


def test_higher_priority_admitted_first_fifo_within_priority():
    policy = make_policy(max_batch_size=10)
    for rid, priority in [("a", 0), ("b", 1), ("c", 0), ("d", 1), ("e", 2), ("f", -1), ("g", 0)]:
        policy.enqueue(make_tracked(rid, prompt_len=3, priority=priority))
    order = []
    while (candidate := policy.admission_candidate()) is not None:
        policy.admit(candidate, 0.0)
        order.append(candidate.request_id)
    assert order == ["e", "b", "d", "a", "c", "g", "f"]


def test_higher_priority_prefilled_first():
    sim = Sim(make_policy(chunk_size=4, token_budget=4))
    sim.add(make_tracked("low", prompt_len=5, max_tokens=1))
    sim.add(make_tracked("high", prompt_len=30, max_tokens=1, priority=5))
    sim.admit_all()
    assert sim.step().plan.prefill[0].request_id == "high"


# -- (h) queue bound --------------------------------------------------------------------


def test_queue_bound():
    policy = make_policy(max_queued=2)
    assert policy.can_enqueue()
    policy.enqueue(make_tracked("a", prompt_len=2))
    policy.enqueue(make_tracked("b", prompt_len=2))
    assert not policy.can_enqueue()
    with pytest.raises(OverflowError):
        policy.enqueue(make_tracked("c", prompt_len=2))
    assert policy.counts()["waiting"] == 2
    policy.admit(policy.admission_candidate(), 0.0)
    assert policy.can_enqueue()
    policy.enqueue(make_tracked("c", prompt_len=2))
    assert not policy.can_enqueue()


def test_reject_waiting_removes_from_queue():
    policy = make_policy()
    a, b = make_tracked("a", prompt_len=2), make_tracked("b", prompt_len=2)
    policy.enqueue(a)
    policy.enqueue(b)
    policy.reject_waiting(a)
    assert policy.admission_candidate() is b
