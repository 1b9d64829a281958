"""Tests for policies.scheduling: each request's timeline and spans (prefill chunks, vision towers,
denoising steps, fast-forwards, checkpoint writes), driven by the fake engine of
`tests.support.scheduling_sim` (see test_scheduling.py for how it mirrors the engine)."""

from __future__ import annotations

import msgspec

from policies.tracked import MAX_SPANS, Tracked
from protocols.api import DenoisingOptions, FillStats
from protocols.model import VisionPrompt
from protocols.session import RequestTimeline
from tests.support.scheduling_sim import FakeEngine, Sim, make_policy, make_tracked, prefill_tokens

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
