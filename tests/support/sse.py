"""Server-sent events with names (`event: <type>` + `data: <json>`), as Anthropic's and the
Responses API's streams send them."""

from __future__ import annotations

import json


def named_events(text: str) -> list[tuple[str, dict]]:
    """A whole stream's (event name, data) pairs, checked to be nothing else: each frame is one
    `event:` line naming its data's `type` and one `data:` line; no `[DONE]`."""
    assert "[DONE]" not in text and text.endswith("\n\n")
    events = []
    for frame in text.removesuffix("\n\n").split("\n\n"):
        name_line, data_line = frame.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert name_line.startswith("event: ") and data_line.startswith("data: ") and data["type"] == name
        events.append((name, data))
    return events
