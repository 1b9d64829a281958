"""Event streams collected: every event of a `generate` stream, or of several submitted together.

Works with anything whose `generate` yields the API's events: a `Runtime`, a `ModelPool`, a
socket `Client`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from protocols.api import DenoiseProgress, Finished, PrefillProgress, TokenDelta


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    events: list = field(default_factory=list)

    @property
    def last(self) -> Finished:
        assert len(self.finished) == 1, f"expected exactly one Finished, got {self.finished}"
        assert self.events[-1] is self.finished[0], "Finished must be the last event"
        return self.finished[0]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenDelta))


async def collect(events) -> Outcome:
    """Every event of a stream, tokens concatenated."""
    outcome = Outcome()
    async for event in events:
        outcome.events.append(event)
        if isinstance(event, TokenDelta):
            outcome.tokens += event.token_ids
        elif isinstance(event, Finished):
            outcome.finished.append(event)
        else:
            assert isinstance(event, (PrefillProgress, DenoiseProgress)), event
    return outcome


async def collect_all(generate, requests: list) -> list[Outcome]:
    """The streams of `requests` submitted together through `generate` (a runtime's, a pool's or
    a client's), in request order."""
    outcomes: list[Outcome] = [Outcome() for _ in requests]

    async def one(i: int) -> None:
        outcomes[i] = await collect(generate(requests[i]))

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return outcomes
