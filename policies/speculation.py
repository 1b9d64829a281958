"""Speculative decoding decisions (pure): who speculates, how far, and what it did.

A speculating row proposes up to k tokens (from a draft model, or from an earlier place in
its own context that ends like it: prompt lookup); one target forward checks them, the
row keeps a prefix and gets one more token from the target. This module decides:

- `plan_speculation`: whether a request speculates at all (and with what), from the runtime
  config and the request's own fields;
- `SpecRow`: one request's draft length, adapted to its acceptance: the k that maximizes
  expected tokens per unit of cost, where a round of k drafted tokens costs
  `1 + round_overhead + k * token_cost` plain steps (a plain step is pipelined, a round waits
  for its drafts and for its check) and keeps each token with probability alpha; 0 pauses
  drafting for a while, after which the row probes again;
- `SpeculationGate`: whether a batch of n rows speculates at all (a big batch's verify forward
  costs more than it saves on this machine: the crossover is measured, see docs/benchmarks/log.md);
- `LookupSource`: prompt-lookup drafts (the continuation of the nearest earlier occurrence of
  the context's last n tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, cast

from policies.fill_session import EchoSource
from protocols.api import GenerateRequest, SpecStats
from protocols.config import SpeculativeConfig
from protocols.errors import InvalidRequestError
from protocols.model import SpecPlan

ACCEPTANCES = ("exact", "rejection")
# Plain steps a row waits after its adaptive k fell to 0 before it probes with k = 1.
PROBE_AFTER = 16
# Prompt-lookup steps in a row without a proposal before the row pauses like a rejected one.
MISSES_BEFORE_PAUSE = 4
# How fast old rounds fade from the acceptance estimate (per round), and the prior it starts
# from (alpha 0.6, worth two rounds).
DECAY = 0.8
PRIOR_KEPT, PRIOR_REJECTED = 1.2, 0.8
# The batch size above which speculation costs more than it saves on this machine's CPU
# backend: with the gate lifted, bench-spec gave 1.47x at 2 streams, 1.36x at 4, 1.23x at 8,
# 0.97x at 16 (`mlxrt bench --speculative`, docs/benchmarks/log.md); `speculative.max_batch` overrides it.
MEASURED_MAX_BATCH = 8
# Lookup proposals: candidates kept per anchor.
LOOKUP_CANDIDATES = 8


def plan_speculation(request: GenerateRequest, config: SpeculativeConfig, has_draft: bool) -> tuple[SpecPlan | None, SpecStats | None]:
    """A request's speculation plan, or None; with the stats a refused request reports.

    With a draft model configured, requests speculate unless they opt out; with
    `speculative.lookup`, by prompt lookup. A request that asks for speculation
    (`speculative=True`) where neither is configured gets prompt lookup. A request that wants
    log-probabilities, or has logits controls (`logit_bias`, `min_tokens`, `allowed_token_ids`,
    `bad_words`), does not speculate (a refusal in its `Finished.spec`)."""
    if request.acceptance is not None and request.acceptance not in ACCEPTANCES:
        raise InvalidRequestError(f"acceptance must be one of {', '.join(ACCEPTANCES)}, got {request.acceptance!r}", field="acceptance")
    if request.speculative is False or not (has_draft or config.lookup or request.speculative):
        return None, None
    method: Literal["draft", "lookup"] = "draft" if has_draft else "lookup"
    acceptance = cast(Literal["exact", "rejection"], request.acceptance or config.acceptance)
    if request.logprobs or request.top_logprobs:
        return None, SpecStats(method=method, acceptance=acceptance, refused="logprobs: a kept draft token's distribution is not reported")
    if request.sampling.has_logit_controls:
        reason = "logit_bias, min_tokens, allowed_token_ids or bad_words: drafts are not checked under the request's logits processing"
        return None, SpecStats(method=method, acceptance=acceptance, refused=reason)
    plan = SpecPlan(
        method=method,
        acceptance=acceptance,
        max_draft=config.max_draft_tokens if method == "draft" else config.lookup_max_draft_tokens,
        lookup_anchor=config.lookup_anchor,
        adaptive=config.adaptive,
    )
    return plan, SpecStats(method=method, acceptance=acceptance)


@dataclass
class SpecRow:
    """One request's adaptive draft length and its figures."""

    plan: SpecPlan
    # A drafted token's cost in plain target steps (drafting it and checking it).
    token_cost: float
    # A round's cost beyond a plain step's, whatever it drafts (in plain target steps).
    round_overhead: float = 0.0
    # Decayed counts of kept drafts and of rejections (the estimate's evidence).
    kept: float = PRIOR_KEPT
    rejections: float = PRIOR_REJECTED
    k: int = 0
    paused_for: int = 0
    # Set by the batch gate each step: the batch is too big to speculate in.
    gated: bool = False
    # Prompt lookup: steps in a row that found nothing to propose.
    misses: int = 0
    _by_position: list[int] = field(default_factory=list)
    _counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.k = self.plan.max_draft
        self._by_position = [0] * self.plan.max_draft
        self._counts = {"rounds": 0, "drafted": 0, "accepted": 0, "generated": 0, "target_forwards": 0}

    def draft_length(self, budget: int) -> int:
        """How many tokens to draft this step (`budget`: tokens the request may still add
        after the one the target samples). 0 while paused."""
        if self.paused_for > 0:
            self.paused_for -= 1
            return 0
        return max(0, min(self.k, budget))

    @property
    def alpha(self) -> float:
        """The estimated chance that a draft token is kept."""
        return self.kept / (self.kept + self.rejections)

    @property
    def drafts_next(self) -> bool:
        """Whether the next step may draft for this row (its pending token is then read before
        that step is built: a draft continues the whole context)."""
        return not self.gated and self.paused_for == 0

    def record_miss(self) -> None:
        """Prompt lookup found nothing to propose: after a few such steps in a row, pause
        (so a row that never repeats itself keeps the pipelined decode)."""
        self.misses += 1
        if self.misses >= MISSES_BEFORE_PAUSE and self.plan.adaptive:
            self.misses, self.paused_for = 0, PROBE_AFTER

    def record_round(self, drafted: int, accepted: int) -> None:
        """A round's outcome: `accepted` of `drafted` kept, then one target token."""
        c = self._counts
        self.misses = 0
        c["rounds"] += 1
        c["drafted"] += drafted
        c["accepted"] += accepted
        for i in range(min(accepted, len(self._by_position))):
            self._by_position[i] += 1
        if drafted and self.plan.adaptive:
            # Each draft is kept with probability alpha until one is rejected: the estimate is
            # kept / (kept + rejections), a round without a rejection adding none (censored).
            self.kept = DECAY * self.kept + accepted
            self.rejections = DECAY * self.rejections + (accepted < drafted)
        if not self.plan.adaptive:
            return
        self.k = best_draft_length(self.alpha, self.token_cost, self.plan.max_draft, self.round_overhead)
        if self.k == 0:
            self.k, self.paused_for = 1, PROBE_AFTER

    def record_step(self, generated: int) -> None:
        """A target forward of this row produced `generated` tokens (a plain step: 1)."""
        self._counts["generated"] += generated
        self._counts["target_forwards"] += 1

    def snapshot(self) -> SpecStats:
        c = self._counts
        return SpecStats(
            method=self.plan.method,
            acceptance=self.plan.acceptance,
            rounds=c["rounds"],
            drafted=c["drafted"],
            accepted=c["accepted"],
            rejected=c["drafted"] - c["accepted"],
            accepted_by_position=list(self._by_position),
            generated=c["generated"],
            target_forwards=c["target_forwards"],
        )


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of k drafts yields when each is kept with probability `alpha`: the kept
    prefix plus the target's own token."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_draft_length(alpha: float, token_cost: float, max_draft: int, round_overhead: float = 0.0) -> int:
    """The k in [0, max_draft] with the most tokens per plain step of cost (0: do not draft,
    a plain step; a round of k >= 1 costs `1 + round_overhead + k * token_cost`)."""
    rates = [1.0] + [expected_tokens(alpha, k) / (1.0 + round_overhead + k * token_cost) for k in range(1, max_draft + 1)]
    return max(range(max_draft + 1), key=lambda k: (rates[k], -k))


@dataclass(frozen=True)
class SpeculationGate:
    """Whether a batch of `num_rows` decoding rows speculates this step."""

    max_batch: int = MEASURED_MAX_BATCH

    def allows(self, num_rows: int) -> bool:
        return num_rows <= self.max_batch


class LookupSource:
    """Prompt lookup: after the context's last `anchor` tokens, propose what followed their
    nearest earlier occurrence."""

    def __init__(self, anchor: int, max_draft: int, context: list[int]):
        self._source = EchoSource(anchor, max_draft, LOOKUP_CANDIDATES, context)

    def observe(self, tokens: list[int]) -> None:
        self._source.observe(tokens)

    def propose(self, limit: int) -> list[int]:
        if limit <= 0:
            return []
        proposal = self._source.propose(limit)
        return list(proposal.ids[:limit]) if proposal is not None else []
