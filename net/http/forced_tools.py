"""The `x-mlxrt-tool-choice` request header: a tool choice for clients that cannot set one.

Coding agents (Claude Code, the Codex CLI) always send `tool_choice` auto, and let their users
add headers (`ANTHROPIC_CUSTOM_HEADERS`; a Codex provider's `http_headers`) but not change the
body. With this header a user makes a model that answers in prose call a tool: the choice is
forced by the tool-call grammar (`runtime.grammar`), so the call is the model's own tokens
under that constraint. It applies to a request that answers the user (no tool result since the
last assistant turn), and only where the body asks for auto: after the tool results come back
the model chooses freely, so an agent's loop still ends. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from net.http.errors import HttpError
from protocols.api import GenerateRequest

TOOL_CHOICE_HEADER = "x-mlxrt-tool-choice"
FUNCTION_PREFIX = "function:"


def header_tool_choice(value: str) -> str | dict[str, Any]:
    """The chat `tool_choice` a header value names: `required`, `none`, `auto` or `function:NAME`."""
    value = value.strip()
    if value in ("required", "none", "auto"):
        return value
    name = value.removeprefix(FUNCTION_PREFIX).strip() if value.startswith(FUNCTION_PREFIX) else ""
    if not name:
        raise HttpError("invalid_request", f"{TOOL_CHOICE_HEADER} is required, none, auto or function:NAME, not {value[:64]!r}", TOOL_CHOICE_HEADER)
    return {"type": "function", "function": {"name": name}}


def answers_the_user(messages: list[dict[str, Any]] | None) -> bool:
    """Whether the conversation asks for an answer to the user, not a continuation after tool
    results (a `tool` message since the last assistant one)."""
    for message in reversed(messages or []):
        if message.get("role") == "tool":
            return False
        if message.get("role") == "assistant":
            return True
    return True


def with_header_tool_choice(generate: GenerateRequest, headers: Mapping[str, str]) -> GenerateRequest:
    """`generate` with the header's tool choice, where it applies (see the module docstring)."""
    value = headers.get(TOOL_CHOICE_HEADER)
    if value is None:
        return generate
    choice = header_tool_choice(value)  # (a bad value is refused wherever it would apply)
    if not generate.tools or generate.tool_choice not in (None, "auto") or not answers_the_user(generate.messages):
        return generate
    return msgspec.structs.replace(generate, tool_choice=choice)
