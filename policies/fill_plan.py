"""Token fast-forwarding ("fill"), the plan: what a request may append without sampling.

`compile_plan` (runtime side, a worker thread: it renders chat templates) turns a request
into a `FillPlan`: strict rows sliced out of a full chat-template rendering of a call of
each of the request's tools (never encoded in isolation), the echo settings and the
clamps. `refusal` says why a request cannot fast-forward at all, as the seeds refuse it.
The per-request state that applies the plan is `policies.fill_session`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from policies.tools import tool_function
from protocols.api import FillStats, GenerateRequest
from protocols.errors import InvalidRequestError
from protocols.model import FillPlan, FillRow

MODES = ("off", "strict", "echo")
# Placeholder argument values rendered into the template to find where a value ends.
_PLACEHOLDERS = {"string": "qzxplaceholder", "integer": 7, "number": 7, "boolean": True}


def resolve_mode(request: GenerateRequest, default: str) -> str:
    mode = request.fill if request.fill is not None else default
    if mode not in MODES:
        raise InvalidRequestError(f"fill must be one of {', '.join(MODES)}, got {mode!r}", field="fill")
    return mode


def refusal(request: GenerateRequest, grammar_kind: str | None) -> str | None:
    """Why fast-forwarding cannot run for this request at all (as the seeds refuse it).

    A forced tool call's grammar is the exception: strict rows then replace its
    jump-forward, and it checks every token they append.
    """
    if grammar_kind is not None and grammar_kind != "tool_call":
        return "a grammar produces the forced tokens of this request (jump-forward)"
    if request.logprobs or request.top_logprobs:
        return "logprobs: appended tokens are not sampled and have no distribution"
    if request.sampling.has_logit_controls:
        return "logit_bias, min_tokens, allowed_token_ids or bad_words: appended tokens are not sampled, so they would bypass them"
    if request.sampling.seed is not None and request.sampling.temperature > 0:
        return "an explicit seed at temperature > 0: appended tokens bypass the seeded sampler, so the seed would not reproduce the output"
    return None


def echo_refusal(request: GenerateRequest) -> str | None:
    s = request.sampling
    if s.temperature != 0.0:
        return "echo spans are verified against greedy choices: temperature must be 0"
    if s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0:
        return "echo spans are verified against raw greedy choices: penalties are set"
    return None


def compile_plan(
    request: GenerateRequest,
    mode: str,
    tokenizer: Any,
    prompt_ids: list[int],
    eos_ids: list[int],
    *,
    max_span: int,
    echo_k: int,
    trace_path: str | None,
) -> tuple[FillPlan, FillStats]:
    """The request's fill plan and its initial stats (blocking: renders the chat template)."""
    markers = (tokenizer.tool_call_start, tokenizer.tool_call_end) if getattr(tokenizer, "has_tool_calling", False) else None
    think = (tokenizer.think_start, tokenizer.think_end) if getattr(tokenizer, "has_thinking", False) else None
    tools = [tool_function(tool) for tool in request.tools or []]
    rows: list[FillRow] = []
    delimiters: list[int] = []
    if tools and request.tool_choice != "none":
        if markers is None:
            raise InvalidRequestError("this model's chat template has no tool-call format to fast-forward", field="tools")
        if request.messages is not None and request.tools is not None:
            rows, delimiters = _strict_rows(tokenizer, request.messages, request.tools, tools, markers)
    echo, echo_refused = mode == "echo", None
    if echo and request.tool_choice not in (None, "auto", "none"):
        echo_refused = "a forced tool call's grammar allows strict rows only"
    elif echo:
        echo_refused = echo_refusal(request)
    echo = echo and echo_refused is None
    prompt_text = tokenizer.decode(prompt_ids[-64:])
    plan = FillPlan(
        mode=mode,
        rows=rows,
        eos=list(eos_ids),
        delimiters=delimiters,
        max_span=max_span,
        echo_k=echo_k if echo else 0,
        echo_refused=echo_refused,
        tools=tools,
        tool_markers=markers,
        think_markers=think,
        starts_in_reasoning=think is not None and re.search(re.escape(think[0]) + r"\s*$", prompt_text) is not None,
        trace_path=trace_path or None,
    )
    return plan, FillStats(mode=mode, echo_refused=echo_refused)


def single_required(parameters: dict) -> tuple[str, Any] | None:
    """The one required argument of a tool, and a placeholder of its type (None if not one)."""
    required = parameters.get("required")
    if not isinstance(required, list) or len(required) != 1 or not isinstance(required[0], str):
        return None
    kind = ((parameters.get("properties") or {}).get(required[0]) or {}).get("type")
    if kind not in _PLACEHOLDERS:
        return None
    return required[0], _PLACEHOLDERS[kind]


@dataclass
class _Call:
    """One tool's call, rendered by the template: its tokens after the turn's common prefix."""

    tokens: list[int]
    open_end: int  # tokens of the open marker end here (token index)
    open_start: int
    args_cut: int  # token index: the end of what the schema determines before a value
    close: tuple[int, int] | None  # token index range of the close span (first = trigger)


