"""The vision tower's units (`engine.model.vision.TowerRun`): sized by time once a prefill chunk
and a stage of the tower have been timed, by multiply-adds before; every stage evaluated once,
in order, and the embeddings made at the end."""

from __future__ import annotations

import mlx.core as mx

from engine.model.vision import TowerRun


class _Clock:
    """Each stage's evaluation takes `per_stage` seconds (two readings a stage)."""

    def __init__(self, per_stage: float) -> None:
        self.now, self.per_stage, self.readings = 0.0, per_stage, 0

    def __call__(self) -> float:
        self.readings += 1
        if self.readings % 2 == 0:
            self.now += self.per_stage
        return self.now


def _units(run: TowerRun, budget_tokens: int) -> list[int]:
    """Stages evaluated by each unit until the tower is done."""
    sizes = []
    while True:
        before = len(run._stages)
        done = run.advance(budget_tokens)
        sizes.append(before - len(run._stages))
        if done:
            return sizes


def _tower(num_stages: int, cost: int, per_stage_s: float, prefill_rate: float | None) -> tuple[TowerRun, list[mx.array]]:
    outs = [mx.array([float(i)]) + 1 for i in range(num_stages)]
    embeds = mx.stack(outs)
    run = TowerRun([(out, cost) for out in outs], embeds, token_cost=10, prefill_rate=lambda: prefill_rate, clock=_Clock(per_stage_s))
    return run, outs


def test_units_follow_multiply_adds_until_a_prefill_chunk_has_been_timed():
    # 100 tokens x 10 per token = 1,000 multiply-adds a unit: 4 stages of 250.
    run, _ = _tower(12, cost=250, per_stage_s=5.0, prefill_rate=None)
    assert _units(run, 100) == [4, 4, 4]
    assert run.embeds is not None and run.embeds.tolist() == [[1.0], [2.0], [3.0], [4.0], [5.0], [6.0], [7.0], [8.0], [9.0], [10.0], [11.0], [12.0]]


def test_units_take_about_a_prefill_chunks_time_once_both_are_timed():
    # The same stages by multiply-adds would go 4 to a unit; timed, a stage takes 0.4 s and a
    # 100-token chunk 1.0 s: 2 stages a unit (the first unit's first stage calibrates).
    run, _ = _tower(12, cost=250, per_stage_s=0.4, prefill_rate=0.01)
    assert _units(run, 100) == [2, 2, 2, 2, 2, 2]
    # A tower that runs faster than its multiply-adds say takes more stages a unit.
    fast, _ = _tower(12, cost=250, per_stage_s=0.1, prefill_rate=0.01)
    assert _units(fast, 100) == [10, 2]


def test_a_stage_longer_than_the_budget_is_a_unit_of_its_own():
    run, _ = _tower(3, cost=5_000, per_stage_s=9.0, prefill_rate=0.01)
    assert _units(run, 100) == [1, 1, 1]
    assert run.num_units == 3
