"""Streaming a model's output through its family's markup (pure): content, reasoning, tool calls.

`MarkupParser` is the one interface every family's format sits behind (`feed(text)` then
`flush()`, each returning a `Parsed` as `policies.output_parser.OutputParser` does). It owns
the text held back (a marker may still be arriving) and which part of the output it is in: a
leading reasoning block, content, or a call region between the family's markers. A family only
supplies `Markup`: its markers and a `RegionReader` that reads the calls out of a region's text
so far. `CallReporter` turns those readings into `Parsed.deltas` and `Parsed.calls`.

Contract of `Parsed` (what `actors/session.py` relies on): content never holds markup; one call's
name, then fragments of its arguments' text that add up to the finished call's `arguments`; the
deltas of one `Parsed` all belong to the first call it completes (or the call still open), so a
call that starts in the feed that completed another streams from the next feed on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from policies.output_parser import MarkerStream, Parsed, partial_suffix


@dataclass
class CallText:
    """One call read from a region's text so far.

    `arguments` is the arguments' JSON text: while `complete` is False, a prefix of what it will
    be (so fragments of it can be streamed); `error` marks a region that is not a call (`raw`).
    """

    name: str | None = None
    arguments: str = ""
    complete: bool = False
    error: str | None = None
    raw: str = ""


# (region text so far, closed) -> the calls in it. `closed`: the region's end marker arrived or
# the output ended; a closed region's calls are complete, errors, or cut off (`complete=False`).
RegionReader = Callable[[str, bool], list[CallText]]


@dataclass(frozen=True)
class Markup:
    """A family's output markup. `call_end` None: a region runs to the end of the output.
    `bare_json`: output that begins (after reasoning) with `{` is a call region (Llama 3)."""

    read_region: RegionReader
    call_start: str
    call_end: str | None = None
    think: tuple[str, str] | None = None
    bare_json: bool = False


class CallReporter:
    """Turns successive readings of call regions into deltas and finished calls."""

    def __init__(self) -> None:
        self._reported = 0  # calls of the current region already finished
        self._sent_name = False
        self._sent_args = ""
        self._finished_in_feed = False

    def new_feed(self) -> None:
        self._finished_in_feed = False

    def new_region(self) -> None:
        self._reported, self._sent_name, self._sent_args = 0, False, ""

    def report(self, calls: list[CallText], out: Parsed, *, closed: bool, ended: bool) -> None:
        """`closed`: no more text comes for this region; `ended`: the output ended with it open."""
        for call in calls[self._reported :]:
            if not (call.complete or call.error or closed):
                if not self._finished_in_feed:
                    self._stream(call, out)
                return
            if call.error is not None or (not call.complete and not ended):
                # The model closed the region on something that is not a whole call.
                error = call.error or ("a tool call needs a name" if call.name is None else "unparseable tool call")
                out.calls.append({"error": error, "raw": call.raw})
            elif call.name is not None:
                if not self._finished_in_feed:
                    self._stream(call, out)
                truncated = {} if call.complete else {"truncated": True}
                out.calls.append({"name": call.name, "arguments": call.arguments or "{}", **truncated})
            self._reported += 1
            self._sent_name, self._sent_args, self._finished_in_feed = False, "", True

    def _stream(self, call: CallText, out: Parsed) -> None:
        if call.name is None:
            return
        if not self._sent_name:
            out.deltas.append({"name": call.name})
            self._sent_name = True
        arguments = call.arguments or ("{}" if call.complete else "")
        if len(arguments) > len(self._sent_args) and arguments.startswith(self._sent_args):
            out.deltas.append({"arguments": arguments[len(self._sent_args) :]})
            self._sent_args = arguments


class MarkupParser(MarkerStream):
    """Content, a leading reasoning block and call regions of one request's output.

    `in_reasoning`: the prompt opened the reasoning block (the template ends with `<think>`),
    so the output starts inside it.
    """

    def __init__(self, markup: Markup, *, in_reasoning: bool = False):
        self._markup = markup
        self._buffer = ""
        self._region = ""
        # "start" (reasoning or a bare call may open), "think", "content" or "call".
        self._state = "think" if in_reasoning and markup.think else "start"
        self._reporter = CallReporter()

    def _new_feed(self) -> None:
        self._reporter.new_feed()

    def flush(self) -> Parsed:
        out = Parsed()
        self._new_feed()
        if self._state == "call":
            self._region += self._buffer
            self._reporter.report(self._markup.read_region(self._region, True), out, closed=True, ended=True)
        elif self._state == "think":
            out.reasoning = self._buffer
        else:
            out.content = self._buffer
        self._buffer, self._region, self._state = "", "", "content"
        return out

    def _step(self, out: Parsed) -> bool:
        """Consume what can be decided now; True if more may follow."""
        markup, buffer = self._markup, self._buffer
        match self._state:
            case "start":
                stripped = buffer.lstrip()
                think = markup.think[0] if markup.think else None
                if think and stripped.startswith(think):
                    self._buffer, self._state = stripped[len(think) :], "think"
                elif markup.bare_json and stripped.startswith("{"):
                    self._open_region(out, stripped)
                elif not stripped or (think and think.startswith(stripped)):
                    return False  # maybe a marker, still arriving
                else:
                    self._state = "content"
                return True
            case "think":
                assert markup.think is not None
                return self._until(markup.think[1], out, "reasoning", "content")
            case "content":
                if self._until(markup.call_start, out, "content", "call"):
                    self._open_region(out, self._buffer)
                    return True
                return False
            case _:
                return self._in_region(out)

    def _open_region(self, out: Parsed, rest: str) -> None:
        self._state, self._region, self._buffer = "call", "", rest
        self._reporter.new_region()

    def _in_region(self, out: Parsed) -> bool:
        end, buffer = self._markup.call_end, self._buffer
        index = buffer.find(end) if end else -1
        if index >= 0:
            self._region += buffer[:index]
            self._reporter.report(self._markup.read_region(self._region, True), out, closed=True, ended=False)
            self._buffer, self._region, self._state = buffer[index + len(end or "") :], "", "content"
            return True
        hold = partial_suffix(buffer, end) if end else 0
        self._region += buffer[: len(buffer) - hold]
        self._buffer = buffer[len(buffer) - hold :]
        self._reporter.report(self._markup.read_region(self._region, False), out, closed=False, ended=False)
        return False


# -- JSON helpers shared by the families ------------------------------------------------------

_STRING_STOP = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[\s,}\]]")
_BLANKS = re.compile(r"\s*")
_JSON_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass
class _Scan:
    seen: str  # the text scanned so far from the value's start (a prefix of any later text)
    depth: int
    in_string: bool
    end: int | None = None


class JsonScanner:
    """Where JSON values end, in a text that only grows between calls (one call region as it
    streams): a value's scan resumes where the last call left it, so streaming a long value
    costs its length once, not once per token. Only extents are found; `json.loads` checks them."""

    def __init__(self) -> None:
        self._scans: dict[int, _Scan] = {}

    def value_end(self, text: str, start: int) -> int | None:
        """Where the value beginning at `text[start]` ends, or None if it has not ended yet (a
        scalar ends at a delimiter)."""
        if start >= len(text):
            return None
        if text[start] not in '{["':
            match = _SCALAR_END.search(text, start)
            return match.start() if match else None
        scan = self._scans.get(start)
        if scan is None or not text.startswith(scan.seen):
            scan = self._scans[start] = _Scan(seen=text[:start], depth=0, in_string=False)
        if scan.end is None:
            scan.end = _resume(text, len(scan.seen), scan)
        return scan.end


def _resume(text: str, at: int, scan: _Scan) -> int | None:
    """Scan on from `at`; the value's end, or None with `scan` left where the text ran out."""
    while True:
        if scan.in_string:
            match = _STRING_STOP.search(text, at)
            if match is None:
                at = len(text)
                break
            if match.group() == "\\":
                if match.end() >= len(text):
                    at = match.start()  # the escaped character has not arrived yet
                    break
                at = match.end() + 1
                continue
            at, scan.in_string = match.end(), False
            if scan.depth == 0:
                return at
            continue
        match = _STRUCTURE.search(text, at)
        if match is None:
            at = len(text)
            break
        at = match.end()
        if match.group() == '"':
            scan.in_string = True
            continue
        scan.depth += 1 if match.group() in "{[" else -1
        if scan.depth == 0:
            return at
    scan.seen = text[:at]
    return None