def _strict_rows(tokenizer: Any, messages: list[dict], raw_tools: list, tools: list[dict], markers: tuple[str, str]) -> tuple[list[FillRow], list[int]]:
    calls = [c for tool in tools if (c := _render_call(tokenizer, messages, raw_tools, tool, markers)) is not None]
    if len(calls) != len(tools) or not calls:
        return [], []  # the template does not render calls the way we can slice: no strict rows
    opener = calls[0].tokens[calls[0].open_start : calls[0].open_end]
    if any(c.tokens[c.open_start : c.open_end] != opener for c in calls):
        return [], []
    bodies = [c.tokens[c.open_end : c.args_cut] for c in calls]
    common = 0
    while all(common < len(b) for b in bodies) and len({b[common] for b in bodies}) == 1:
        common += 1
    rows = [FillRow(trigger=opener, emit=bodies[0][:common], kind="scaffold")] if common >= 2 else []
    for body in bodies:
        if common >= len(body):
            continue
        # The fewest tokens past the scaffold that tell this tool from every other one.
        for extra in range(1, len(body) - common + 1):
            head = body[common : common + extra]
            if sum(b[common : common + extra] == head for b in bodies) == 1:
                rows.append(FillRow(trigger=opener + body[: common + extra], emit=body[common + extra :], kind="name"))
                break
    delimiters = set()
    for call in calls:
        if call.close is not None:
            start, end = call.close
            rows.append(FillRow(trigger=call.tokens[start : start + 1], emit=call.tokens[start + 1 : end], kind="close"))
            delimiters.add(call.tokens[start])
    unique = {(tuple(r.trigger), tuple(r.emit)): r for r in rows if len(r.emit) >= 2}
    return list(unique.values()), sorted(delimiters)


def _render_call(tokenizer: Any, messages: list[dict], raw_tools: list, tool: dict, markers: tuple[str, str]) -> _Call | None:
    """The assistant turn that calls `tool` as the chat template renders it, tokenized, with
    where its scaffold ends and the model's choices begin (None: not sliceable here)."""
    single = single_required(tool["parameters"])
    turn = _rendered_turn(tokenizer, messages, raw_tools, tool["name"], {single[0]: single[1]} if single else {})
    if turn is None:
        return None
    open_at = turn.find(markers[0])
    close_at = turn.find(markers[1], open_at + 1)
    name_at = turn.find(json.dumps(tool["name"]), open_at)
    args_key = turn.find('"arguments"', name_at)
    if open_at < 0 or close_at < 0 or name_at < 0 or args_key < 0:
        return None
    tokenized = _TokenEnds.of(tokenizer, turn)
    if tokenized is None:
        return None
    open_start, open_end = tokenized.boundary(open_at), tokenized.boundary(open_at + len(markers[0]))
    if open_start is None or open_end is None:
        return None
    close = None
    if single:
        key, placeholder = single
        value_json = json.dumps(placeholder)
        value_at = turn.find(value_json, turn.find(json.dumps(key), args_key))
        if value_at < 0:
            return None
        # A string's opening quote is structure; its closing quote is where the model decides.
        quoted = 1 if isinstance(placeholder, str) else 0
        args_cut = tokenized.before(value_at + quoted)
        first, last = tokenized.boundary(value_at + len(value_json) - quoted), tokenized.boundary(close_at + len(markers[1]))
        if first is not None and last is not None and last - first >= 2:
            close = (first, last)
    else:
        args_cut = tokenized.before(turn.find(":", args_key) + 1)
    return _Call(tokens=tokenized.tokens, open_start=open_start, open_end=open_end, args_cut=args_cut, close=close)


def _rendered_turn(tokenizer: Any, messages: list[dict], raw_tools: list, name: str, arguments: dict) -> str | None:
    """The text the chat template adds for an assistant turn calling `name` (None: the template
    renders no tool-call history, fails, or re-renders the prompt differently)."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=raw_tools, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template([*messages, call], tools=raw_tools, tokenize=False)
    except Exception:  # templates without tool-call history, jinja errors of many types
        return None
    return full[len(prompt) :] if full.startswith(prompt) else None


@dataclass(frozen=True)
class _TokenEnds:
    """A text tokenized whole (not in fragments), with where each token ends in it."""

    tokens: list[int]
    ends: list[int]

    @classmethod
    def of(cls, tokenizer: Any, text: str) -> _TokenEnds | None:
        """None when a token does not end on a character (a multi-byte character split
        across tokens) or the tokens do not decode back to `text`."""
        tokens = tokenizer.encode(text, add_special_tokens=False)
        ends, decoded = [], ""
        for i in range(1, len(tokens) + 1):
            piece = tokenizer.decode(tokens[:i])
            if not piece.startswith(decoded):
                return None
            decoded = piece
            ends.append(len(decoded))
        return cls(tokens, ends) if decoded == text else None

    def boundary(self, offset: int) -> int | None:
        """Token index whose start is exactly `offset` (None if a token straddles it)."""
        if offset == 0:
            return 0
        return self.ends.index(offset) + 1 if offset in self.ends else None

    def before(self, offset: int) -> int:
        """Number of tokens that end at or before `offset`."""
        return sum(1 for e in self.ends if e <= offset)
