"""Token fast-forwarding ("fill"): tokens the engine already knows, appended without sampling.

A transformer is a next-token function over a token sequence: an appended token is
indistinguishable from a sampled one. After each sampled token a request's
`FillSession` asks its sources, in priority order, whether the next tokens are known:

- **strict rows** (policy *assert*): spans sliced out of a full chat-template rendering
  of a call of the request's tools, fired when the output ends with the row's trigger
  and the tool-call context allows it (the output so far is a tool-only turn, the call
  is exactly at the row's point). They are appended as they are.
- **echo** (policy *verify*): after the last `k` tokens match an earlier place in the
  context, the tokens that followed there. The engine forwards them with the next step
  and keeps the prefix the model's own greedy choice agrees with, read from the logits
  of that same forward; the rejected tail is rewound from the cache. Greedy rows only,
  so the output is exactly what decoding without it gives.

Spans are clamped in the seeds' order: cut before the first end-of-sequence id, echo
spans end at a delimiter (never continue past one), at most `max_span` and the
request's remaining budget, and a span shorter than 2 is dropped (it saves nothing).

`compile_plan` runs on the runtime side (worker thread: it renders templates);
`FillSession` runs on the MLX thread inside the engine and is plain Python.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from protocols.api import FillStats, GenerateRequest
from protocols.errors import InvalidRequestError
from protocols.model import FillPlan, FillRow

MODES = ("off", "strict", "echo")
MAX_CONTEXT_TOKENS = 65_536
ECHO_INDEX_MAX = 131_072
ECHO_FIRST_SPAN = 8
# Placeholder argument values rendered into the template to find where a value ends.
_PLACEHOLDERS = {"string": "qzxplaceholder", "integer": 7, "number": 7, "boolean": True}


@dataclass
class Proposal:
    ids: list[int]
    policy: Literal["assert", "verify"]
    origin: Literal["template", "schema", "echo"]


# --- compiling a request's plan (runtime side) ---------------------------------------


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
    tools = [_function(tool) for tool in request.tools or []]
    rows: list[FillRow] = []
    delimiters: list[int] = []
    if tools and request.tool_choice != "none":
        if markers is None:
            raise InvalidRequestError("this model's chat template has no tool-call format to fast-forward", field="tools")
        if request.messages is not None:
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


def _function(tool: Any) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError('tools must be [{"type": "function", "function": {"name": ..., "parameters": {...}}}]', field="tools")
    parameters = function.get("parameters") or {"type": "object"}
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"tool {function['name']!r}: parameters must be a JSON schema object", field="tools")
    return {"name": function["name"], "parameters": parameters}


def _single_required(parameters: dict) -> tuple[str, Any] | None:
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
    single = _single_required(tool["parameters"])
    arguments = {single[0]: single[1]} if single else {}
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": tool["name"], "arguments": arguments}}]}
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=raw_tools, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template([*messages, call], tools=raw_tools, tokenize=False)
    except Exception:  # templates without tool-call history, jinja errors of many types
        return None
    if not full.startswith(prompt):
        return None
    turn = full[len(prompt) :]
    open_at = turn.find(markers[0])
    close_at = turn.find(markers[1], open_at + 1)
    name_json = json.dumps(tool["name"])
    name_at = turn.find(name_json, open_at)
    if open_at < 0 or close_at < 0 or name_at < 0:
        return None
    # Token the whole turn (not fragments), then find where each token ends in it.
    tokens = tokenizer.encode(turn, add_special_tokens=False)
    ends, text = [], ""
    for i in range(1, len(tokens) + 1):
        piece = tokenizer.decode(tokens[:i])
        if not piece.startswith(text):
            return None  # a multi-byte character split across tokens: not sliceable here
        text = piece
        ends.append(len(text))
    if text != turn:
        return None

    def boundary(offset: int) -> int | None:
        """Token index whose start is exactly `offset` (None if a token straddles it)."""
        if offset == 0:
            return 0
        return ends.index(offset) + 1 if offset in ends else None

    def before(offset: int) -> int:
        """Number of tokens that end at or before `offset`."""
        return sum(1 for e in ends if e <= offset)

    open_start, open_end = boundary(open_at), boundary(open_at + len(markers[0]))
    if open_start is None or open_end is None:
        return None
    args_key = turn.find('"arguments"', name_at)
    if args_key < 0:
        return None
    value_start = turn.find(":", args_key) + 1
    close = None
    if single:
        key, placeholder = single
        value_json = json.dumps(placeholder)
        value_at = turn.find(value_json, turn.find(json.dumps(key), args_key))
        if value_at < 0:
            return None
        # A string's opening quote is structure; its closing quote is where the model decides.
        args_cut = before(value_at + (1 if isinstance(placeholder, str) else 0))
        value_end = value_at + len(value_json) - (1 if isinstance(placeholder, str) else 0)
        first, last = boundary(value_end), boundary(close_at + len(markers[1]))
        if first is not None and last is not None and last - first >= 2:
            close = (first, last)
    else:
        args_cut = before(value_start)
    return _Call(tokens=tokens, open_start=open_start, open_end=open_end, args_cut=args_cut, close=close)


# --- the per-request session (engine side, MLX thread) --------------------------------


def parse_strict_call(text: str, tools: list[dict], markers: tuple[str, str]) -> dict | None:
    """`<open>{"name": ..., "arguments": {...}}<close>` naming a known tool, or None."""
    start, end = markers
    if not (text.startswith(start) and text.endswith(end)):
        return None
    try:
        call = json.loads(text[len(start) : len(text) - len(end)])
    except ValueError:
        return None
    if not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["arguments"], dict):
        return None
    return call if any(t["name"] == call["name"] for t in tools) else None


def _literals_closed(text: str) -> bool:
    quote, escaped = "", False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if c == quote else quote
        elif c in "\"'`":
            quote = c
    return quote == "" and not escaped


def _reasoning_closed(text: str, think_start: str) -> bool:
    if think_start in text:
        return False
    fence, prose = "", []
    for line in text.split("\n"):
        marker = re.match(r"^\s*(`{3,}|~{3,})(.*)$", line)
        if fence:
            if marker and marker[1][0] == fence[0] and len(marker[1]) >= len(fence) and not marker[2].strip():
                fence = ""
        elif marker:
            fence = marker[1]
        else:
            prose.append(line)
    return not fence and _literals_closed("\n".join(prose))


class ToolCallContext:
    """Request-local proof for template rows: only a tool-only assistant turn (optionally after
    its reasoning) qualifies, with every earlier call complete and valid. Decodes only when a
    row's trigger has matched, not for every token."""

    def __init__(self, plan: FillPlan, decode: Callable[[list[int]], str]):
        self._plan = plan
        self._decode = decode
        self._ids: list[int] = []
        self._overflow = False
        self._dead = False

    def observe(self, ids: list[int]) -> None:
        if self._overflow:
            return
        if len(self._ids) + len(ids) > MAX_CONTEXT_TOKENS:
            self._overflow, self._ids = True, []
            return
        self._ids += ids

    def allows(self, row: FillRow) -> bool:
        if self._overflow or self._dead or self._plan.tool_markers is None:
            return False
        allowed, self._dead = self._check(row)
        return allowed

    def _check(self, row: FillRow) -> tuple[bool, bool]:
        """(whether the row may fire now, whether no row ever can in this output again: the
        output only grows, so prose, a malformed call or unclosed reasoning stay)."""
        plan = self._plan
        start, end = plan.tool_markers
        text = self._decode(self._ids)
        if plan.think_markers is not None:
            think_start, think_end = plan.think_markers
            if plan.starts_in_reasoning:
                stop = text.find(think_end)
                if stop < 0:
                    return False, False
                if not _reasoning_closed(text[:stop], think_start):
                    return False, True
                text = text[stop + len(think_end) :]
            text = text.lstrip()
            if text.startswith(think_start):
                stop = text.find(think_end, len(think_start))
                if stop < 0:
                    return False, False
                if not _reasoning_closed(text[len(think_start) : stop], think_start):
                    return False, True
                text = text[stop + len(think_end) :]
            elif think_start.startswith(text):
                return False, False
        text = text.lstrip()
        while True:  # earlier calls must be complete and valid before another opens
            if not text.startswith(start):
                return False, not start.startswith(text)
            stop = text.find(end, len(start))
            if stop < 0:
                break
            if parse_strict_call(text[: stop + len(end)], plan.tools, plan.tool_markers) is None:
                return False, True
            text = text[stop + len(end) :].lstrip()
        if text.find(start, len(start)) != -1:
            return False, True
        if row.kind in ("scaffold", "name"):
            trigger = self._decode(row.trigger)
            at = trigger.find(start)
            return at >= 0 and text == trigger[at:], False
        if row.kind != "close":
            return False, False
        call = parse_strict_call(text + self._decode(row.emit), plan.tools, plan.tool_markers)
        if call is None:
            return False, False
        tool = next(t for t in plan.tools if t["name"] == call["name"])
        single = _single_required(tool["parameters"])
        if single is None or set(call["arguments"]) != {single[0]}:
            return False, False
        value = call["arguments"][single[0]]
        return not isinstance(value, str) or _literals_closed(value), False


