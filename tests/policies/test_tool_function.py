"""policies.tools on its own: a tool in OpenAI's shape as `{"name", "parameters"}`, anything else
refused with an error naming `tools`."""

from __future__ import annotations

import pytest

from policies.tools import tool_function
from protocols.errors import InvalidRequestError


def test_a_function_tool_gives_its_name_and_schema():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "weather", "description": "ignored here", "parameters": schema}}
    assert tool_function(tool) == {"name": "weather", "parameters": schema}


def test_a_tool_without_parameters_takes_any_object():
    assert tool_function({"type": "function", "function": {"name": "now"}}) == {"name": "now", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    "tool",
    [
        "weather",
        {"type": "function"},
        {"type": "function", "function": "weather"},
        {"type": "function", "function": {"parameters": {}}},
        {"type": "function", "function": {"name": ""}},
        {"type": "function", "function": {"name": 7}},
        {"type": "function", "function": {"name": "weather", "parameters": "{}"}},
    ],
)
def test_other_shapes_are_refused_naming_tools(tool):
    with pytest.raises(InvalidRequestError) as refused:
        tool_function(tool)
    assert refused.value.field == "tools"
