"""Pausing requests whose callers are not reading (policy only)."""

from __future__ import annotations

from policies.scheduling import SchedulePolicy
from policies.tracked import Tracked
from protocols.api import SamplingParams
from protocols.model import AdmitRequest, StepOutcome


def _policy_with(*rids: str) -> SchedulePolicy:
    policy = SchedulePolicy(max_batch_size=8, max_queued=8, chunk_size=8, token_budget=64)
    for rid in rids:
        admit = AdmitRequest(request_id=rid, prompt_ids=[1], max_tokens=50, sampling=SamplingParams(), seed=0, stop_token_ids=[])
        policy.enqueue(Tracked(admit=admit, submitted=0.0, session=None))
        policy.admit(policy.admission_candidate(), 0.0)
    return policy


def _outcome(**kw) -> StepOutcome:
    fields = dict(outputs=[], prefilled=[], released=[], num_decode_rows=0, kv_tokens={}, kv_bytes=0, step_s=0.0)
    return StepOutcome(**{**fields, **kw})


def test_paused_request_is_parked_then_idle_then_unparked():
    policy = _policy_with("a", "b")
    first = policy.plan(0.0)
    assert first.decode and not first.park
    policy.apply(_outcome(), 0.0)
    policy.set_paused("a", True)
    plan = policy.plan(0.0)
    assert plan.park == ["a"] and plan.decode
    policy.apply(_outcome(), 0.0)
    assert policy.counts()["paused"] == 1
    # "b" still decodes; "a" needs no more steps.
    assert policy.has_work()
    policy.set_paused("a", False)
    plan = policy.plan(0.0)
    assert plan.unpark == ["a"] and not plan.park
    assert policy.counts()["paused"] == 0


def test_only_paused_requests_left_means_no_work():
    policy = _policy_with("a")
    policy.plan(0.0)
    policy.apply(_outcome(), 0.0)
    policy.set_paused("a", True)
    assert policy.plan(0.0).park == ["a"]
    assert policy.has_work(), "one step collects its in-flight token"
    policy.apply(_outcome(), 0.0)
    assert not policy.has_work()
    policy.set_paused("a", False)
    assert policy.has_work()


def test_a_parked_request_can_still_be_cancelled():
    policy = _policy_with("a")
    policy.plan(0.0)
    policy.apply(_outcome(), 0.0)
    policy.set_paused("a", True)
    policy.plan(0.0)
    policy.apply(_outcome(), 0.0)
    assert not policy.has_work()
    assert policy.end_early("a", "cancelled") is None
    assert policy.has_work()
    plan = policy.plan(0.0)
    assert plan.release == ["a"]
    (ended,) = policy.apply(_outcome(released=["a"]), 0.0)
    assert ended.reason == "cancelled" and not policy.has_work()


def test_a_failed_step_keeps_the_reason_of_requests_already_ending():
    policy = _policy_with("a", "b")
    policy.plan(0.0)
    policy.apply(_outcome(), 0.0)
    policy.end_early("a", "cancelled")
    reasons = {e.tracked.request_id: e.reason for e in policy.fail_all("boom")}
    assert reasons == {"a": "cancelled", "b": "error"}


def test_parked_requests_wait_for_their_checkpoint():
    policy = _policy_with("a")
    policy.plan(0.0)
    tracked = policy.get("a")
    tracked.checkpoint_every, tracked.next_checkpoint = 4, 4
    policy.set_paused("a", True)
    policy.plan(0.0)  # parks "a"
    tracked.num_generated = 5
    assert policy.plan(0.0).checkpoint == []
    policy.set_paused("a", False)
    plan = policy.plan(0.0)  # the row rejoins in this step, before its checkpoint is taken
    assert plan.unpark == ["a"] and plan.checkpoint == ["a"]
