"""Warming an engine up at load: the kinds of step serving runs, on throwaway requests.

A batched first chunk, a batch of two rows, then a lone row's step, so that MLX compiles their
kernels at load (with g++ on the CPU backend, seconds on a fresh kernel cache) rather than
during the first user's request. Nothing is left behind: the requests keep no prefix entry.
"""

from __future__ import annotations

from typing import Protocol

from engine.errors import EngineInvariantError
from protocols.api import SamplingParams
from protocols.model import AdmitRequest, PrefillWork, StepOutcome, StepPlan


class Steps(Protocol):
    """What the warm-up drives (`engine.engine.Engine`)."""

    @property
    def num_requests(self) -> int: ...

    def step(self, plan: StepPlan) -> StepOutcome: ...


def run_warm_up(engine: Steps, vocab_size: int) -> None:
    """Two throwaway requests through admission, a batched prefill and decode to their end."""
    prompt = [i % vocab_size for i in range(1, 9)]
    admits = [
        AdmitRequest(
            request_id=f"warm-up-{i}", prompt_ids=prompt, max_tokens=3 + 2 * i, sampling=SamplingParams(), seed=0, stop_token_ids=[], save_prefix=False
        )
        for i in range(2)
    ]
    engine.step(StepPlan(admit=admits))
    engine.step(StepPlan(prefill=[PrefillWork(request_id=a.request_id, num_tokens=len(prompt) - 1) for a in admits], decode=True))
    for _ in range(16):  # two rows, then the longer one alone (the lone-row step)
        if not engine.num_requests:
            break
        engine.step(StepPlan(decode=True))
    engine.step(StepPlan(release=[a.request_id for a in admits]))
    if engine.num_requests:
        raise EngineInvariantError("the warm-up requests did not finish")
