"""The engine driven directly with plans, as the scheduler would drive it (no actors).

`Driver` admits requests, then plans chunked prefill (`chunk` tokens a step) and a decode every
step until each request finishes, collecting tokens, finish reasons and saved prefixes.
`admit_request` builds an `AdmitRequest` with greedy sampling; `random_prompts` seeded prompts.
"""

from __future__ import annotations

import random

from engine.engine import Engine
from protocols.api import SamplingParams
from protocols.model import AdmitRequest, PrefillWork, StepPlan

CHUNK = 8


def admit_request(rid: str, prompt: list[int], max_tokens: int = 12, stop: list[int] | None = None, **kw) -> AdmitRequest:
    return AdmitRequest(request_id=rid, prompt_ids=prompt, max_tokens=max_tokens, sampling=SamplingParams(), seed=0, stop_token_ids=stop or [], **kw)


def random_prompts(lengths: list[int]) -> list[list[int]]:
    """Prompts of these lengths, token ids below 1000 (the same for the same lengths)."""
    rng = random.Random(3)
    return [[rng.randrange(1000) for _ in range(n)] for n in lengths]


class Driver:
    """Plans like the scheduler does: chunked prefill, then decode every step."""

    def __init__(self, engine: Engine, chunk: int = CHUNK):
        self.engine = engine
        self.chunk = chunk
        self.left: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.saved = []

    def admit(self, *admits: AdmitRequest) -> None:
        for a in admits:
            self.left[a.request_id] = len(a.prompt_ids) - 1
            self.tokens[a.request_id] = []
        self.step(StepPlan(admit=list(admits)))

    def plan(self, release: list[str] = ()) -> StepPlan:
        work = []
        for rid, left in self.left.items():
            if left > 0 and rid not in release:
                n = min(self.chunk, left)
                self.left[rid] -= n
                work.append(PrefillWork(request_id=rid, num_tokens=n))
        return StepPlan(release=list(release), prefill=work, decode=True)

    def step(self, plan: StepPlan):
        outcome = self.engine.step(plan)
        for row in outcome.outputs:
            self.tokens[row.request_id] += row.token_ids
            if row.finish_reason:
                self.finish[row.request_id] = row.finish_reason
        for rid in outcome.released:
            self.left.pop(rid, None)
        self.saved += outcome.saved_prefixes
        return outcome

    def assert_only_prefixes_remain(self) -> None:
        """Every request's KV is gone except the prefix entries it left, which drop cleanly."""
        assert self.engine.kv_tokens() == {}
        assert self.engine.kv_bytes() == sum(e.num_bytes for e in self.saved)
        self.engine.drop_prefixes([e.entry_id for e in self.saved])
        assert self.engine.kv_bytes() == 0

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if all(rid in self.finish or rid not in self.left for rid in self.tokens):
                return
            self.step(self.plan())
        raise AssertionError("did not finish")
