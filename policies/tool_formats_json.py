"""Region readers of the families whose calls carry JSON arguments (pure): Llama 3, Mistral, DeepSeek.

A reader takes a call region's text so far (what follows the family's start marker) and whether
it is closed, and returns the calls in it as `CallText`s (see `policies.tool_stream`). It only
decides errors once the region is closed: until then, text that is not (yet) a call is an
unnamed, unfinished call, and nothing is reported. Each reader belongs to one request: its
`JsonScanner` resumes scanning where the previous (shorter) text ended.
"""

from __future__ import annotations

import json
import re

from policies.tool_stream import CallText, JsonScanner, arguments_text, read_json_call

_SEPARATORS = re.compile(r"[\s;,]*")


def _skip_separators(text: str, at: int) -> int:
    return _SEPARATORS.match(text, at).end()  # type: ignore[union-attr]


def json_arguments(name: str, text: str, start: int, *, raw: str, closed: bool, scan: JsonScanner, stop: int | None = None) -> CallText:
    """A named call whose JSON arguments begin at `text[start]` (after blanks) and end by `stop`."""
    stop = len(text) if stop is None else stop
    start = _skip_separators(text, start)
    if start >= stop:
        return CallText(name=name, arguments="{}" if closed else "", complete=closed, raw=raw)
    end = scan.value_end(text, start)
    end = end if end is not None and end <= stop else None
    if end is None and not (closed and text[start] not in '{["'):
        return CallText(name=name, arguments=text[start:stop] if text[start] in "{[" else "", raw=raw)
    value = text[start : end or stop].rstrip()
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        return CallText(error=f"unparseable tool call: {exc}", raw=raw)
    return CallText(name=name, arguments=value if text[start] in "{[" else arguments_text(parsed), complete=True, raw=raw)


def _objects(text: str, pos: int, closed: bool, scan: JsonScanner, *, until: str = "") -> list[CallText]:
    """`{"name": ..., "arguments"|"parameters": ...}` objects from `pos`, separated by blanks, `;`
    or `,` (and ended by `until`, the close of a JSON array)."""
    calls: list[CallText] = []
    while True:
        pos = _skip_separators(text, pos)
        if pos >= len(text) or (until and text.startswith(until, pos)):
            return calls
        if text[pos] != "{":
            return [*calls, CallText(error="not a tool call", raw=text[pos:]) if closed else CallText(raw=text[pos:])]
        end = scan.value_end(text, pos)
        call = read_json_call(text, pos, closed or end is not None, scan)
        if call.error is not None:
            # Decided when the region closes; its text from here is what comes back.
            return [*calls, CallText(error=call.error, raw=text[pos:]) if closed else CallText(raw=text[pos:])]
        calls.append(call)
        if end is None:
            return calls
        pos = end


class Llama3Reader:
    """Llama 3.x: `<|python_tag|>` or a bare object, `{"name": ..., "parameters": {...}}`, several
    separated by `;`."""

    def __init__(self) -> None:
        self._scan = JsonScanner()

    def __call__(self, text: str, closed: bool) -> list[CallText]:
        return _objects(text, 0, closed, self._scan)


_MISTRAL_HEADER = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*([\w\-]+)\s*)?\[ARGS\]")


class MistralReader:
    """Mistral after `[TOOL_CALLS]`: a JSON array of calls (v3 tokenizers: Mistral 7B v0.3, Nemo),
    or `name[ARGS]{...}` repeated with `[TOOL_CALLS]` between (v11+: Small 3.x, Devstral, Magistral)."""

    def __init__(self) -> None:
        self._scan = JsonScanner()

    def __call__(self, text: str, closed: bool) -> list[CallText]:
        first = _skip_separators(text, 0)
        rest = text[first : first + len("[TOOL_CALLS]")]
        if rest.startswith("[") and not "[TOOL_CALLS]".startswith(rest):
            return _objects(text, first + 1, closed, self._scan, until="]")
        if rest.startswith("{"):
            return _objects(text, first, closed, self._scan)
        calls: list[CallText] = []
        pos = 0
        while True:
            tail = text[pos:].strip()
            if not tail or (not closed and "[TOOL_CALLS]".startswith(tail)):
                return calls
            header = _MISTRAL_HEADER.match(text, pos)
            if header is None:
                return [*calls, CallText(error="not a tool call", raw=text[pos:]) if closed else CallText(raw=text[pos:])]
            start = _skip_separators(text, header.end())
            end = self._scan.value_end(text, start)
            call = json_arguments(header[1], text, start, raw=text[pos : end or len(text)], closed=closed or end is not None, scan=self._scan)
            if call.error is not None and not closed:
                return [*calls, CallText(raw=text[pos:])]
            calls.append(call)
            if end is None:
                return calls
            pos = end


DEEPSEEK_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_CALL_BEGIN, _CALL_END, _SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCE = re.compile(r"\s*```(?:json)?\s*")


class DeepSeekReader:
    """DeepSeek between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`: calls in
    `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`, each `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` (V3, R1)
    or `NAME<｜tool▁sep｜>{...}` (V3.1)."""

    def __init__(self) -> None:
        self._scan = JsonScanner()

    def __call__(self, text: str, closed: bool) -> list[CallText]:
        calls: list[CallText] = []
        pos = 0
        while True:
            pos = len(text) - len(text[pos:].lstrip())
            if pos >= len(text) or (not closed and _CALL_BEGIN.startswith(text[pos:])):
                return calls
            if not text.startswith(_CALL_BEGIN, pos):
                return [*calls, CallText(error="not a tool call", raw=text[pos:]) if closed else CallText(raw=text[pos:])]
            body = pos + len(_CALL_BEGIN)
            end = text.find(_CALL_END, body)
            calls.append(self._call(text, body, len(text) if end < 0 else end, closed=closed or end >= 0))
            if end < 0:
                return calls
            pos = end + len(_CALL_END)

    def _call(self, text: str, body: int, stop: int, *, closed: bool) -> CallText:
        raw, sep = text[body:stop], text.find(_SEP, body, stop)
        if sep < 0:
            return CallText(error="not a tool call", raw=raw) if closed else CallText(raw=raw)
        head, after = text[body:sep].strip(), sep + len(_SEP)
        if head != "function":  # V3.1: the name, then the arguments
            return json_arguments(head, text, after, raw=raw, closed=closed, scan=self._scan, stop=stop)
        newline = text.find("\n", after, stop)
        if newline < 0 and not closed:
            return CallText(raw=raw)  # the name is still arriving
        name = text[after : stop if newline < 0 else newline].strip()
        start = stop if newline < 0 else newline + 1
        if not text[start:stop].lstrip().startswith("`"):
            return json_arguments(name, text, start, raw=raw, closed=closed, scan=self._scan, stop=stop)
        fence = _FENCE.match(text, start, stop)
        if not closed and (fence is None or fence.end() == stop):
            return CallText(name=name, raw=raw)  # the fence may still be arriving
        return json_arguments(name, text, fence.end() if fence else start, raw=raw, closed=closed, scan=self._scan, stop=stop)
