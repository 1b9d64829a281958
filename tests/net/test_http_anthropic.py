"""Anthropic's Messages API on the same runtime, driven by the official `anthropic` client: the
greedy answer equals the runtime's own and the OpenAI route's for the same conversation, streamed
as Anthropic's event sequence; forced tool calls, a tool round trip, count_tokens, stop sequences,
max_tokens; Anthropic's error bodies and statuses; a client that leaves mid-stream cancels."""

from __future__ import annotations

import json

import anthropic
import msgspec
import pytest

from net.http import anthropic_types as at
from net.http.anthropic import MessagesOutput, anthropic_error, messages_request
from net.http.errors import HttpError
from net.http.mapping import chat_request
from net.http.openai_types import ChatCompletionRequest
from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta
from protocols.api import ToolCall, Usage
from runtime.config import CheckpointConfig, PoolModelConfig
from tests.support.config import make_config
from tests.support.http_serving import raw_request, serving, wait_runtime_idle
from tests.support.sse import named_events
from tests.support.tool_schemas import CLOCK, WEATHER

pytestmark = pytest.mark.server

SYSTEM = "You write Python."
USER = "def parse(path):"
# The OpenAI route's messages for the same conversation.
OPENAI_MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
GREEDY = {"temperature": 0}  # (this SDK's create() takes sampling options only as body fields)


def _tool(openai_tool: dict) -> dict:
    """An OpenAI function tool as Anthropic's tool."""
    function = openai_tool["function"]
    return {"name": function["name"], **({"description": function["description"]} if "description" in function else {}), "input_schema": function["parameters"]}


TOOLS = [_tool(WEATHER), _tool(CLOCK)]


def _client(served, api_key: str = "unused", **kwargs) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=served.url, api_key=api_key, max_retries=0, timeout=60.0, **kwargs)


async def _native(rt, **request) -> tuple[str, Finished]:
    text, finished = "", None
    async for event in rt.generate(GenerateRequest(**request)):
        if isinstance(event, TokenDelta):
            text += event.text
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    return text, finished


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


async def _raw_events(client: anthropic.AsyncAnthropic, **body) -> list[tuple[str, dict]]:
    """A streamed /v1/messages answer as (event name, data) pairs, checked to be nothing else."""
    async with client.messages.with_streaming_response.create(**body, stream=True) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = "".join([chunk async for chunk in response.iter_text()])
    events = named_events(text)
    return events


async def test_create_and_stream_equal_the_runtime_greedy_answer_in_anthropic_shapes():
    async with serving() as served:
        client, openai_client = _client(served), served.client()
        for max_tokens in (7, 40):
            kwargs = dict(model=served.model, system=SYSTEM, messages=[{"role": "user", "content": USER}], max_tokens=max_tokens, extra_body=GREEDY)
            created = await client.messages.create(**kwargs, metadata={"user_id": "someone"}, thinking={"type": "enabled", "budget_tokens": 1024})
            async with client.messages.stream(**kwargs) as stream:
                streamed_text = "".join([text async for text in stream.text_stream])
                final = await stream.get_final_message()
            chat = await openai_client.chat.completions.create(model=served.model, messages=OPENAI_MESSAGES, max_tokens=max_tokens, temperature=0)
            native_text, finished = await _native(served.runtime, messages=OPENAI_MESSAGES, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0))
            assert _text(created) == streamed_text == _text(final) == chat.choices[0].message.content == native_text
            assert created.id.startswith("msg_") and created.type == "message" and created.role == "assistant" and created.model == served.model
            assert [block.type for block in created.content] == ["text"] and created.stop_sequence is None
            assert created.stop_reason == final.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finished.finish_reason]
            for usage in (created.usage, final.usage):
                assert usage.output_tokens == finished.usage.completion_tokens
                assert usage.input_tokens + usage.cache_read_input_tokens == finished.usage.prompt_tokens and usage.cache_creation_input_tokens == 0
        events = await _raw_events(client, model=served.model, system=SYSTEM, messages=[{"role": "user", "content": USER}], max_tokens=12, extra_body=GREEDY)
        await client.close()
        await openai_client.close()
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * (len(names) - 5), "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == finished.usage.prompt_tokens
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(data["index"] == 0 and data["delta"]["type"] == "text_delta" for _, data in events[2:-3])
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and delta["usage"]["output_tokens"] == 12