class StrictRows:
    """Strict rows indexed by the last token of their trigger; longest trigger wins."""

    def __init__(self, rows: list[FillRow], context: ToolCallContext):
        self._by_last: dict[int, list[FillRow]] = {}
        self.window = max((len(r.trigger) for r in rows), default=1)
        for row in rows:
            self._by_last.setdefault(row.trigger[-1], []).append(row)
        for bucket in self._by_last.values():
            bucket.sort(key=lambda r: -len(r.trigger))
        self._context = context

    def observe(self, ids: list[int]) -> None:
        self._context.observe(ids)

    def propose(self, tail: list[int]) -> Proposal | None:
        for row in self._by_last.get(tail[-1], ()) if tail else ():
            n = len(row.trigger)
            if n <= len(tail) and tail[-n:] == row.trigger and self._context.allows(row):
                # The scaffold and close come from the template; a name from the request's tools.
                return Proposal(list(row.emit), "assert", "schema" if row.kind == "name" else "template")
        return None


class EchoSource:
    """Spans copied from earlier in the context after a `k`-token anchor matches there.

    The index maps each k-gram to the positions just after its latest occurrences; the
    nearest earlier occurrence wins.
    """

    def __init__(self, k: int, max_span: int, max_candidates: int, history: list[int]):
        self._k, self._max_span, self._max_candidates = k, max_span, max_candidates
        self._history: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}
        self.observe(history)

    def observe(self, ids: list[int]) -> None:
        history, k = self._history, self._k
        for token in ids:
            if len(history) >= ECHO_INDEX_MAX:
                return
            history.append(token)
            if len(history) >= k:
                bucket = self._index.setdefault(tuple(history[-k:]), [])
                bucket.append(len(history))
                if len(bucket) > self._max_candidates:
                    del bucket[0]

    def propose(self, limit: int) -> Proposal | None:
        """The continuation of the nearest earlier occurrence of the anchor, up to `limit` tokens
        (one more when there is one: the clamp then knows the span was cut)."""
        history, n = self._history, len(self._history)
        if n < self._k or n >= ECHO_INDEX_MAX:
            return None
        for end in reversed(self._index.get(tuple(history[-self._k :]), ())):
            if end < n:
                span = history[end : end + min(limit, self._max_span) + 1]
                if len(span) >= 2:
                    return Proposal(span, "verify", "echo")
        return None


