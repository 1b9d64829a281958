"""`scheduler.pin_kernel_thread`: the model actor asks `engine.affinity` to pin its MLX thread's
kernels once the model is built, on the MLX thread itself, unless the config says not to; the
MLX thread gives the core back when it stops."""

from __future__ import annotations

import threading

import msgspec
import pytest

from engine import affinity
from protocols import GenerateRequest
from runtime import Runtime
from tests.support.events import collect


@pytest.mark.parametrize("pin", [True, False])
async def test_the_model_actor_pins_on_the_mlx_thread_as_configured(tiny_config, monkeypatch, pin):
    calls: list[str] = []
    released: list[str] = []
    monkeypatch.setattr(affinity, "pin", lambda lock_dir=None: calls.append(threading.current_thread().name) or 1)
    monkeypatch.setattr(affinity, "release", lambda: released.append(threading.current_thread().name))
    config = msgspec.structs.replace(tiny_config, scheduler=msgspec.structs.replace(tiny_config.scheduler, pin_kernel_thread=pin))
    async with Runtime.open(config) as rt:
        outcome = await collect(rt.generate(GenerateRequest(prompt_ids=[1, 2, 3, 4], max_tokens=4, ignore_eos=True)))
        assert outcome.last.finish_reason == "length" and len(outcome.tokens) == 4
    assert calls == (["mlx"] if pin else [])
    # (The thread releases whatever it pinned as it stops; release is a no-op where nothing was.)
    assert released == ["mlx"]
