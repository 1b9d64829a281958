"""Splitting a request's streamed text into content, reasoning and tool calls (pure).

A leading `<think>...</think>` block (the model's own markers) is reasoning; with
tools, `<tool_call>...</tool_call>` spans (the model's own markup) are parsed by
the model's tool parser into calls. Text that could be the start of a marker is
held back until it is known not to be one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)


class OutputParser:
    def __init__(
        self,
        *,
        think: tuple[str, str] | None = None,
        tool_markers: tuple[str, str] | None = None,
        parse_call: Callable[[str], dict] | None = None,
    ):
        self._think = think
        self._tools = tool_markers
        self._parse_call = parse_call
        self._buffer = ""
        # "start" (might open a think block), "think", "content", or "call".
        self._state = "start" if think else "content"

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        while self._step(out):
            pass
        return out

    def flush(self) -> Parsed:
        """End of output: whatever is held is content (an unfinished call stays visible text)."""
        out = Parsed()
        prefix = self._tools[0] if self._tools is not None and self._state == "call" else ""
        target = "reasoning" if self._state == "think" else "content"
        setattr(out, target, prefix + self._buffer)
        self._buffer = ""
        return out

    def _step(self, out: Parsed) -> bool:
        """Consume what can be decided now; True if progress was made and more may follow."""
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
                return False
            out.calls.extend(self._calls(buffer[:index]))
            self._buffer, self._state = buffer[index + len(tools[1]) :], "content"
            return True
        return self._until(tools[0], out, "content", next_state="call")

    def _until(self, marker: str, out: Parsed, target: str, next_state: str) -> bool:
        """Move text before `marker` to `target`; on the marker switch state. Holds partial markers."""
        buffer = self._buffer
        index = buffer.find(marker)
        if index >= 0:
            setattr(out, target, getattr(out, target) + buffer[:index])
            self._buffer, self._state = buffer[index + len(marker) :], next_state
            return True
        hold = _partial_suffix(buffer, marker)
        setattr(out, target, getattr(out, target) + buffer[: len(buffer) - hold])
        self._buffer = buffer[len(buffer) - hold :]
        return False

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
        return [{"name": str(call["name"]), "arguments": _arguments(call.get("arguments", {}))} for call in calls]


def _arguments(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
