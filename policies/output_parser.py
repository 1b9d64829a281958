"""Splitting a request's streamed text into content, reasoning and tool calls (pure).

A leading `<think>...</think>` block (the model's own markers) is reasoning; with
tools, `<tool_call>...</tool_call>` spans (the model's own markup) are parsed by
the model's tool parser into calls. Text that could be the start of a marker is
held back until it is known not to be one.

While a call's body arrives in the common JSON shape (`{"name": ..., "arguments": ...}`),
its name and the text of its arguments are reported as they are generated (`Parsed.deltas`),
and the finished call's `arguments` is that same text when it parses to the same value (the
fragments add up to it). Markup never reaches the content: a call cut off by the end of the
output (max_tokens) is a call with the arguments generated so far, or nothing when its name
had not been generated yet.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

# The head of a call body in the common JSON shape, up to where its arguments' value begins.
_JSON_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)
    # The call being generated, as it arrives: {"name": ...} once its name is known, then
    # {"arguments": fragment}s; `calls` has it whole once it closes.
    deltas: list[dict] = field(default_factory=list)


class StreamParser(Protocol):
    """What splits one request's streamed output: `OutputParser`, or a model family's parser
    (`policies.tool_formats.make_parser`). `flush` at the end of the output."""

    def feed(self, text: str) -> Parsed: ...

    def flush(self) -> Parsed: ...


@dataclass
class _OpenCall:
    """A call whose body is arriving: its name and the argument text reported so far."""

    name: str | None = None
    args_start: int = -1
    sent: str = ""


class MarkerStream:
    """The loop of a streaming output parser: text is buffered, and `_step` consumes what can be
    decided so far (a state per region: reasoning, content, a call), holding what might still be
    the start of a marker. Subclasses give `_step` and `_new_feed`."""

    _buffer: str
    _state: str

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        self._new_feed()
        while self._step(out):
            pass
        return out

    def _new_feed(self) -> None:
        """(Called at the start of each `feed` and `flush`.)"""

    def _step(self, out: Parsed) -> bool:
        """Consume what can be decided now; True if progress was made and more may follow."""
        raise NotImplementedError

    def _until(self, marker: str, out: Parsed, target: str, next_state: str) -> bool:
        """Move text before `marker` to `target`; on the marker switch state. Holds partial markers."""
        before, self._buffer, found = until_marker(self._buffer, marker)
        setattr(out, target, getattr(out, target) + before)
        if found:
            self._state = next_state
        return found


class OutputParser(MarkerStream):
    def __init__(
        self,
        *,
        think: tuple[str, str] | None = None,
        tool_markers: tuple[str, str] | None = None,
        parse_call: Callable[[str], dict] | None = None,
        in_think: bool = False,
    ):
        self._think = think
        self._tools = tool_markers
        self._parse_call = parse_call
        self._buffer = ""
        # "start" (might open a think block), "think", "content", or "call". `in_think`: the
        # prompt opened the block (its template ends with the start marker).
        self._state = ("think" if in_think else "start") if think else "content"
        self._open = _OpenCall()
        # The session numbers a `Parsed`'s deltas by the first call it finishes: a call that opens
        # in the feed that finished another streams from the next feed on.
        self._finished_in_feed = False

    def _new_feed(self) -> None:
        self._finished_in_feed = False

    def flush(self) -> Parsed:
        """End of output: whatever is held is content, or reasoning; a call cut off is a call
        with the arguments generated so far (its markup never becomes content)."""
        out = Parsed()
        self._new_feed()
        if self._state == "call":
            self._stream_call(out)
            call, tools = self._open, self._tools
            assert tools is not None
            if call.name is not None:
                body = self._buffer[: len(self._buffer) - partial_suffix(self._buffer, tools[1])]
                whole = _value_text(body, call.args_start)  # only the closing markup was cut off
                arguments = whole if whole is not None else body[call.args_start :]
                if arguments.startswith(call.sent) and len(arguments) > len(call.sent):
                    out.deltas.append({"arguments": arguments[len(call.sent) :]})
                out.calls.append({"name": call.name, "arguments": arguments, **({} if whole is not None else {"truncated": True})})
        else:
            setattr(out, "reasoning" if self._state == "think" else "content", self._buffer)
        self._buffer, self._open = "", _OpenCall()
        return out

    def _step(self, out: Parsed) -> bool:
        buffer, think, tools = self._buffer, self._think, self._tools
        if self._state == "start":
            assert think is not None
            stripped = buffer.lstrip()
            start = think[0]
            if stripped.startswith(start):
                self._buffer, self._state = stripped[len(start) :], "think"
                return True
            if start.startswith(stripped):
                return False  # maybe the marker, still arriving
            self._state = "content"
            return True
        if self._state == "think":
            assert think is not None
            return self._until(think[1], out, "reasoning", next_state="content")
        if tools is None:
            out.content += buffer
            self._buffer = ""
            return False
        if self._state == "call":
            index = buffer.find(tools[1])
            if index < 0:
                self._stream_call(out)
                return False
            self._buffer = buffer[:index]
            self._stream_call(out)  # the name, if this feed brought the whole body
            calls = self._calls(buffer[:index])
            sent = self._open.sent
            named = self._open.name is not None and len(calls) == 1 and calls[0].get("name") == self._open.name
            if named and calls[0]["arguments"].startswith(sent):
                rest = calls[0]["arguments"][len(sent) :]
                out.deltas += [{"arguments": rest}] if rest else []  # the fragments add up to the call's arguments
            out.calls.extend(calls)
            self._buffer, self._state, self._open = buffer[index + len(tools[1]) :], "content", _OpenCall()
            self._finished_in_feed = True
            return True
        return self._until(tools[0], out, "content", next_state="call")

    def _stream_call(self, out: Parsed) -> None:
        """Report the open call's name once its body shows it, then its argument text as it
        grows (all but what may still be the body's closing brace)."""
        call, body = self._open, self._buffer
        if self._finished_in_feed:
            return
        if call.name is None:
            head = _JSON_CALL_HEAD.match(body)
            if head is None:
                return
            try:
                call.name = json.loads(head[1])
            except ValueError:
                return
            call.args_start = head.end()
            out.deltas.append({"name": call.name})
        if body[call.args_start] != "{":
            return  # not an object (a JSON string of one, say): the finished call has it whole
        arguments = body[call.args_start :]
        assert self._tools is not None
        arguments = arguments[: len(arguments) - partial_suffix(arguments, self._tools[1])]
        ready = _without_body_tail(arguments)
        if len(ready) > len(call.sent) and ready.startswith(call.sent):
            out.deltas.append({"arguments": ready[len(call.sent) :]})
            call.sent = ready

    def _calls(self, body: str) -> list[dict]:
        """The calls in one marked span (some models' parsers return several); a body that does
        not parse is one error entry, whatever the parser raised: it is the model's output."""
        try:
            parsed = self._parse_call(body) if self._parse_call else json.loads(body)
        except Exception as exc:
            return [{"error": f"unparseable tool call: {exc}", "raw": body}]
        calls: list[Any] = parsed if isinstance(parsed, list) and parsed else [parsed]
        if not all(isinstance(call, dict) and "name" in call for call in calls):
            return [{"error": "a tool call needs a name", "raw": body}]
        out = [{"name": str(call["name"]), "arguments": _arguments(call.get("arguments", {}))} for call in calls]
        head = _JSON_CALL_HEAD.match(body)
        if len(out) == 1 and head is not None and body[head.end()] == "{":
            # The model's own text of the arguments when it is the same value (what the
            # streamed fragments are cut from, however the output was chunked).
            raw = _value_text(body, head.end())
            if raw is not None and _same_json(raw, out[0]["arguments"]):
                out[0]["arguments"] = raw
        return out


def _arguments(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _without_body_tail(arguments: str) -> str:
    """The arguments' text without what may still close the call's body (trailing space, one `}`)."""
    text = arguments.rstrip()
    return (text[:-1] if text.endswith("}") else text).rstrip()


def _value_text(body: str, start: int) -> str | None:
    """The text of the JSON value that begins at `body[start]` (None if none does)."""
    try:
        _, end = json.JSONDecoder().raw_decode(body, start)
    except ValueError:
        return None
    return body[start:end]


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (and is not all of it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def until_marker(buffer: str, marker: str) -> tuple[str, str, bool]:
    """The text before `marker`, what follows it, and True; or, without it, the text that cannot
    be the start of it, the rest (held), and False."""
    index = buffer.find(marker)
    if index >= 0:
        return buffer[:index], buffer[index + len(marker) :], True
    hold = partial_suffix(buffer, marker)
    return buffer[: len(buffer) - hold], buffer[len(buffer) - hold :], False