@pytest.mark.parametrize(
    ("choice", "openai_choice"),
    [({"type": "tool", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}}), ({"type": "any"}, "required")],
    ids=["tool", "any"],
)
async def test_a_forced_tool_call_is_a_tool_use_block_with_the_chat_routes_arguments(choice, openai_choice):
    question = "Weather in Paris?"
    async with serving() as served:
        client, openai_client = _client(served), served.client()
        kwargs = dict(model=served.model, messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice=choice, max_tokens=200, extra_body=GREEDY)
        created = await client.messages.create(**kwargs)
        partial, kinds = "", []
        async with client.messages.stream(**kwargs) as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    partial += event.delta.partial_json
            final = await stream.get_final_message()
        chat = await openai_client.chat.completions.create(
            model=served.model,
            messages=[{"role": "user", "content": question}],
            tools=[WEATHER, CLOCK],
            tool_choice=openai_choice,
            max_tokens=200,
            temperature=0,
        )
        await client.close()
        await openai_client.close()
    (call,) = chat.choices[0].message.tool_calls
    expected = json.loads(call.function.arguments)
    # The input streams as it is generated, not in one piece at the end.
    assert kinds.count("content_block_delta") > 3 and json.loads(partial) == expected
    for message in (created, final):
        uses = [block for block in message.content if block.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1
        assert uses[0].name == call.function.name and uses[0].input == expected and uses[0].id
    assert json.loads(partial) == expected
    if choice["type"] == "tool":
        assert call.function.name == "get_time"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


async def test_a_tool_round_trip_renders_the_chat_routes_prompt_and_is_answered():
    arguments = {"city": "Paris", "unit": "C"}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me check."}, {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": arguments}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C, sunny"}]},
                {"type": "text", "text": "Thanks. In one line?"},
            ],
        },
    ]
    openai_messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"},
        {"role": "user", "content": "Thanks. In one line?"},
    ]
    async with serving() as served:
        client, openai_client = _client(served), served.client()
        answer = await client.messages.create(model=served.model, messages=messages, tools=TOOLS, max_tokens=24, extra_body=GREEDY)
        counted = await client.messages.count_tokens(model=served.model, messages=messages, tools=TOOLS)
        chat = await openai_client.chat.completions.create(model=served.model, messages=openai_messages, tools=[WEATHER, CLOCK], max_tokens=24, temperature=0)
        await client.close()
        await openai_client.close()
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat.usage.prompt_tokens == counted.input_tokens
    assert _text(answer) == (chat.choices[0].message.content or "")
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls or []]
    assert [(b.name, b.input) for b in answer.content if b.type == "tool_use"] == calls


async def test_count_tokens_is_the_prompt_a_create_reports_and_stops_end_as_anthropic_says():
    async with serving() as served:
        client = _client(served)
        base = dict(model=served.model, system=[{"type": "text", "text": SYSTEM}], messages=[{"role": "user", "content": USER}])
        counted = await client.messages.count_tokens(**base, tools=TOOLS)
        plain = await client.messages.count_tokens(**base)
        created = await client.messages.create(**base, tools=TOOLS, max_tokens=1, extra_body=GREEDY)
        # Stop sequences: the text ends before the first match, which is reported.
        free = await client.messages.create(**base, max_tokens=30, extra_body=GREEDY)
        text = _text(free)
        stop = text[10:13]
        stopped = await client.messages.create(**base, max_tokens=30, stop_sequences=[stop, "never-there"], extra_body=GREEDY)
        async with client.messages.stream(**base, max_tokens=30, stop_sequences=[stop], extra_body=GREEDY) as stream:
            streamed = await stream.get_final_message()
        longest = await client.messages.create(**base, max_tokens=5, extra_body=GREEDY)
        await client.close()
    assert counted.input_tokens == created.usage.input_tokens + created.usage.cache_read_input_tokens
    assert plain.input_tokens < counted.input_tokens  # the tools are part of the prompt
    assert free.stop_reason == "max_tokens" and free.usage.output_tokens == 30
    for message in (stopped, streamed):
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop and _text(message) == text[: text.index(stop)]
    assert longest.stop_reason == "max_tokens" and longest.usage.output_tokens == 5 and longest.stop_sequence is None


async def test_a_conversation_mapped_in_the_worker_process_is_answered_as_one_mapped_here():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": USER}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look."}, {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "12 C"}]}, {"type": "text", "text": "and?"}],
        },
    ]
    answers = []
    for config in (make_config(), make_config(bulk_tokenize_bytes=1)):
        async with serving(config) as served:
            client = _client(served)
            base = dict(model=served.model, system=SYSTEM, messages=messages, tools=TOOLS)
            counted = await client.messages.count_tokens(**base)
            created = await client.messages.create(**base, max_tokens=12, extra_body=GREEDY)
            await client.close()
            answers.append((counted.input_tokens, created.usage.input_tokens, created.content))
    assert answers[0] == answers[1] and answers[0][0] > 50


