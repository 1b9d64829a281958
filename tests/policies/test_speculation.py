"""Speculation decisions: who speculates, how far, when the batch is too big, lookup drafts."""

from __future__ import annotations

import pytest

from policies.speculation import (
    MEASURED_MAX_BATCH,
    MISSES_BEFORE_PAUSE,
    PROBE_AFTER,
    LookupSource,
    SpecRow,
    SpeculationGate,
    best_draft_length,
    expected_tokens,
    plan_speculation,
)
from protocols.api import GenerateRequest
from protocols.config import SpeculativeConfig
from protocols.errors import InvalidRequestError
from protocols.model import SpecPlan

REQUEST = GenerateRequest(prompt_ids=[1, 2, 3])


def test_expected_tokens_per_round():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_draft_length_follows_acceptance_and_cost():
    # Cheap drafts that agree: draft as far as allowed; costly or disagreeing ones: not at all.
    assert best_draft_length(0.9, 0.05, 8) == 8
    assert best_draft_length(0.2, 0.5, 8) == 0
    assert best_draft_length(0.9, 1.06, 8) == 0, "a draft as big as the target never pays"
    lengths = [best_draft_length(alpha, 0.2, 8) for alpha in (0.3, 0.5, 0.7, 0.8, 0.9)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_a_rounds_fixed_cost_favours_longer_drafts_or_none():
    # A round waits for its drafts and its check: that fixed part is paid once per round, so
    # it is amortized over longer drafts, and a row whose drafts are rarely kept stops.
    free, fixed = best_draft_length(0.85, 0.19, 8), best_draft_length(0.85, 0.19, 8, round_overhead=0.18)
    assert fixed > free
    assert best_draft_length(0.35, 0.19, 8) > 0
    assert best_draft_length(0.35, 0.19, 8, round_overhead=0.18) == 0


def test_a_row_adapts_pauses_and_probes_again():
    row = SpecRow(SpecPlan(method="draft", max_draft=6), token_cost=0.15)
    assert row.draft_length(budget=100) == 6
    for _ in range(8):
        row.record_round(drafted=6, accepted=6)
    assert row.k == 6 and row.alpha > 0.85
    rejected = 0
    while not row.paused_for:
        rejected += row.k
        row.record_round(drafted=row.k, accepted=0)
    assert row.paused_for == PROBE_AFTER and not row.drafts_next
    assert [row.draft_length(budget=100) for _ in range(PROBE_AFTER)] == [0] * PROBE_AFTER
    assert row.drafts_next and row.draft_length(budget=100) == 1, "after the pause it probes with one token"
    assert row.draft_length(budget=0) == 0, "never past max_tokens"
    stats = row.snapshot()
    assert stats.drafted == 48 + rejected and stats.accepted == 48 and stats.rejected == rejected
    assert stats.accepted_by_position == [8] * 6


def test_a_fixed_row_always_drafts_its_maximum():
    row = SpecRow(SpecPlan(method="draft", max_draft=4, adaptive=False), token_cost=0.15)
    for _ in range(20):
        row.record_round(drafted=4, accepted=0)
    assert row.k == 4 and row.paused_for == 0 and row.draft_length(budget=100) == 4


def test_lookup_misses_pause_the_row():
    row = SpecRow(SpecPlan(method="lookup"), token_cost=0.06)
    for _ in range(MISSES_BEFORE_PAUSE - 1):
        row.record_miss()
    assert row.paused_for == 0
    row.record_miss()
    assert row.paused_for == PROBE_AFTER


def test_the_gate_is_the_measured_crossover_unless_configured():
    assert SpeculationGate().allows(MEASURED_MAX_BATCH) and not SpeculationGate().allows(MEASURED_MAX_BATCH + 1)
    assert SpeculationGate(16).allows(16) and not SpeculationGate(2).allows(3)
    row = SpecRow(SpecPlan(method="draft"), token_cost=0.1)
    row.gated = True
    assert not row.drafts_next, "a gated row keeps its pipelined decode"


def test_who_speculates():
    draft = SpeculativeConfig(draft="builtin:tiny-spec-draft")
    plan, stats = plan_speculation(REQUEST, draft, has_draft=True)
    assert plan is not None and plan.method == "draft" and plan.acceptance == "exact" and stats is not None
    assert plan_speculation(GenerateRequest(prompt_ids=[1], speculative=False), draft, has_draft=True) == (None, None)
    plan, _ = plan_speculation(GenerateRequest(prompt_ids=[1], acceptance="rejection"), draft, has_draft=True)
    assert plan is not None and plan.acceptance == "rejection"
    # Nothing configured: no speculation, unless asked for, which gets prompt lookup.
    assert plan_speculation(REQUEST, SpeculativeConfig(), has_draft=False) == (None, None)
    plan, _ = plan_speculation(GenerateRequest(prompt_ids=[1], speculative=True), SpeculativeConfig(), has_draft=False)
    assert plan is not None and plan.method == "lookup"
    # Each method's own longest draft: prompt lookup's proposals cost nothing to make.
    config = SpeculativeConfig(lookup=True, max_draft_tokens=3, lookup_max_draft_tokens=11)
    assert (plan := plan_speculation(REQUEST, config, has_draft=True)[0]) is not None and plan.max_draft == 3
    assert (plan := plan_speculation(REQUEST, config, has_draft=False)[0]) is not None and plan.max_draft == 11
    # Log-probabilities: decoded plainly, the reason reported.
    plan, stats = plan_speculation(GenerateRequest(prompt_ids=[1], logprobs=True), draft, has_draft=True)
    assert plan is None and stats is not None and stats.refused is not None
    with pytest.raises(InvalidRequestError) as info:
        plan_speculation(GenerateRequest(prompt_ids=[1], acceptance="maybe"), draft, has_draft=True)
    assert info.value.field == "acceptance"


def test_lookup_proposes_what_followed_the_anchor():
    source = LookupSource(anchor=2, max_draft=4, context=[5, 6, 7, 8, 9, 1, 5, 6])
    assert source.propose(3) == [7, 8, 9]
    assert source.propose(0) == []
    source.observe([7, 8])
    assert source.propose(4)[:2] == [9, 1]
