"""What the coding agents send, answered as the real services answer it: Claude Code's system
messages inside the conversation, the Codex CLI's namespace and web_search tools, a prompt over
the context as Anthropic's "prompt is too long: N tokens > M maximum" and OpenAI's
`context_length_exceeded`, and the `x-mlxrt-tool-choice` header that forces a tool call with the
grammar on a request answering the user (the agents' own CLI runs are in
tests/integration/test_agents.py)."""

from __future__ import annotations

from typing import Any

import anthropic
import msgspec
import openai
import pytest

from net.http import anthropic_types as at
from net.http import responses_api_types as ra
from net.http.anthropic import count_request
from net.http.errors import HttpError
from net.http.forced_tools import TOOL_CHOICE_HEADER, answers_the_user, header_tool_choice, with_header_tool_choice
from net.http.responses_api import chat_tools
from protocols import GenerateRequest
from tests.support.http_serving import serving
from tests.support.tool_schemas import WEATHER

ENVIRONMENT = "# Environment\nPrimary working directory: /tmp/work"
CITY: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"], "additionalProperties": False}
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
TOOL = {"name": "get_weather", "input_schema": CITY}
# The Codex CLI's tool list, in the shapes it sends (a namespace of functions, hosted search).
CODEX_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "get_time", "parameters": NO_ARGUMENTS, "strict": False},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}]},
    {"type": "web_search", "external_web_access": False},
]


def test_a_system_message_inside_the_conversation_is_rendered_at_its_place():
    body = msgspec.convert(
        {
            "model": "m",
            "system": [{"type": "text", "text": "You are terse."}],
            "messages": [{"role": "user", "content": "Say hello"}, {"role": "system", "content": [{"type": "text", "text": ENVIRONMENT}]}],
        },
        at.CountTokensRequest,
    )
    messages = count_request(body).messages
    assert messages == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello"},
        {"role": "system", "content": ENVIRONMENT},
    ]


def test_a_system_message_holds_text_only():
    body = msgspec.convert(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}, {"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}],
        },
        at.CountTokensRequest,
    )
    with pytest.raises(HttpError) as info:
        count_request(body)
    assert info.value.param == "messages[1].content[0].type"


def test_namespace_functions_are_offered_by_their_names_and_hosted_search_is_not():
    tools = msgspec.convert(CODEX_TOOLS, list[ra.Tool])
    offered = chat_tools(tools)
    assert offered is not None and [tool["function"]["name"] for tool in offered] == ["get_time", "get_weather"]
    assert chat_tools(msgspec.convert(CODEX_TOOLS[2:], list[ra.Tool])) is None


def test_the_header_names_a_choice_or_is_refused():
    assert header_tool_choice(" required ") == "required"
    assert header_tool_choice("function:Read") == {"type": "function", "function": {"name": "Read"}}
    for bad in ("any", "function:", "Read"):
        with pytest.raises(HttpError) as info:
            header_tool_choice(bad)
        assert info.value.param == TOOL_CHOICE_HEADER


def test_the_header_forces_a_request_answering_the_user_only():
    tools = [WEATHER]
    user: list[dict[str, Any]] = [{"role": "user", "content": "weather?"}]
    after_tools: list[dict[str, Any]] = [
        *user,
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "sunny"},
        {"role": "user", "content": "<reminder>"},
    ]
    header = {TOOL_CHOICE_HEADER: "required"}
    assert answers_the_user(user) and not answers_the_user(after_tools)
    assert with_header_tool_choice(GenerateRequest(messages=user, tools=tools), header).tool_choice == "required"
    assert with_header_tool_choice(GenerateRequest(messages=user, tools=tools, tool_choice="auto"), header).tool_choice == "required"
    # After tool results the model chooses; an explicit choice, or no tools, is left alone.
    assert with_header_tool_choice(GenerateRequest(messages=after_tools, tools=tools), header).tool_choice is None
    assert with_header_tool_choice(GenerateRequest(messages=user, tools=tools, tool_choice="none"), header).tool_choice == "none"
    assert with_header_tool_choice(GenerateRequest(messages=user), header).tool_choice is None
    assert with_header_tool_choice(GenerateRequest(messages=user, tools=tools), {}).tool_choice is None


@pytest.mark.server
async def test_a_prompt_over_the_context_is_each_apis_own_error():
    long = "word " * 3000  # (over the tiny model's 2,048 tokens, under its prompt-bytes limit)
    async with serving() as served:
        claude = anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0)
        counted = await claude.messages.count_tokens(model=served.model, messages=[{"role": "user", "content": long}])
        with pytest.raises(anthropic.BadRequestError) as too_long:
            await claude.messages.create(model=served.model, max_tokens=8, messages=[{"role": "user", "content": long}], stream=True)
        client = served.client()
        with pytest.raises(openai.BadRequestError) as responses:
            await client.responses.create(model=served.model, input=long, stream=True)
        with pytest.raises(openai.BadRequestError) as chat:
            await client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": long}])
        max_context = served.runtime.model_info.max_context
        await claude.close()
        await client.close()
    body = too_long.value.body
    assert isinstance(body, dict)
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == f"prompt is too long: {counted.input_tokens} tokens > {max_context} maximum"
    for refused in (responses.value, chat.value):
        body = refused.body
        assert isinstance(body, dict) and body["code"] == "context_length_exceeded" and body["type"] == "invalid_request_error"
        assert f"maximum context length is {max_context} tokens" in body["message"]


@pytest.mark.server
async def test_codex_tool_shapes_and_claude_codes_system_messages_are_served():
    async with serving() as served:
        client = served.client()
        response = await client.responses.create(model=served.model, input="What time is it?", tools=CODEX_TOOLS, max_output_tokens=4)  # type: ignore[arg-type]
        claude = anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0)
        message = await claude.messages.create(
            model=served.model,
            max_tokens=4,
            messages=[{"role": "user", "content": "Say hello"}, {"role": "system", "content": [{"type": "text", "text": ENVIRONMENT}]}],
        )
        await client.close()
        await claude.close()
    assert response.status == "incomplete" and [tool.type for tool in response.tools] == ["function", "namespace", "web_search"]
    assert message.stop_reason == "max_tokens"


@pytest.mark.server
async def test_the_header_forces_a_tool_call_on_both_agent_routes():
    """The grammar forces the call (the tiny random model never writes one by itself); its name
    and arguments are the model's own tokens under the tool-call grammar."""
    async with serving() as served:
        claude = anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0, default_headers={TOOL_CHOICE_HEADER: "required"})
        message = await claude.messages.create(model=served.model, max_tokens=64, messages=[{"role": "user", "content": "weather?"}], tools=[TOOL])  # type: ignore[list-item]
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, default_headers={TOOL_CHOICE_HEADER: "function:get_time"})
        response = await client.responses.create(model=served.model, input="time?", tools=CODEX_TOOLS, max_output_tokens=64)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError) as bad:
            await client.responses.create(model=served.model, input="time?", tools=CODEX_TOOLS, extra_headers={TOOL_CHOICE_HEADER: "any"})  # type: ignore[arg-type]
        await claude.close()
        await client.close()
    assert message.stop_reason == "tool_use" and [block.type for block in message.content][-1] == "tool_use"
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_time"
    assert isinstance(bad.value.body, dict) and bad.value.body["param"] == TOOL_CHOICE_HEADER