class FillSession:
    """One request's sources, running history and stats.

    After each sampled token call `propose`; the engine then calls `commit` exactly once
    per proposal with the number of its ids it emitted (all for assert, the accepted
    prefix for verify, 0 when it declined). Nothing enters the history before `commit`.
    """

    def __init__(self, plan: FillPlan, stats: FillStats, context_ids: list[int], decode: Callable[[list[int]], str]):
        self.plan = plan
        # The running figures, by `FillStats` field.
        self._stats = msgspec.structs.asdict(stats)
        self._stats["span_lens"] = list(stats.span_lens)
        self._eos = frozenset(plan.eos)
        self._delimiters = frozenset(plan.delimiters)
        self._strict = StrictRows(plan.rows, ToolCallContext(plan, decode)) if plan.rows else None
        self._echo = EchoSource(plan.echo_k, plan.max_span, plan.echo_candidates, context_ids) if plan.echo_k else None
        self._window = self._strict.window if self._strict else 1
        # Echo spans start short and double while the model takes them whole, halving when it
        # does not: a rejected tail costs forward work (one row's, not the batch's).
        self._echo_limit = min(ECHO_FIRST_SPAN, plan.max_span)
        # A row may be triggered by the prompt's own tail, so the history starts seeded.
        self._tail = list(context_ids[-self._window :])

    @property
    def active(self) -> bool:
        """Whether any source can ever propose (otherwise the row decodes as usual)."""
        return self._strict is not None or self._echo is not None

    def replay(self, ids: list[int]) -> None:
        """Output produced before a resume: seen as output, not counted in the stats."""
        self._append(list(ids))

    def observe(self, token: int) -> None:
        """A token the model sampled."""
        self._stats["decode_steps"] += 1
        self._append([token])

    def propose(self, budget: int) -> Proposal | None:
        """A span to append now, clamped to `budget` tokens, or None."""
        for proposal in (self._strict.propose(self._tail) if self._strict else None, self._echo.propose(self._echo_limit) if self._echo else None):
            if proposal is None:
                continue
            echo = proposal.origin == "echo"
            ids = self._clamp(proposal.ids, min(budget, self._echo_limit) if echo else budget, echo)
            if ids is not None:
                return Proposal(ids, proposal.policy, proposal.origin)
        return None

    def commit(self, proposal: Proposal, accepted: int) -> None:
        n = max(0, min(accepted, len(proposal.ids)))
        stats = self._stats
        if proposal.policy == "verify":
            stats["verify_events"] += 1
            stats["verify_accepted"] += n
            stats["verify_rejected"] += len(proposal.ids) - n
            whole = n == len(proposal.ids)
            self._echo_limit = min(self.plan.max_span, self._echo_limit * 2) if whole else max(2, self._echo_limit // 2)
        if n == 0:
            return
        self._append(proposal.ids[:n])
        stats["events"] += 1
        stats["injected"] += n
        stats["echo" if proposal.origin == "echo" else "strict"] += n
        stats["span_lens"].append(n)

    def snapshot(self) -> FillStats:
        return FillStats(**{**self._stats, "span_lens": list(self._stats["span_lens"])})

    def _append(self, ids: list[int]) -> None:
        if self._strict:
            self._strict.observe(ids)
        if self._echo:
            self._echo.observe(ids)
        self._tail = (self._tail + ids)[-self._window :]

    def _clamp(self, emit: list[int], budget: int, echo: bool) -> list[int] | None:
        """End of sequence, then delimiter (echo only: a scaffold holds quotes as structure),
        then max span and budget; spans under 2 tokens are dropped."""
        ids, truncated = list(emit), False
        for i, token in enumerate(ids):
            if token in self._eos:
                ids, truncated = ids[:i], True
                break
        if echo:
            for i, token in enumerate(ids):
                if token in self._delimiters:
                    if i + 1 < len(ids):
                        ids, truncated = ids[: i + 1], True
                    break
        cap = min(self.plan.max_span, max(0, budget))
        if len(ids) > cap:
            ids, truncated = ids[:cap], True
        if len(ids) < 2:
            return None
        self._stats["truncated"] += int(truncated)
        return ids


def trace_record(request_id: str, proposal: Proposal, generated: int, accepted: int, actual: list[int], decode: Callable[[list[int]], str]) -> str:
    """One JSON line: the proposed ids next to the model's own choice at each span position
    (`actual[j]`: its greedy token where `proposed[j]` went)."""
    first_mismatch = next((j for j, (a, b) in enumerate(zip(proposal.ids, actual)) if a != b), -1)
    record = {
        "request_id": request_id,
        "origin": proposal.origin,
        "policy": proposal.policy,
        "generated": generated,
        "proposed_len": len(proposal.ids),
        "accepted": accepted,
        "first_mismatch": first_mismatch,
        "proposed": proposal.ids,
        "actual": actual,
        "proposed_text": decode(proposal.ids),
        "actual_text": decode(actual),
    }
    return json.dumps(record)