@pytest.mark.parametrize("offloaded", [False, True])
async def test_refusals_are_anthropic_errors_with_their_statuses(offloaded):
    # (Offloaded: every body is decoded, checked and mapped in the tokenizer's worker process,
    # as a big conversation's is, and its errors come back the same.)
    async with serving(make_config(bulk_tokenize_bytes=1) if offloaded else None) as served:
        client = _client(served)
        user = [{"role": "user", "content": "hi"}]

        async def refused(body: dict, kind: type[anthropic.APIStatusError] = anthropic.BadRequestError) -> dict:
            with pytest.raises(kind) as info:
                await client.post("/v1/messages", cast_to=object, body={"model": served.model, **body})
            error = info.value.body
            assert isinstance(error, dict) and error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
            return error["error"]

        missing = await refused({"messages": user})
        role = await refused({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4})
        image = await refused(
            {
                "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}],
                "max_tokens": 4,
            }
        )
        server_tool = await refused({"messages": user, "max_tokens": 4, "tools": [{"type": "bash_20250124", "name": "bash"}]})
        prefill = await refused({"messages": [*user, {"role": "assistant", "content": "{"}], "max_tokens": 4})
        forced = await refused({"messages": user, "max_tokens": 4, "tool_choice": {"type": "any"}})
        unknown = await refused({"model": "claude-opus-9", "messages": user, "max_tokens": 4}, anthropic.NotFoundError)
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(model="claude-opus-9", messages=user)
        not_json, _, not_json_body = await raw_request(
            served.url, b"POST /v1/messages HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 5\r\n", b"{oops"
        )
        method, _, method_body = await raw_request(served.url, b"GET /v1/messages HTTP/1.1\r\nHost: localhost\r\n")
        await client.close()
    for error in (missing, role, image, server_tool, prefill, forced):
        assert error["type"] == "invalid_request_error"
    assert "max_tokens" in missing["message"] and "messages[0].role" in role["message"]
    assert "not a vision-language model" in image["message"]  # tests/net/test_http_vision.py sends one that is
    assert "tools[0].type" in server_tool["message"] and "messages[1].role" in prefill["message"] and "tool_choice" in forced["message"]
    assert unknown["type"] == "not_found_error" and "claude-opus-9" in unknown["message"]
    assert not_json == 400 and json.loads(not_json_body)["error"]["type"] == "invalid_request_error"
    assert method == 405 and json.loads(method_body)["type"] == "error"


async def test_the_key_is_taken_as_x_api_key_or_bearer_and_refused_in_anthropics_shape():
    async with serving(api_key="s3cret") as served:
        async with _client(served, "s3cret-not") as wrong:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await wrong.messages.create(model=served.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        async with _client(served, "s3cret") as right:  # x-api-key
            ok = await right.messages.create(model=served.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        async with anthropic.AsyncAnthropic(base_url=served.url, auth_token="s3cret", max_retries=0) as bearer:
            counted = await bearer.messages.count_tokens(model=served.model, messages=[{"role": "user", "content": "hi"}])
        # The OpenAI routes take x-api-key too (and keep OpenAI's error JSON).
        models, _, _ = await raw_request(served.url, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nx-api-key: s3cret\r\n")
        refused, _, refused_body = await raw_request(served.url, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nx-api-key: nope\r\n")
    assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert ok.usage.output_tokens <= 2 and counted.input_tokens > 0
    assert models == 200 and refused == 401 and json.loads(refused_body)["error"]["code"] == "unauthorized"


async def test_a_client_leaving_mid_stream_cancels_its_request_and_the_route_is_counted():
    async with serving() as served:
        client = _client(served)
        before = (await wait_runtime_idle(served.runtime)).metrics.finished.get("cancelled", 0)
        deltas = 0
        # The greedy answer to this prompt runs ~1,000 tokens: the client leaves long before.
        async with client.messages.stream(model=served.model, messages=[{"role": "user", "content": USER}], max_tokens=3000, extra_body=GREEDY) as stream:
            async for event in stream:
                deltas += event.type == "content_block_delta"
                if deltas == 3:
                    break
        stats = await wait_runtime_idle(served.runtime)
        await client.close()
        status, _, page = await raw_request(served.url, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
    assert deltas == 3 and stats.live_requests == 0 and stats.kv.live_tokens == 0
    assert stats.metrics.finished.get("cancelled", 0) == before + 1
    assert status == 200 and b'route="/v1/messages",status="200"' in page


async def test_a_model_pool_counts_and_streams_with_the_named_model(tmp_path):
    config = msgspec.structs.replace(
        make_config(), models=[PoolModelConfig(name="qwen", path="builtin:tiny-qwen2")], checkpoints=CheckpointConfig(dir=str(tmp_path / "checkpoints"))
    )
    messages = [{"role": "user", "content": USER}]
    async with serving(config, pool=True) as served:
        client = _client(served)
        counted = await client.messages.count_tokens(model="qwen", messages=messages)  # loads it
        async with client.messages.stream(model="qwen", messages=messages, max_tokens=4, extra_body=GREEDY) as stream:
            started = None
            async for event in stream:
                started = started or (event.message.usage.input_tokens if event.type == "message_start" else None)
            final = await stream.get_final_message()
        await client.close()
    assert started == counted.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert final.model == "qwen" and final.usage.output_tokens == 4


# -- the mapping, without a server ----------------------------------------------------


def test_a_conversation_maps_onto_the_chat_routes_generate_request():
    anthropic_body = {
        "model": "m",
        "max_tokens": 9,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "ok"},
                    {"type": "tool_use", "id": "t1", "name": "get_time", "input": {"zone": 1}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "12:00", "is_error": False}, {"type": "text", "text": "next"}],
            },
        ],
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_time"},
        "stop_sequences": ["\n\n"],
        "temperature": 0.5,
        "top_k": 4,
    }
    openai_body = {
        "model": "m",
        "max_tokens": 9,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": "ok",
                "reasoning_content": "hmm",
                "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "12:00"},
            {"role": "user", "content": "next"},
        ],
        "tools": [WEATHER, CLOCK],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "stop": ["\n\n"],
        "temperature": 0.5,
        "top_k": 4,
    }
    ours = messages_request(msgspec.convert(anthropic_body, at.MessagesRequest))
    theirs = chat_request(msgspec.convert(openai_body, ChatCompletionRequest))
    fields = ("messages", "tools", "tool_choice", "max_tokens", "stop", "sampling")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    for choice, expected in (({"type": "any"}, "required"), ({"type": "none"}, "none"), ({"type": "auto"}, "auto")):
        assert messages_request(msgspec.convert({**anthropic_body, "tool_choice": choice}, at.MessagesRequest)).tool_choice == expected