def json_value_end(text: str, start: int) -> int | None:
    """`JsonScanner.value_end` once, without resuming."""
    return JsonScanner().value_end(text, start)


def skip_blanks(text: str, at: int) -> int:
    return _BLANKS.match(text, at).end()  # type: ignore[union-attr]


def arguments_text(value: object) -> str:
    """A call's arguments as JSON text (a string value is taken as that text)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def read_json_call(text: str, pos: int, closed: bool, scan: JsonScanner) -> CallText:
    """One `{"name": ..., "arguments"|"parameters": {...}}` object (possibly unfinished) at
    `text[pos:]` (after blanks).

    The finished call's arguments are the model's own text when that parses to the same value,
    so fragments streamed from the text add up to it."""
    begin = skip_blanks(text, pos)
    end = scan.value_end(text, begin)
    head = _JSON_CALL_HEAD.match(text, pos)
    if end is None:
        if head is None:
            return CallText(raw=text[pos:])
        start = head.end()
        if text[start] not in "{[":
            return CallText(name=json.loads(head[1]), raw=text[pos:])  # a string of JSON: whole or nothing
        value_end = scan.value_end(text, start)
        # Closed with only the object's own `}` missing, the call is whole (the arguments are).
        return CallText(name=json.loads(head[1]), arguments=text[start : value_end or len(text)], complete=closed and value_end is not None, raw=text[pos:])
    try:
        obj = json.loads(text[begin:end])
    except ValueError as exc:
        return CallText(error=f"unparseable tool call: {exc}", raw=text[pos:end])
    name = obj.get("name") if isinstance(obj, dict) else None
    if name is None:
        return CallText(error="a tool call needs a name", raw=text[pos:end])
    value: object = next((obj[key] for key in ("arguments", "parameters") if key in obj), {})
    arguments = arguments_text(value)
    if head is not None and head.end() < end and text[head.end()] in "{[":
        value_end = scan.value_end(text, head.end())
        raw = text[head.end() : value_end] if value_end else None
        if raw is not None and _same_json(raw, arguments):
            arguments = raw
    return CallText(name=str(name), arguments=arguments, complete=True, raw=text[pos:end])


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False
