"""The seeds' step semantics, driven on the engine directly: when a step is read, what a
request's own failure ends, when a checkpoint that falls due is taken, and grammar ends."""

from __future__ import annotations

import json

import pytest

from engine.engine import Engine
from engine.kv.layout import probe_layout
from protocols.api import SamplingParams
from protocols.model import AdmitRequest, GrammarSpec, PrefillWork, StepPlan
from runtime.grammar import GrammarCache
from tests.support.mlx_reference import greedy_tokens, load_reference


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_reference("builtin:tiny")


@pytest.fixture(scope="module")
def grammars(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    return GrammarCache(tokenizer, 1024, list(tokenizer.eos_token_ids))


def make_engine(model_and_tokenizer, grammars=None) -> Engine:
    model, tokenizer = model_and_tokenizer
    return Engine(model, probe_layout(model), grammars, tokenizer.decode)


def admit(rid: str, prompt: list[int], max_tokens: int = 16, **kw) -> AdmitRequest:
    kw.setdefault("stop_token_ids", [])
    return AdmitRequest(request_id=rid, prompt_ids=prompt, max_tokens=max_tokens, sampling=SamplingParams(), seed=0, **kw)


def start(engine: Engine, *admits: AdmitRequest, **plan):
    """Admit, prefill every prompt whole and decode, in one step (as the scheduler would)."""
    work = [PrefillWork(request_id=a.request_id, num_tokens=len(a.prompt_ids) - 1) for a in admits if len(a.prompt_ids) > 1]
    return engine.step(StepPlan(admit=list(admits), prefill=work, decode=True, **plan))


def tokens_of(outcome, rid: str) -> list[int]:
    return [t for row in outcome.outputs if row.request_id == rid for t in row.token_ids]


# -- early token zero --------------------------------------------------------------------


def test_a_one_token_prompt_gets_its_first_token_in_the_step_it_joins(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = make_engine(model_and_tokenizer)
    outcome = engine.step(StepPlan(admit=[admit("one", [42])], decode=True))
    assert tokens_of(outcome, "one") == greedy_tokens(model, tokenizer, [42], 1)


def test_a_prefix_hit_that_leaves_one_token_gets_its_first_token_at_once(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = make_engine(model_and_tokenizer)
    prompt = list(range(5, 25))
    engine.step(StepPlan(admit=[admit("first", prompt, max_tokens=2)], prefill=[PrefillWork(request_id="first", num_tokens=19)], decode=True))
    outcome = engine.step(StepPlan(decode=True))
    while not any(row.finish_reason for row in outcome.outputs):
        outcome = engine.step(StepPlan(decode=True))
    [entry] = [e for e in outcome.saved_prefixes if len(e.tokens) >= len(prompt) - 1]
    hit = admit("hit", prompt, prefix_entry=entry.entry_id, prefix_tokens=len(prompt) - 1)
    outcome = engine.step(StepPlan(admit=[hit], decode=True))
    assert tokens_of(outcome, "hit") == greedy_tokens(model, tokenizer, prompt, 1)


# -- what makes a step be read before the next is built -------------------------------------

OBJECT = GrammarSpec(kind="json_object")


def test_a_grammar_row_does_not_make_the_batch_synchronous(model_and_tokenizer, grammars):
    engine = make_engine(model_and_tokenizer, grammars)
    import anyio

    anyio.run(grammars.acquire, OBJECT)
    start(engine, admit("free", [3, 4, 5], max_tokens=30), admit("json", [6, 7, 8], max_tokens=30, grammar=OBJECT))
    for _ in range(3):
        engine.step(StepPlan(decode=True))
        # The grammar row's token was read before the step was built; the new step stays in flight.
        assert engine._in_flight is not None and len(engine._in_flight.rows) == 2


def test_a_plain_batch_stays_pipelined_across_steps(model_and_tokenizer):
    engine = make_engine(model_and_tokenizer)
    first = start(engine, admit("a", [3, 4, 5]), admit("b", [6, 7]))
    assert len(first.outputs) == 2 and engine._in_flight is None  # first tokens: read at once
    engine.step(StepPlan(decode=True))
    outcome = engine.step(StepPlan(decode=True))
    # Each step returns the previous step's tokens while its own stays in flight.
    assert engine._in_flight is not None and len(outcome.outputs) == 2


# -- a failure of one request ends that request only ----------------------------------------


class _BrokenMatcher:
    """Fills masks for a while, then fails (as a corrupt grammar state would)."""

    def __init__(self, inner, fail_after: int):
        self._inner, self._left = inner, fail_after

    def fill_next_token_bitmask(self, bitmask, index):
        self._left -= 1
        if self._left < 0:
            raise RuntimeError("matcher state is corrupt")
        return self._inner.fill_next_token_bitmask(bitmask, index)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Grammars:
    vocab_size = 1024

    def __init__(self, cache: GrammarCache):
        self._cache = cache

    def matcher(self, spec):
        return _BrokenMatcher(self._cache.matcher(spec), fail_after=3)


def test_a_failing_grammar_ends_its_request_with_error_and_the_batch_goes_on(model_and_tokenizer, grammars):
    model, tokenizer = model_and_tokenizer
    import anyio

    anyio.run(grammars.acquire, OBJECT)
    engine = make_engine(model_and_tokenizer, _Grammars(grammars))
    prompt = [11, 12, 13, 14]
    free = admit("free", prompt, max_tokens=12, stop_token_ids=sorted(tokenizer.eos_token_ids))
    outcome = start(engine, free, admit("broken", [6, 7, 8], max_tokens=12, grammar=OBJECT))
    tokens, finishes = {"free": tokens_of(outcome, "free"), "broken": []}, {}
    for _ in range(40):
        if len(finishes) == 2:
            break
        outcome = engine.step(StepPlan(decode=True))
        for row in outcome.outputs:
            tokens[row.request_id] += row.token_ids
            if row.finish_reason:
                finishes[row.request_id] = (row.finish_reason, row.error)
    assert finishes["broken"][0] == "error" and "corrupt" in finishes["broken"][1]
    assert finishes["free"][0] in ("length", "stop") and finishes["free"][1] is None
    assert tokens["free"] == greedy_tokens(model, tokenizer, prompt, 12)


# -- checkpoints that fall due while known tokens wait -------------------------------------------

FORCED = GrammarSpec(kind="json_schema", source=json.dumps({"type": "object", "properties": {"answer_text": {"type": "string"}}, "required": ["answer_text"]}))


def test_a_checkpoint_due_while_known_tokens_wait_is_taken_at_the_next_chance(model_and_tokenizer, grammars):
    import anyio

    anyio.run(grammars.acquire, FORCED)
    engine = make_engine(model_and_tokenizer, grammars)
    request = admit("jf", [20, 21, 22], max_tokens=40, grammar=FORCED, jump_forward=True)
    outcome = start(engine, request, checkpoint=["jf"])
    first = tokens_of(outcome, "jf")
    # The first token opens the object and the grammar forces the key: known tokens wait.
    assert len(first) > 2 and outcome.checkpoints == []
    tokens, taken = list(first), []
    for _ in range(3):  # once the known tokens are forwarded and the next token read
        outcome = engine.step(StepPlan(decode=True))
        tokens += tokens_of(outcome, "jf")
        taken += outcome.checkpoints
        if taken:
            break
    [checkpoint] = taken
    assert checkpoint.generated == tokens and checkpoint.num_kv_tokens == 3 + len(tokens) - 1


# -- a terminated grammar ends its row -----------------------------------------------------------


class _TerminatingMatcher(_BrokenMatcher):
    """Says the grammar is complete after a few tokens, none of them a stop token."""

    def __init__(self, inner, after: int):
        super().__init__(inner, fail_after=10**9)
        self._accepted, self._after = 0, after

    def accept_token(self, token):
        self._accepted += 1
        return True

    def fill_next_token_bitmask(self, bitmask, index):
        return None  # everything allowed

    def is_terminated(self):
        return self._accepted >= self._after


class _Terminating(_Grammars):
    def matcher(self, spec):
        return _TerminatingMatcher(self._cache.matcher(spec), after=4)


def test_once_a_grammar_has_terminated_no_further_step_is_built_for_its_row(model_and_tokenizer, grammars):
    import anyio

    anyio.run(grammars.acquire, OBJECT)
    engine = make_engine(model_and_tokenizer, _Terminating(grammars))
    outcome = start(engine, admit("done", [6, 7, 8], max_tokens=30, grammar=OBJECT))
    tokens, finish = tokens_of(outcome, "done"), None
    for _ in range(10):
        for row in outcome.outputs:
            finish = finish or row.finish_reason
        if finish:
            break
        outcome = engine.step(StepPlan(decode=True))
        tokens += tokens_of(outcome, "done")
    assert finish == "stop" and len(tokens) == 4
    assert engine.kv_tokens() == {}
