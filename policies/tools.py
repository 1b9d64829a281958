"""A request's tools in one shape: OpenAI's `{"type": "function", "function": {...}}` checked."""

from __future__ import annotations

from typing import Any

from protocols.errors import InvalidRequestError

TOOL_SHAPE = '[{"type": "function", "function": {"name": ..., "parameters": {...}}}]'


def tool_function(tool: Any) -> dict:
    """`{"name", "parameters"}` of one tool; `InvalidRequestError(field="tools")` otherwise."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"tools must be {TOOL_SHAPE}", field="tools")
    parameters = function.get("parameters") or {"type": "object"}
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"tool {function['name']!r}: parameters must be a JSON schema object", field="tools")
    return {"name": function["name"], "parameters": parameters}
