"""Token fast-forwarding ("fill"), the session: one request's sources, history and stats.

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

The plan comes from `policies.fill_plan`; `FillSession` runs on the MLX thread inside the
engine and is plain Python.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from policies.fill_plan import single_required
from protocols.api import FillStats
from protocols.model import FillPlan, FillRow

MAX_CONTEXT_TOKENS = 65_536
ECHO_INDEX_MAX = 131_072
ECHO_FIRST_SPAN = 8


@dataclass
class Proposal:
    ids: list[int]
    policy: Literal["assert", "verify"]
    origin: Literal["template", "schema", "echo"]


def parse_strict_call(text: str, tools: list[dict], markers: tuple[str, str]) -> dict | None:
    """`<open>{"name": ..., "arguments": {...}}<close>` naming a known tool, or None."""
    start, end = markers
    if not (text.startswith(start) and text.endswith(end)):
        return None
    try:
        call = json.loads(text[len(start) : len(text) - len(end)])
    except (ValueError, RecursionError):
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
        plan, markers = self._plan, self._plan.tool_markers
        assert markers is not None  # allows() checked it
        start, end = markers
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
            if parse_strict_call(text[: stop + len(end)], plan.tools, markers) is None:
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
        call = parse_strict_call(text + self._decode(row.emit), plan.tools, markers)
        if call is None:
            return False, False
        tool = next(t for t in plan.tools if t["name"] == call["name"])
        single = single_required(tool["parameters"])
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
