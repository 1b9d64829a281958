"""Bulk requests (`GenerateRequest.bulk`: an `n` > 1 call's choices, a list of prompts, scoring)
yield to interactive ones: few batch slots and a share of the prefill time while those are live,
full speed alone, and never a token lost or repeated (policy only, against a fake engine)."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from policies.scheduling import SchedulePolicy
from policies.tracked import Tracked
from protocols.model import StepOutcome, StepPlan
from tests.support.scheduling_sim import FakeEngine, Sim, StepRecord, default_token, make_tracked

STEP_S = 1.0


class ParkingEngine(FakeEngine):
    """FakeEngine with parking (a parked row leaves the batch and rejoins when unparked) and
    steps that take `STEP_S` seconds (the policy shares time by them)."""

    def __init__(self) -> None:
        super().__init__()
        self.parked: set[str] = set()

    def step(self, plan: StepPlan) -> StepOutcome:
        for rid in plan.park:
            self.parked.add(rid)
            if rid in self.seqs:
                self.seqs[rid].parked = True
            if rid in self.batch:
                self.batch.remove(rid)
                self.seqs[rid].in_batch = False
        for rid in plan.unpark:
            self.parked.discard(rid)
            seq = self.seqs.get(rid)
            if seq is not None:
                seq.parked = False
            if seq is not None and seq.num_generated and not seq.in_batch:
                self.batch.append(rid)
                seq.in_batch = True
        outcome = super().step(plan)
        assert not set(self.batch) & self.parked, "a parked row decoded"
        return msgspec.structs.replace(outcome, step_s=STEP_S)


class TimedSim(Sim):
    """Sim whose clock also runs while a step computes: a plan is made at its start, its
    outcome applied `STEP_S` later (as the scheduler's clock reads them)."""

    def step(self) -> StepRecord:
        plan = self.policy.plan(self.now)
        outcome = self.engine.step(plan)
        self.now += outcome.step_s
        for row in outcome.outputs:
            self.tokens.setdefault(row.request_id, []).extend(row.token_ids)
        ended = self.policy.apply(outcome, self.now)
        for e in ended:
            self.ended[e.tracked.request_id] = e
        self.now += 0.01  # the scheduler's own work between steps
        record = StepRecord(plan, outcome, ended, 0)
        self.steps.append(record)
        return record


class CostlyRowsEngine(ParkingEngine):
    """ParkingEngine whose steps take `STEP_S` plus `extra` for each bulk row read in them (the
    decode rows a step reports: a row's marginal cost in a batched forward)."""

    def __init__(self, extra: float) -> None:
        super().__init__()
        self.extra = extra

    def step(self, plan: StepPlan) -> StepOutcome:
        outcome = super().step(plan)
        bulk_rows = sum(row.request_id.startswith("b") for row in outcome.outputs)
        return msgspec.structs.replace(outcome, step_s=STEP_S + self.extra * bulk_rows)


def bulk(request_id: str, prompt_len: int, max_tokens: int) -> Tracked:
    tracked = make_tracked(request_id, prompt_len, max_tokens)
    tracked.bulk = True
    return tracked


def make_sim(share: float = 0.2, max_batch_size: int = 16) -> Sim:
    policy = SchedulePolicy(max_batch_size=max_batch_size, max_queued=64, chunk_size=8, token_budget=64, bulk_share=share)
    return TimedSim(policy, engine=ParkingEngine())


def run_until(sim: Sim, done, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        sim.admit_all()
        if done():
            return
        sim.step()
    raise AssertionError("not reached")


def assert_every_token_once(sim: Sim, lengths: dict[str, int]) -> None:
    for rid, n in lengths.items():
        assert sim.ended[rid].reason == "length"
        assert sim.tokens[rid] == [default_token(rid, k) for k in range(n)], rid


def test_bulk_requests_alone_decode_together_at_full_speed():
    sim = make_sim()
    for k in range(8):
        sim.add(bulk(f"b{k}", prompt_len=3, max_tokens=10))
    sim.run()
    assert max(s.outcome.num_decode_rows for s in sim.steps) == 8
    assert not any(s.plan.park for s in sim.steps)
    assert all(s.plan.bulk_only for s in sim.steps if s.plan.decode)
    assert_every_token_once(sim, {f"b{k}": 10 for k in range(8)})


def test_an_interactive_request_holds_running_bulk_rows_to_their_share_and_they_rejoin_after():
    sim = make_sim(share=0.2)
    for k in range(8):
        sim.add(bulk(f"b{k}", prompt_len=3, max_tokens=40))
    run_until(sim, lambda: all(sim.tokens.get(f"b{k}") for k in range(8)))
    stream = sim.add(make_tracked("s", prompt_len=3, max_tokens=12))
    run_until(sim, lambda: "s" in sim.ended)
    during = sim.steps[sim.first_output_step("s") : sim.end_step("s")]
    assert len(during) >= 10 and stream.num_generated == 12
    # One interactive row: bulk keeps share / (1 - share) of one slot, at least one.
    assert all(s.outcome.num_decode_rows <= 2 for s in during)
    assert not any(s.plan.bulk_only for s in during)
    # Seven beyond its slot, and the one in it while its first step beside the stream is paid
    # back (charged whole: no step of the stream alone had been seen).
    held = {rid for s in sim.steps for rid in s.plan.park}
    assert len(held) == 8
    sim.run()
    # Once it has gone the held rows rejoin together, and every row got every token once.
    assert max(s.outcome.num_decode_rows for s in sim.steps[sim.end_step("s") + 2 :]) == 8
    assert_every_token_once(sim, {"s": 12, **{f"b{k}": 40 for k in range(8)}})


def test_bulk_waiting_beyond_its_share_does_not_hold_up_interactive_requests_behind_it():
    sim = make_sim(share=0.2)
    sim.add(make_tracked("s", prompt_len=3, max_tokens=30))
    run_until(sim, lambda: bool(sim.tokens.get("s")))
    for k in range(4):
        sim.add(bulk(f"b{k}", prompt_len=3, max_tokens=5))
    sim.add(make_tracked("t", prompt_len=3, max_tokens=5))
    admitted = sim.admit_all()
    # One bulk request fits the share of the two interactive ones; "t" goes past the others.
    assert admitted == ["b0", "t"]
    sim.run()
    assert_every_token_once(sim, {"s": 30, "t": 5, **{f"b{k}": 5 for k in range(4)}})


@pytest.mark.parametrize("share", [0.2, 0.5])
def test_bulk_prefill_beside_a_stream_takes_its_share_of_the_time(share):
    sim = make_sim(share=share)
    sim.add(make_tracked("s", prompt_len=3, max_tokens=200))
    run_until(sim, lambda: bool(sim.tokens.get("s")))
    sim.add(bulk("b", prompt_len=8 * 40 + 1, max_tokens=2))
    run_until(sim, lambda: "b" in sim.ended)
    steps = [s for s in sim.steps if s.plan.decode and not s.ended]
    with_bulk = [i for i, s in enumerate(steps) if any(w.request_id == "b" for w in s.plan.prefill)]
    # Every step decodes the stream; after each bulk chunk (charged its whole step) the stream
    # alone has the next (1 - share) / share steps' time, and no more than that.
    assert len(with_bulk) == 40
    gaps = {b - a - 1 for a, b in itertools.pairwise(with_bulk)}
    assert gaps == {round((1 - share) / share)}
    sim.run()
    assert_every_token_once(sim, {"s": 200, "b": 2})


def test_bulk_prefill_alone_is_not_slowed():
    sim = make_sim(share=0.2)
    sim.add(bulk("b", prompt_len=8 * 40 + 1, max_tokens=2))
    sim.run()
    # Its chunks take consecutive steps (the token budget allows several a step: 8 a step here).
    chunk_steps = [i for i, s in enumerate(sim.steps) if s.plan.prefill]
    assert chunk_steps == list(range(chunk_steps[0], chunk_steps[0] + len(chunk_steps)))


def test_share_one_treats_bulk_as_interactive():
    sim = make_sim(share=1.0)
    for k in range(4):
        sim.add(bulk(f"b{k}", prompt_len=3, max_tokens=20))
    run_until(sim, lambda: all(sim.tokens.get(f"b{k}") for k in range(4)))
    sim.add(make_tracked("s", prompt_len=3, max_tokens=5))
    sim.run()
    assert not any(s.plan.park for s in sim.steps)
    assert max(s.outcome.num_decode_rows for s in sim.steps) == 5


def test_held_rows_are_idle_and_a_cancel_of_one_releases_it():
    sim = make_sim(share=0.2)
    for k in range(3):
        sim.add(bulk(f"b{k}", prompt_len=3, max_tokens=50))
    run_until(sim, lambda: all(sim.tokens.get(f"b{k}") for k in range(3)))
    sim.add(make_tracked("s", prompt_len=3, max_tokens=50))
    run_until(sim, lambda: sum(t.held for t in sim.tracked.values()) == 2 and all(t.parked_steps >= 1 for t in sim.tracked.values() if t.held))
    assert sim.policy.counts()["paused"] == 0  # held is not paused
    held = next(rid for rid, t in sim.tracked.items() if t.held)
    sim.policy.end_early(held, "cancelled")
    run_until(sim, lambda: held in sim.ended)
    assert sim.ended[held].reason == "cancelled"
    sim.run()
    assert all(sim.ended[rid].reason == "length" for rid in sim.tracked if rid != held)


def test_beside_a_stream_bulk_prefill_is_one_chunk_a_step_however_many_prompts_wait():
    sim = make_sim(share=0.8)  # (room for four bulk requests beside one interactive)
    sim.add(make_tracked("s", prompt_len=3, max_tokens=100))
    run_until(sim, lambda: bool(sim.tokens.get("s")))
    for k in range(2):
        sim.add(bulk(f"p{k}", prompt_len=8 * 6 + 1, max_tokens=2))
    assert sim.admit_all() == ["p0", "p1"]
    run_until(sim, lambda: all(f"p{k}" in sim.ended for k in range(2)))
    bulk_chunks = [sum(w.request_id.startswith("p") for w in s.plan.prefill) for s in sim.steps]
    assert max(bulk_chunks) == 1 and sum(bulk_chunks) == 12
    sim.run()
    assert_every_token_once(sim, {"s": 100, "p0": 2, "p1": 2})


@pytest.mark.parametrize("max_batch_size", [4, 8])
def test_an_interactive_request_that_cannot_be_admitted_never_stalls_the_bulk_rows(max_batch_size):
    # (Its KV reservation is refused: it stays waiting until the bulk rows end and free their KV.)
    sim = make_sim(share=0.2, max_batch_size=max_batch_size)
    for k in range(4):
        sim.add(bulk(f"b{k}", prompt_len=3, max_tokens=30))
    sim.admit_all()
    stuck = make_tracked("s", prompt_len=3, max_tokens=5)
    sim.policy.enqueue(stuck)
    for _ in range(400):
        if not sim.policy.has_work():
            break
        sim.step()
    assert_every_token_once(sim, {f"b{k}": 30 for k in range(4)})
    assert stuck.phase.value == "waiting" and not sim.policy.has_work()
    if max_batch_size == 8:  # slots free: it is waiting for room, and the bulk rows are not held for it
        assert not any(s.plan.park for s in sim.steps)


@pytest.mark.parametrize(("share", "extra"), [(0.1, 0.3), (0.2, 0.3), (0.1, 1.0)])
def test_bulk_rows_decoding_beside_a_stream_take_their_share_of_the_time(share, extra):
    # A bulk row costs `extra` of a step when it decodes beside the stream (on the CPU a second
    # row in SmolLM2's step costs ~0.28 of one): its slot alone would cost the stream that much.
    sim = TimedSim(SchedulePolicy(max_batch_size=16, max_queued=64, chunk_size=8, token_budget=64, bulk_share=share), engine=CostlyRowsEngine(extra))
    sim.add(bulk("b", prompt_len=3, max_tokens=400))
    run_until(sim, lambda: bool(sim.tokens.get("b")))
    sim.add(make_tracked("s", prompt_len=3, max_tokens=200))
    run_until(sim, lambda: "s" in sim.ended)
    during = sim.steps[sim.first_output_step("s") + 1 : sim.end_step("s")]
    time_s = sum(s.outcome.step_s for s in during)
    stream_tokens = sum(len(row.token_ids) for s in during for row in s.outcome.outputs if row.request_id == "s")
    bulk_tokens = sum(len(row.token_ids) for s in during for row in s.outcome.outputs if row.request_id == "b")
    # The stream keeps at least 1 - share of its rate alone (a step a token; one step of slack
    # for the first charge, made before a step of the stream alone was seen), and bulk still
    # makes progress: each step with it is followed by extra * (1 - share) / share steps
    # without, so about 1 / (1 + extra * (1 - share) / share) of the stream's steps carry it.
    assert stream_tokens / (time_s - STEP_S - extra) >= (1 - share) / STEP_S
    assert bulk_tokens >= 0.7 * stream_tokens / (1 + extra * (1 - share) / share)
    sim.run()
    # Alone again, it decodes every step; every token once.
    assert all(any(row.request_id == "b" for row in s.outcome.outputs) for s in sim.steps[sim.end_step("s") + 2 : -1])
    assert_every_token_once(sim, {"s": 200, "b": 400})
