"""How a step gets to the MLX thread (`ModelActor.start_step`): queued from the scheduler's own
task, before any session takes the last step's tokens; a step that fails on the MLX thread
fails its requests and leaves an engine that serves the next ones; plans that must read
adapter files, or that run in a distributed world, go through the model's inbox."""

from __future__ import annotations

import random
from typing import Any, cast

import anyio

from actors.mlx_thread import Job
from actors.model import ModelActor
from actors.scheduler import SchedulerActor
from actors.session import SessionActor
from engine.engine import Engine
from protocols import GenerateRequest
from protocols.api import SamplingParams
from protocols.model import AdmitRequest, StepPlan
from runtime import Runtime
from tests.support.events import collect


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(24)]


async def test_the_next_step_is_queued_before_any_session_takes_the_last_steps_tokens(tiny_config, monkeypatch):
    events: list[str] = []
    entry, deliver, on_tokens, admit = Job.entry, SchedulerActor._deliver, SessionActor._on_tokens, SchedulerActor._admit

    def queued(self, fn, args):
        if getattr(fn, "__name__", "") == "_run_step":
            events.append("queued")  # (a step job, as it goes into the MLX thread's queue)
        return entry(self, fn, args)

    async def delivered(self, outcome, started):
        events.append("delivered")
        await deliver(self, outcome, started)

    async def tokens(self, message):
        events.append("session")
        await on_tokens(self, message)

    async def admitting(self):
        if self.policy.admission_candidate() is not None:
            events.append("admit")  # (asking the KV store for room yields: sessions may run then)
        await admit(self)

    monkeypatch.setattr(Job, "entry", queued)
    monkeypatch.setattr(SchedulerActor, "_admit", admitting)
    monkeypatch.setattr(SchedulerActor, "_deliver", delivered)
    monkeypatch.setattr(SessionActor, "_on_tokens", tokens)
    async with Runtime.open(tiny_config) as rt:
        events.clear()
        async with anyio.create_task_group() as tg:
            for seed in range(3):
                tg.start_soon(collect, rt.generate(GenerateRequest(prompt_ids=_prompt(seed), max_tokens=12, ignore_eos=True)))
    assert events.count("queued") >= 12 and events.count("session") >= 12
    # Between a step's delivery and the next step's queueing, no session ran, unless a request
    # that arrived meanwhile was admitted (a request sent while the first steps ran).
    between = [events[i + 1 : events.index("queued", i)] for i, event in enumerate(events) if event == "delivered" and "queued" in events[i:]]
    without_admission = [gap for gap in between if "admit" not in gap]
    assert len(without_admission) >= 6 and all("session" not in gap for gap in without_admission), events


async def test_a_step_that_fails_on_the_mlx_thread_fails_its_requests_and_the_engine_serves_the_next(tiny_config, monkeypatch):
    step, failures = Engine.step, cast(list[StepPlan], [])

    def failing(self, plan):
        if plan.decode and not failures:
            failures.append(plan)
            raise RuntimeError("a kernel failed")
        return step(self, plan)

    async with Runtime.open(tiny_config) as rt:
        monkeypatch.setattr(Engine, "step", failing)  # (after the load's warm-up)
        failed = await collect(rt.generate(GenerateRequest(prompt_ids=_prompt(1), max_tokens=8, ignore_eos=True)))
        assert failures and failed.last.finish_reason == "error" and "a kernel failed" in (failed.last.error or "")
        served = await collect(rt.generate(GenerateRequest(prompt_ids=_prompt(2), max_tokens=8, ignore_eos=True)))
        assert served.last.finish_reason == "length" and served.last.usage.completion_tokens == 8


def test_plans_that_read_adapter_files_or_run_in_a_world_go_through_the_inbox():
    actor = ModelActor.__new__(ModelActor)
    actor._serving, actor.world, actor._denoise_share = cast(Any, (object(), object())), None, 1.0
    with_adapter = AdmitRequest(request_id="a", prompt_ids=[1, 2], max_tokens=4, sampling=SamplingParams(), seed=0, stop_token_ids=[], adapter="style")
    assert actor.start_step(StepPlan(admit=[with_adapter])) is None
    actor._denoise_share = 0.25
    assert actor.start_step(StepPlan(denoise=["d"])) is None
    actor._denoise_share, actor.world = 1.0, cast(Any, object())
    assert actor.start_step(StepPlan(decode=True)) is None
    actor.world, actor._serving = None, None  # not loaded yet (or closed)
    assert actor.start_step(StepPlan(decode=True)) is None