def test_reasoning_text_and_calls_stream_as_ordered_blocks_and_errors_as_error_events():
    output = MessagesOutput("msg_1", "m", stream=True, input_tokens=5)
    events = [output.first_chunk()]
    usage = Usage(prompt_tokens=5, completion_tokens=7, cached_tokens=2)
    for event in (
        TokenDelta(request_id="r", token_ids=[1], text="", reasoning="plan"),
        TokenDelta(request_id="r", token_ids=[2], text="", reasoning=" it"),
        TokenDelta(request_id="r", token_ids=[3], text="done"),
        ToolCall(request_id="r", index=0, id="call-r-0", name="get_time", arguments='{"zone": 1}'),
        Finished(request_id="r", finish_reason="stop", usage=usage),
    ):
        events += output.on_event(event)
    wire = b"".join(output.sse(e) for e in events) + output.sse_end()
    frames = [frame.split(b"\n") for frame in wire.removesuffix(b"\n\n").split(b"\n\n")]
    decoded = [(name.removeprefix(b"event: ").decode(), json.loads(data.removeprefix(b"data: "))) for name, data in frames]
    assert [(name, data.get("index"), (data.get("delta") or data.get("content_block") or {}).get("type")) for name, data in decoded] == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert decoded[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert decoded[-2][1]["usage"] == {"input_tokens": 3, "output_tokens": 7, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 2}
    message = msgspec.to_builtins(output.response())
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][0]["thinking"] == "plan it" and message["content"][2]["input"] == {"zone": 1}
    cut = MessagesOutput("msg_3", "m")  # a call the output ended inside (max_tokens): no valid arguments yet
    cut.on_event(ToolCall(request_id="r", index=0, id="call-r-0", name="get_time", arguments='{"zone": '))
    cut.on_event(Finished(request_id="r", finish_reason="length", usage=usage))
    assert msgspec.to_builtins(cut.response())["content"] == [{"type": "tool_use", "id": "call-r-0", "name": "get_time", "input": {}}]
    assert cut.response().stop_reason == "max_tokens"
    failed = MessagesOutput("msg_2", "m", stream=True)
    assert failed.on_event(Finished(request_id="r", finish_reason="error", usage=usage, error="boom")) == []
    assert failed.sse_error(HttpError("internal", "boom")) == b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n'


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("invalid_request", 400, "invalid_request_error"),
        ("unauthorized", 401, "authentication_error"),
        ("model_not_found", 404, "not_found_error"),
        ("body_too_large", 413, "request_too_large"),
        ("busy", 529, "overloaded_error"),
        ("internal", 500, "api_error"),
        ("shutting_down", 503, "api_error"),
    ],
)
def test_error_codes_map_to_anthropic_types_and_statuses(code, status, kind):
    body, got = anthropic_error(HttpError(code, "why", "field"))
    assert got == status and msgspec.to_builtins(body) == {"type": "error", "error": {"type": kind, "message": "field: why"}}
