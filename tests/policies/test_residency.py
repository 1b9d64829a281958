"""Which pool models are swapped out for another to fit (`policies.residency`, pure)."""

from __future__ import annotations

from dataclasses import dataclass

from policies.residency import PROGRESS_GRACE_S, never_fits, next_swap, pinned_overflow


@dataclass(eq=False)
class M:
    name: str
    weight_bytes: int = 10
    pinned: bool = False
    resident: bool = True
    loaded_at: float = 0.0
    last_used: float = 0.0
    users: int = 0
    replaying: int = 0
    progress: int = 0


def test_idle_models_go_first_then_the_least_recently_used():
    busy_old = M("busy_old", users=1, progress=3, last_used=1.0)
    idle_recent = M("idle_recent", last_used=50.0)
    wanted = M("wanted", resident=False)
    assert next_swap([busy_old, idle_recent, wanted], wanted, now=100.0, min_resident_s=10.0).victim is idle_recent
    older = M("older", users=1, progress=1, last_used=0.5)
    assert next_swap([busy_old, older, wanted], wanted, now=100.0, min_resident_s=10.0).victim is older


def test_pinned_replaying_stuck_and_fresh_models_stay():
    wanted = M("wanted", resident=False)
    pinned = M("pinned", pinned=True)
    replaying = M("replaying", replaying=1)
    stuck = M("stuck", users=1, progress=0, loaded_at=90.0)  # no progress since it loaded 10 s ago
    fresh = M("fresh", loaded_at=95.0)
    swap = next_swap([pinned, replaying, stuck, fresh, wanted], wanted, now=100.0, min_resident_s=10.0)
    assert swap.victim is None and swap.wait_s == 5.0  # the fresh one's residence ends in 5 s
    # A stuck model goes after the grace period all the same.
    stuck_long = M("stuck_long", users=1, progress=0, loaded_at=100.0 - PROGRESS_GRACE_S)
    assert next_swap([stuck_long, wanted], wanted, now=100.0, min_resident_s=10.0).victim is stuck_long
    assert next_swap([pinned, wanted], wanted, now=100.0, min_resident_s=1.0).wait_s > 0


def test_fit_checks_name_the_figures():
    models = [M("a", weight_bytes=40, pinned=True), M("b", weight_bytes=30), M("c", weight_bytes=70)]
    assert pinned_overflow(models, 0) is None and pinned_overflow(models, 110) is None
    problem = pinned_overflow(models, 100)
    assert problem is not None and "(40 bytes)" in problem and "(70)" in problem
    assert never_fits(models, models[2], 110) is None
    message = never_fits(models, models[2], 100)
    assert message is not None and "'c' needs 70 bytes" in message
