"""The Metal wired limit (`engine.model.wired`): who needs it, nesting, and the CPU untouched."""

from __future__ import annotations

import mlx.core as mx

from engine.engine import Engine
from engine.kv.layout import probe_layout
from engine.model.wired import WIRE_FRACTION, WiredLimits, WiredScope, model_bytes, needs_wiring, recommended_working_set
from tests.support.engine_driver import Driver, admit_request, random_prompts
from tests.support.mlx_reference import load_reference

GIB = 1 << 30


def test_only_a_model_over_the_fraction_of_a_reported_working_set_is_wired():
    assert not needs_wiring(20 * GIB, None), "no recommended working set (CPU, CUDA): never"
    assert needs_wiring(int(0.6 * 24 * GIB), 24 * GIB)
    assert not needs_wiring(int(0.4 * 24 * GIB), 24 * GIB)
    assert WIRE_FRACTION == 0.5


def test_holders_nest_and_the_last_restores_the_previous_limit_after_synchronizing():
    calls: list = []

    def set_limit(limit: int) -> int:
        calls.append(("set", limit))
        return 7

    limits = WiredLimits(set_limit, lambda: calls.append(("sync",)))
    a, b = WiredScope(20 * GIB, 24 * GIB, limits), WiredScope(14 * GIB, 24 * GIB, limits)
    small = WiredScope(GIB, 24 * GIB, limits)
    a.hold()
    a.hold()  # holding twice is one hold
    b.hold()
    small.hold()  # not wanted: no effect
    assert limits.depth == 2 and calls == [("set", 24 * GIB)]
    a.release()
    assert calls == [("set", 24 * GIB)], "another holder remains"
    b.release()
    b.release()
    small.release()
    assert calls == [("set", 24 * GIB), ("sync",), ("set", 7)] and limits.depth == 0


def test_an_engine_holds_the_limit_from_its_first_request_to_its_last(monkeypatch):
    """With a working set small enough that the tiny model needs wiring (as a large model on
    Metal would), the limit is set when the first request is admitted and restored when the
    last one leaves; nothing is wired while idle."""
    model, _ = load_reference("builtin:tiny")
    calls: list = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit) or 11, raising=False)
    monkeypatch.setattr(mx, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr("engine.engine.recommended_working_set", lambda: model_bytes(model))
    engine = Engine(model, probe_layout(model))
    assert calls == [], "loading wires nothing"
    driver = Driver(engine)
    driver.admit(*(admit_request(str(i), p) for i, p in enumerate(random_prompts([3, 9]))))
    assert calls == [model_bytes(model)]
    driver.run()
    assert calls == [model_bytes(model), "sync", 11], "the previous limit is back once idle"
    driver.admit(admit_request("again", [5, 6, 7]))
    driver.run()
    assert calls == [model_bytes(model), "sync", 11, model_bytes(model), "sync", 11]


def test_on_this_backend_nothing_is_wired():
    if recommended_working_set() is not None:  # (a Metal machine: the policy above decides)
        assert mx.metal.is_available()
        return
    assert not needs_wiring(model_bytes(load_reference("builtin:tiny")[0]), recommended_working_set())
