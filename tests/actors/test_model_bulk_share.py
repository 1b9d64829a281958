"""Embedding forwards are bulk work: after each, while steps for interactive requests run, the
model actor leaves the MLX thread to them for the rest of `scheduler.bulk_share`."""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import pytest

import actors.model as model_module
from actors.mlx_thread import MlxThread
from actors.model import ModelActor
from protocols.config import ModelConfig
from protocols.model import StepPlan


@pytest.fixture
def make_actor():
    made: list[ModelActor] = []

    def make(share: float) -> ModelActor:
        actor = ModelActor(ModelConfig(path="builtin:tiny"), MlxThread(), builtin_root=Path("."), make_grammars=lambda *a: None, bulk_share=share)
        made.append(actor)
        return actor

    yield make
    for actor in made:
        actor.inbox.close()


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(model_module.anyio, "sleep", sleep)
    return slept


class FakeEngine:
    def step(self, plan: StepPlan):
        return "outcome"


class FakeBank:
    def staged(self, files):
        return contextlib.nullcontext()


async def test_a_forward_beside_interactive_steps_leaves_the_thread_for_the_rest_of_the_share(make_actor, sleeps):
    actor = make_actor(0.2)
    await actor._yield_to_interactive(0.1)
    assert sleeps == []  # no interactive step has run
    assert actor._run_step(FakeEngine(), FakeBank(), {}, StepPlan(decode=True, bulk_only=True)) == "outcome"
    await actor._yield_to_interactive(0.1)
    assert sleeps == []  # a step for bulk work only does not count
    actor._run_step(FakeEngine(), FakeBank(), {}, StepPlan(decode=True))
    await actor._yield_to_interactive(0.1)
    assert sleeps == [pytest.approx(0.4)]  # 0.1 s of 0.2 share: 0.4 s for the others


async def test_long_after_the_last_interactive_step_or_at_share_one_it_does_not_wait(make_actor, sleeps):
    actor = make_actor(0.2)
    actor._interactive_at = time.monotonic() - 5.0
    await actor._yield_to_interactive(0.1)  # (steps stopped 5 s ago: more than max(1 s, 4 forwards))
    assert sleeps == []
    actor = make_actor(1.0)
    actor._interactive_at = time.monotonic()
    await actor._yield_to_interactive(0.1)
    assert sleeps == [] and actor._interactive_at != -math.inf
