"""The MLX thread's record of who ran work on it (what keeps denoising to its share in a pool)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from actors.mlx_thread import MlxThread


def test_busy_besides_sees_only_other_users_and_only_recently(monkeypatch):
    thread = MlxThread()
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    assert not thread.busy_besides(1, within_s=1.0)  # nobody ran anything
    thread.note(1)
    assert not thread.busy_besides(1, within_s=1.0)  # only itself
    thread.note(2)
    now[0] += 0.5
    assert thread.busy_besides(1, within_s=1.0)
    now[0] += 1.0
    assert not thread.busy_besides(1, within_s=1.0)  # the other went quiet
    assert thread.busy_besides(1, within_s=2.0)


async def test_jobs_run_on_the_thread_and_errors_come_back():
    thread = MlxThread()
    thread.start()
    try:
        assert await thread.run(threading.get_ident) == thread.ident
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
    finally:
        await thread.stop()


async def test_start_lowers_the_gil_switch_interval_and_never_raises_it():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        thread = MlxThread()
        thread.start(0.0005)
        await thread.stop()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        thread = MlxThread()
        thread.start(0.01)  # higher: left as it is
        await thread.stop()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
