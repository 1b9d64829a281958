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

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.tracked import MAX_SPANS, Ended, Phase, Tracked
from protocols.api import DenoisingOptions, FillStats
from protocols.model import RowOutput, StepOutcome, StepPlan, VisionPrompt
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


# -- (l) timelines ----------------------------------------------------------------


def test_timeline_stamped_in_order():
    sim = Sim(make_policy(chunk_size=4, token_budget=4))
    tracked = sim.add(make_tracked("r", prompt_len=13, max_tokens=3, submitted=0.0))
    sim.now = 0.5
    sim.admit_all()
    sim.run()
    timeline = tracked.make_timeline()
    # admitted at 0.5; chunks planned at 1.5, 2.5, 3.5 (joins then); tokens read at 4.5, 5.5, 6.5.
    stamps = msgspec.structs.replace(timeline, spans=[])
    assert stamps == RequestTimeline(submitted=0.0, admitted=0.5, prefill_started=1.5, first_token=4.5, last_token=6.5)
    assert timeline.submitted <= timeline.admitted <= timeline.prefill_started <= timeline.first_token <= timeline.last_token


def test_each_prefill_chunk_is_a_span_from_its_plan_to_its_outcome():
    policy = make_policy(chunk_size=4, token_budget=4)
    tracked = make_tracked("r", prompt_len=13, max_tokens=3, submitted=0.0)
    policy.enqueue(tracked)
    policy.admit(tracked, 0.5)
    engine, now = FakeEngine(), 1.0
    while policy.has_work():
        plan = policy.plan(now)
        policy.apply(engine.step(plan), now + 0.25)  # each step takes a quarter second
        now += 1.0
    chunks = [s for s in tracked.make_timeline().spans if s.name == "prefill_chunk"]
    # 13 prompt tokens, the last one is decoded: chunks of 4, 4, 4 at offsets 0, 4, 8.
    assert [(s.start, s.end, s.attributes) for s in chunks] == [
        (1.0, 1.25, {"tokens": 4, "offset": 0}),
        (2.0, 2.25, {"tokens": 4, "offset": 4}),
        (3.0, 3.25, {"tokens": 4, "offset": 8}),
    ]


def _image_prompt(request_id: str, prompt_len: int, image: range, max_tokens: int = 3) -> Tracked:
    tracked = make_tracked(request_id, prompt_len, max_tokens)
    ids = tracked.admit.prompt_ids
    keys = [10_000 + i if i in image else t for i, t in enumerate(ids)]
    tracked.admit = msgspec.structs.replace(tracked.admit, vision=VisionPrompt(arrays={"pixel_values": [0]}, digests=["d"], key_ids=keys))
    return tracked


def test_a_vision_tower_runs_a_unit_a_step_before_its_chunks_while_rows_decode():
    sim = Sim(make_policy(chunk_size=4, token_budget=6), engine=FakeEngine(tower_units={"image": 3}))
    sim.add(make_tracked("text", prompt_len=3, max_tokens=12))
    sim.admit_all()
    sim.step()
    sim.step()  # "text" is decoding
    sim.add(_image_prompt("image", prompt_len=13, image=range(2, 9)))
    sim.run()
    work = [(w.encode, w.num_tokens) for s in sim.steps for w in s.plan.prefill if w.request_id == "image"]
    # Three tower units (each costed as a chunk), then the prompt's chunks.
    assert work == [(True, 4)] * 3 + [(False, 4)] * 3
    encoding = [i for i, s in enumerate(sim.steps) if any(w.encode for w in s.plan.prefill)]
    assert all(sim.steps[i].plan.decode for i in encoding)
    # The text row got a token in every step a unit ran.
    assert all(any(o.request_id == "text" and o.token_ids for o in sim.steps[i].outcome.outputs) for i in encoding)
    assert sim.ended["image"].reason == "length" and sim.ended["text"].reason == "length"
    spans = [s.name for s in sim.tracked["image"].make_timeline().spans]
    assert spans == ["vision_encode"] * 3 + ["prefill_chunk"] * 3


def test_an_image_prompt_whose_images_are_in_its_prefix_hit_runs_no_tower():
    sim = Sim(make_policy(chunk_size=4, token_budget=8), engine=FakeEngine(tower_units={"image": 3}))
    tracked = sim.add(_image_prompt("image", prompt_len=13, image=range(2, 9)))
    tracked.start_from_prefix("entry", 9)
    sim.engine.tower_units = {}  # the engine finds the images' KV in the prefix
    sim.run()
    assert [(w.encode, w.num_tokens) for s in sim.steps for w in s.plan.prefill] == [(False, 3)]
    assert sim.ended["image"].reason == "length"


