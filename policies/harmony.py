"""gpt-oss's harmony output (pure): messages on channels, read as they stream.

    <|channel|>analysis<|message|>reasoning<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

A message's header (up to `<|message|>`) says where its body goes: the analysis channel is
reasoning, a message with a recipient (`to=functions.NAME`, before or after the channel) is a
call whose body is its JSON arguments, anything else (final, commentary preambles) is content.
`<|call|>` and `<|return|>` are end-of-sequence tokens, so the output usually ends there and
they are never seen; a call is closed by the end of the output as well as by its terminator.
"""

from __future__ import annotations

import re

from policies.output_parser import MarkerStream, Parsed, partial_suffix
from policies.tool_formats_json import json_arguments
from policies.tool_stream import CallReporter, CallText, JsonScanner

MESSAGE = "<|message|>"
_TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=(?:functions\.)?([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyParser(MarkerStream):
    """Content (final and commentary), reasoning (analysis) and calls (recipients) of one output.
    `feed`/`flush` as `policies.tool_stream.MarkupParser`."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "header"  # "header", "reasoning", "content" or "call"
        self._name = ""
        self._region = ""
        self._reporter = CallReporter()
        self._scan = JsonScanner()

    def _new_feed(self) -> None:
        self._reporter.new_feed()

    def flush(self) -> Parsed:
        out = Parsed()
        self._new_feed()
        match self._state:
            case "call":
                self._region += self._buffer
                self._reporter.report([self._read(True)], out, closed=True, ended=True)
            case "reasoning":
                out.reasoning = self._buffer
            case "content":
                out.content = self._buffer
            case _:  # a header never finished: text the model wrote outside any message
                out.content = "" if "<|" in self._buffer else self._buffer
        self._buffer, self._region, self._state = "", "", "header"
        return out

    def _step(self, out: Parsed) -> bool:
        buffer = self._buffer
        if self._state == "header":
            index = buffer.find(MESSAGE)
            if index < 0:
                return False
            header, self._buffer = buffer[:index], buffer[index + len(MESSAGE) :]
            recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
            if recipient is not None:
                self._state, self._name, self._region = "call", recipient[1], ""
                self._reporter.new_region()
            else:
                self._state = "reasoning" if channel is not None and channel[1] == "analysis" else "content"
            return True
        found = [(i, t) for t in _TERMINATORS if (i := buffer.find(t)) >= 0]
        if found:
            index, terminator = min(found)
            self._take(buffer[:index], out, closed=True)
            self._buffer, self._state = buffer[index + len(terminator) :], "header"
            return True
        hold = max(partial_suffix(buffer, t) for t in _TERMINATORS)
        self._take(buffer[: len(buffer) - hold], out, closed=False)
        self._buffer = buffer[len(buffer) - hold :]
        return False

    def _take(self, text: str, out: Parsed, *, closed: bool) -> None:
        if self._state == "call":
            self._region += text
            self._reporter.report([self._read(closed)], out, closed=closed, ended=False)
        elif self._state == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _read(self, closed: bool) -> CallText:
        return json_arguments(self._name, self._region, 0, raw=self._region, closed=closed, scan=self._scan)
