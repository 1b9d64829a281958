"""Fast-forward plans and sessions without a model: rows, clamps, echo, the tool-call guard."""

from __future__ import annotations

import pytest

from policies.fill_plan import compile_plan, echo_refusal, refusal
from policies.fill_session import EchoSource, FillSession
from protocols import FillStats, GenerateRequest, SamplingParams
from protocols.model import FillPlan
from tests.support.mlx_reference import load_reference
from tests.support.tool_schemas import CLOCK, WEATHER

MESSAGES = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_reference("builtin:tiny")[1]


def _plan(tokenizer, tools, mode="strict"):
    request = GenerateRequest(messages=MESSAGES, tools=tools, fill=mode)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False))
    return compile_plan(request, mode, tokenizer, prompt, [0], max_span=32, echo_k=4, trace_path=None)[0]


@pytest.mark.parametrize("tools", [[WEATHER], [WEATHER, CLOCK]], ids=["one", "two"])
def test_rows_are_slices_of_the_rendered_call(tokenizer, tools):
    plan = _plan(tokenizer, tools)
    kinds = {row.kind for row in plan.rows}
    assert "scaffold" in kinds and (len(tools) == 1 or "name" in kinds)
    for tool in tools:
        call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": tool["function"]["name"], "arguments": {}}}]}
        rendered = tokenizer.apply_chat_template([*MESSAGES, call], tools=tools, tokenize=False)
        assert "<tool_call>" in rendered
    for row in plan.rows:
        text = tokenizer.decode(row.trigger + row.emit)
        assert len(row.emit) >= 2
        if row.kind != "close":
            assert text.startswith('<tool_call>\n{"name": "get_')
        else:
            assert text.endswith("}\n</tool_call>")


def _session(rows=(), eos=(99,), delimiters=(), echo_k=0, prompt=(1, 2, 3), max_span=32):
    plan = FillPlan(mode="echo" if echo_k else "strict", rows=list(rows), eos=list(eos), delimiters=list(delimiters), max_span=max_span, echo_k=echo_k)
    return FillSession(plan, FillStats(mode=plan.mode), list(prompt), decode=lambda ids: "")


def test_echo_copies_the_nearest_earlier_continuation():
    source = EchoSource(k=2, max_span=4, max_candidates=8, history=[5, 6, 7, 8, 5, 6, 9, 10, 11])
    source.observe([5, 6])
    assert source.propose(limit=4).ids[:4] == [9, 10, 11, 5]
    assert source.propose(limit=2).ids == [9, 10, 11]  # one past the limit: the clamp sees the cut
    assert EchoSource(k=2, max_span=4, max_candidates=8, history=[1, 2, 3]).propose(limit=4) is None


def test_clamps_cut_at_eos_delimiter_span_and_budget():
    history = [1, 2, 3, 4, 5, 99, 7, 1, 2]
    session = _session(eos=[99], echo_k=2, prompt=history)
    assert session.propose(budget=10).ids == [3, 4, 5]  # cut before the end-of-sequence id
    session = _session(eos=[], delimiters=[4], echo_k=2, prompt=history)
    assert session.propose(budget=10).ids == [3, 4]  # ends at a delimiter, never past it
    session = _session(eos=[], echo_k=2, prompt=history, max_span=3)
    assert session.propose(budget=10).ids == [3, 4, 5]
    assert session.propose(budget=2).ids == [3, 4]
    assert session.propose(budget=1) is None  # a one-token span saves nothing
    assert session.snapshot().truncated == 2


def test_commit_counts_what_was_emitted():
    session = _session(echo_k=2, prompt=[1, 2, 3, 4, 1, 2], eos=[])
    proposal = session.propose(budget=10)
    session.commit(proposal, 2)
    stats = session.snapshot()
    assert (stats.events, stats.echo, stats.verify_accepted, stats.verify_rejected, stats.span_lens) == (1, 2, 2, len(proposal.ids) - 2, [2])


def test_echo_spans_grow_while_taken_whole_and_shrink_when_not():
    session = _session(echo_k=2, prompt=[1, 2, *list(range(10, 90)), 1, 2], eos=[])
    first = session.propose(budget=100)
    assert first.ids == list(range(10, 18))
    session.commit(first, len(first.ids))
    for token in (18, 19):
        session.observe(token)
    second = session.propose(budget=100)
    assert second.ids == list(range(20, 36))
    session.commit(second, 3)
    for token in (23, 24):
        session.observe(token)
    assert session.propose(budget=100).ids == list(range(25, 33))


def test_strict_rows_need_their_trigger_and_the_tool_call_context(tokenizer):
    plan = _plan(tokenizer, [WEATHER])
    scaffold = next(r for r in plan.rows if r.kind == "scaffold")
    session = FillSession(plan, FillStats(mode="strict"), [1, 2], tokenizer.decode)
    for token in scaffold.trigger:
        session.observe(token)
    proposal = session.propose(budget=100)
    assert proposal.ids == scaffold.emit and proposal.policy == "assert"
    # The same marker after prose is not a tool-only turn: no row fires.
    session = FillSession(plan, FillStats(mode="strict"), [1, 2], tokenizer.decode)
    for token in tokenizer.encode("Sure, here: ") + scaffold.trigger:
        session.observe(token)
    assert session.propose(budget=100) is None


def test_refusals():
    assert "grammar" in refusal(GenerateRequest(prompt="x"), "json_schema")
    assert refusal(GenerateRequest(prompt="x"), "tool_call") is None
    assert "logprobs" in refusal(GenerateRequest(prompt="x", top_logprobs=2), None)
    assert "temperature" in echo_refusal(GenerateRequest(prompt="x", sampling=SamplingParams(temperature=0.5)))
    assert "penalties" in echo_refusal(GenerateRequest(prompt="x", sampling=SamplingParams(repetition_penalty=1.1)))
    assert echo_refusal(GenerateRequest(prompt="x")) is None


def test_prose_disarms_the_rows_for_the_rest_of_the_output(tokenizer):
    """Once the output is not a tool-only turn it never becomes one: no more decoding per trigger."""
    plan = _plan(tokenizer, [WEATHER])
    scaffold = next(r for r in plan.rows if r.kind == "scaffold")
    decodes = []

    def decode(ids):
        decodes.append(len(ids))
        return tokenizer.decode(ids)

    session = FillSession(plan, FillStats(mode="strict"), [1, 2], decode)
    for token in tokenizer.encode("Plain prose first. ") + scaffold.trigger:
        session.observe(token)
    assert session.propose(budget=100) is None
    calls = len(decodes)
    for token in scaffold.trigger * 3:
        session.observe(token)
        assert session.propose(budget=100) is None
    assert len(decodes) == calls