def test_denoising_requests_step_beside_decoding_rows_within_the_budget():
    # Two denoising requests (canvases of 4, 3 steps each) and a decoding row; a budget of 10:
    # the decoding row (1) and one canvas (4) always fit, a second canvas (4) too, a prompt
    # chunk (4) waits for room.
    sim = Sim(make_policy(chunk_size=4, token_budget=10))
    sim.add(make_tracked("text", prompt_len=3, max_tokens=20))
    for rid in ("d1", "d2"):
        tracked = make_tracked(rid, prompt_len=5, max_tokens=8)
        tracked.admit = msgspec.structs.replace(tracked.admit, denoise=DenoisingOptions(canvas_length=4))
        sim.add(tracked)
    sim.run()
    assert all(sim.ended[rid].reason == "length" for rid in ("text", "d1", "d2"))
    assert sim.tokens["d1"] == [1000 + i for i in range(8)]
    denoising = [s for s in sim.steps if s.plan.denoise]
    assert len(denoising) == 6  # 2 canvases x 3 steps, both requests in the same steps
    assert all(set(s.plan.denoise) == {"d1", "d2"} for s in denoising)
    assert all(s.plan.decode for s in denoising[:4])  # the text row decodes beside them
    assert all(4 * len(s.plan.denoise) + s.num_decoding + prefill_tokens(s.plan) <= 10 or len(s.plan.denoise) == 1 for s in sim.steps)


def test_a_denoising_request_that_is_not_read_stops_stepping_until_it_is():
    sim = Sim(make_policy(chunk_size=4, token_budget=16))
    tracked = make_tracked("d", prompt_len=5, max_tokens=8)
    tracked.admit = msgspec.structs.replace(tracked.admit, denoise=DenoisingOptions(canvas_length=4))
    sim.add(tracked)
    sim.admit_all()
    sim.step()
    sim.step()
    sim.policy.set_paused("d", True)
    for _ in range(3):
        sim.step()
    assert not any(s.plan.denoise for s in sim.steps[-2:])
    sim.policy.set_paused("d", False)
    sim.run()
    assert sim.ended["d"].reason == "length" and len(sim.tokens["d"]) == 8


def test_spans_beyond_the_cap_are_counted_not_kept():
    tracked = make_tracked("r", prompt_len=4, max_tokens=2)
    for i in range(MAX_SPANS + 5):
        tracked.add_span("fast_forward", float(i), float(i) + 0.5, injected=1)
    timeline = tracked.make_timeline()
    assert len(timeline.spans) == MAX_SPANS and timeline.spans_dropped == 5


def test_fast_forward_steps_and_checkpoint_writes_are_spans():
    tracked = make_tracked("r", prompt_len=4, max_tokens=20)
    tracked.record_fill(FillStats(mode="echo", decode_steps=1), 1.0, 1.5)  # nothing forwarded yet
    tracked.record_fill(FillStats(mode="echo", events=1, injected=3, echo=3, verify_events=1, verify_accepted=3, verify_rejected=2), 2.0, 2.5)
    tracked.checkpoint_writes.append(3.0)
    tracked.record_checkpoint(True, None, 3.75)
    spans = [(s.name, s.start, s.end, s.attributes) for s in tracked.make_timeline().spans]
    assert spans == [
        ("fast_forward", 2.0, 2.5, {"injected": 3, "accepted": 3, "rejected": 2}),
        ("checkpoint_write", 3.0, 3.75, {"ok": True}),
    ]
    assert tracked.checkpoints_written == 1


def test_timeline_of_one_token_prompt_has_no_prefill_stamp():
    sim = Sim(make_policy())
    tracked = sim.add(make_tracked("r", prompt_len=1, max_tokens=1))
    sim.run()
    timeline = tracked.make_timeline()
    assert timeline.prefill_started is None
    assert timeline.admitted == 0.0 and timeline.first_token == timeline.last_token == 2.0


def test_stop_finish_without_tokens_stamps_first_token():
    engine = FakeEngine(tokens=lambda rid, i: 7)
    sim = Sim(make_policy(), engine=engine)
    tracked = sim.add(make_tracked("r", prompt_len=1, max_tokens=5, stop_token_ids=[7]))
    sim.run()
    assert sim.tokens.get("r", []) == []
    assert tracked.make_timeline().first_token == 2.0


def test_counts_and_steps():
    sim = Sim(make_policy(chunk_size=4, token_budget=5))
    sim.add(make_tracked("p", prompt_len=20, max_tokens=2))
    sim.add(make_tracked("d", prompt_len=1, max_tokens=10))
    sim.add(make_tracked("w", prompt_len=1, max_tokens=1))
    sim.admit_all()
    assert sim.policy.counts() == {"waiting": 3, "prefilling": 0, "decoding": 0, "paused": 0, "held": 0}
    sim.step()
    assert sim.policy.counts() == {"waiting": 0, "prefilling": 1, "decoding": 2, "paused": 0, "held": 0}
    assert sim.policy.num_steps == 1


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
