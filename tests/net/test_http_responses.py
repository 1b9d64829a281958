"""OpenAI's Responses API on the same runtime, driven by the official `openai` client: the greedy
answer equals the chat route's for the same conversation, whole and streamed as `response.*`
events; structured output; forced function calls and a tool round trip; `previous_response_id`
over the store (the prefix cache serves the earlier turn), retrieve and delete; max_output_tokens;
typed refusals naming the field; a client that leaves mid-stream cancels."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import openai
import pytest

from net.http import responses_api_types as ra
from net.http.errors import HttpError
from net.http.mapping import chat_request
from net.http.openai_types import ChatCompletionRequest
from net.http.response_store import ENTRY_OVERHEAD, ResponseStore
from net.http.responses_api import ResponsesOutput, responses_request
from protocols import Finished, TokenDelta
from protocols.api import ToolCall, ToolCallDelta, Usage
from protocols.config import ServerConfig
from tests.support.http_serving import raw_request, serving, wait_runtime_idle
from tests.support.sse import named_events
from tests.support.tool_schemas import CLOCK, WEATHER

pytestmark = pytest.mark.server

SYSTEM = "You write Python."
USER = "def parse(path):"
# The chat route's messages for the same conversation.
CHAT_MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
# Chat's nested function tools as the Responses API's flat ones.
TOOLS = [{"type": "function", **tool["function"]} for tool in (WEATHER, CLOCK)]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


async def _raw_events(client: openai.AsyncOpenAI, **body) -> list[tuple[str, dict]]:
    """A streamed /v1/responses answer as (event name, data) pairs, checked to be nothing else:
    `event:` names its data's `type`, sequence numbers count up from 0, no `[DONE]`."""
    async with client.responses.with_streaming_response.create(**body, stream=True) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = "".join([chunk async for chunk in response.iter_text()])
    events = named_events(text)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return events


async def test_create_and_stream_equal_the_chat_routes_greedy_answer():
    async with serving() as served:
        client = served.client()
        for max_tokens in (7, 40):
            kwargs = dict(model=served.model, instructions=SYSTEM, input=USER, max_output_tokens=max_tokens, temperature=0)
            created = await client.responses.create(**kwargs, metadata={"k": "v"}, user="someone", store=False)
            deltas, kinds, last = "", [], None
            async with client.responses.stream(**kwargs) as stream:
                async for event in stream:
                    kinds.append(event.type)
                    deltas += event.delta if event.type == "response.output_text.delta" else ""
                    last = event
            chat = await client.chat.completions.create(model=served.model, messages=CHAT_MESSAGES, max_tokens=max_tokens, temperature=0)
            answer = chat.choices[0].message.content
            assert created.output_text == deltas == last.response.output_text == answer
            assert created.id.startswith("resp_") and created.object == "response" and created.model == served.model
            assert created.instructions == SYSTEM and created.metadata == {"k": "v"} and created.user == "someone" and created.temperature == 0
            (message,) = created.output
            assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
            assert [part.type for part in message.content] == ["output_text"] and message.content[0].annotations == []
            usage = created.usage
            assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
            assert usage.total_tokens == usage.input_tokens + usage.output_tokens and usage.output_tokens_details.reasoning_tokens == 0
            if chat.choices[0].finish_reason == "length":  # (the greedy answer runs ~1,000 tokens)
                assert created.status == last.response.status == "incomplete" and message.status == "incomplete"
                assert created.incomplete_details.reason == "max_output_tokens" and last.type == "response.incomplete"
            else:
                assert created.status == "completed" and created.incomplete_details is None and last.type == "response.completed"
            assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
            assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
        events = await _raw_events(client, model=served.model, input=USER, instructions=SYSTEM, max_output_tokens=5, temperature=0)
        await client.close()
    created_event, progress = events[0][1]["response"], events[1][1]["response"]
    assert created_event["status"] == progress["status"] == "in_progress" and created_event["output"] == [] and created_event["usage"] is None
    added = events[2][1]
    assert added["output_index"] == 0 and added["item"] == {
        "type": "message",
        "id": added["item"]["id"],
        "status": "in_progress",
        "content": [],
        "role": "assistant",
    }
    text_deltas = [data for name, data in events if name == "response.output_text.delta"]
    assert all(d["item_id"] == added["item"]["id"] and d["output_index"] == 0 and d["content_index"] == 0 for d in text_deltas)
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.incomplete" and final["usage"]["output_tokens"] == 5
    assert final["output"][0]["content"][0]["text"] == "".join(d["delta"] for d in text_deltas)


async def test_a_json_schema_text_format_validates_whole_and_streamed():
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    async with serving() as served:
        client = served.client()
        kwargs = dict(model=served.model, input="A person, please.", text=text, max_output_tokens=120, temperature=0)
        created = await client.responses.create(**kwargs)
        async with client.responses.stream(**kwargs) as stream:
            final = await stream.get_final_response()
        chat = await client.chat.completions.create(
            model=served.model,
            messages=[{"role": "user", "content": "A person, please."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
            max_tokens=120,
            temperature=0,
        )
        objects = await client.responses.create(
            model=served.model, input="JSON", text={"format": {"type": "json_object"}}, max_output_tokens=200, temperature=0
        )
        await client.close()
    assert created.status == final.status == "completed" and created.output_text == final.output_text == chat.choices[0].message.content
    jsonschema.validate(json.loads(created.output_text), PERSON)
    assert created.text.format.type == "json_schema" and created.text.format.name == "person"
    if objects.status == "completed":
        assert isinstance(json.loads(objects.output_text), dict)


@pytest.mark.parametrize(
    ("choice", "chat_choice"),
    [({"type": "function", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}}), ("required", "required")],
    ids=["named", "required"],
)
async def test_a_forced_function_call_has_the_chat_routes_arguments_and_its_output_is_taken_back(choice, chat_choice):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    async with serving() as served:
        client = served.client()
        kwargs = dict(model=served.model, input=question, tools=TOOLS, tool_choice=choice, max_output_tokens=200, temperature=0)
        created = await client.responses.create(**kwargs)
        streamed, added = "", []
        async with client.responses.stream(**kwargs) as stream:
            async for event in stream:
                streamed += event.delta if event.type == "response.function_call_arguments.delta" else ""
                added += [event.item] if event.type == "response.output_item.added" else []
            final = await stream.get_final_response()
        chat = await client.chat.completions.create(
            model=served.model, messages=question, tools=[WEATHER, CLOCK], tool_choice=chat_choice, max_tokens=200, temperature=0
        )
        (chat_call,) = chat.choices[0].message.tool_calls
        # The call's output, sent back with the call (as the SDK gives it, extra fields and all).
        (call,) = created.output
        follow_up = [
            *question,
            {"type": "function_call", "id": call.id, "call_id": call.call_id, "name": call.name, "arguments": call.arguments, "status": "completed"},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
        ]
        answer = await client.responses.create(model=served.model, input=follow_up, tools=TOOLS, max_output_tokens=8, temperature=0)
        chat_answer = await client.chat.completions.create(
            model=served.model,
            messages=[
                *question,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}],
                },
                {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"},
            ],
            tools=[WEATHER, CLOCK],
            max_tokens=8,
            temperature=0,
        )
        await client.close()
    for response in (created, final):
        (item,) = response.output
        assert response.status == "completed" and item.type == "function_call" and item.status == "completed"
        assert item.name == chat_call.function.name and json.loads(item.arguments) == json.loads(chat_call.function.arguments)
        assert item.id.startswith("fc_") and item.call_id
    assert json.loads(streamed) == json.loads(chat_call.function.arguments)
    assert [(item.type, item.name, item.arguments) for item in added] == [("function_call", chat_call.function.name, "")]
    if isinstance(choice, dict):
        assert call.name == "get_time"
    assert answer.usage.input_tokens == chat_answer.usage.prompt_tokens
    assert answer.output_text == (chat_answer.choices[0].message.content or "")


async def test_previous_response_id_continues_a_stored_conversation_retrieved_and_deleted():
    first_input = "Explain this code: " + "x = compute(y) + 1; " * 8
    async with serving() as served:
        client = served.client()
        first = await client.responses.create(model=served.model, input=first_input, max_output_tokens=12, temperature=0)
        second = await client.responses.create(model=served.model, previous_response_id=first.id, input="And in one line?", max_output_tokens=8, temperature=0)
        chat = await client.chat.completions.create(
            model=served.model,
            messages=[
                {"role": "user", "content": first_input},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And in one line?"},
            ],
            max_tokens=8,
            temperature=0,
        )
        retrieved = await client.responses.retrieve(first.id)
        unstored = await client.responses.create(model=served.model, input="hi", max_output_tokens=2, store=False)
        deleted = await client.responses.with_raw_response.delete(second.id)
        errors = []
        for call in (
            lambda: client.responses.retrieve(second.id),
            lambda: client.responses.delete(second.id),
            lambda: client.responses.retrieve(unstored.id),
            lambda: client.responses.create(model=served.model, previous_response_id=second.id, input="more", max_output_tokens=2),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                await call()
            errors.append(info.value.body)
        stored = len(served.http.api.stored_responses)
        await client.close()
    assert second.previous_response_id == first.id and first.previous_response_id is None
    # The second turn's prompt is the whole conversation, and its start is the first turn's prompt.
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.output_text == chat.choices[0].message.content
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert 16 <= second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens
    assert retrieved.id == first.id and retrieved.output_text == first.output_text and retrieved.usage == first.usage
    assert deleted.status_code == 200 and json.loads(deleted.content) == {"id": second.id, "object": "response.deleted", "deleted": True}
    for error in errors:
        assert error["code"] == "not_found" and error["type"] == "not_found_error"
    assert errors[-1]["param"] == "previous_response_id" and second.id in errors[-1]["message"]
    assert stored == 1  # first (second was deleted; unstored was never kept)


async def test_refusals_are_openai_400s_naming_the_field():
    async with serving() as served:
        client = served.client()

        async def refused(body: dict, kind: type[openai.APIStatusError] = openai.BadRequestError) -> dict:
            with pytest.raises(kind) as info:
                await client.post("/responses", cast_to=object, body={"model": served.model, "max_output_tokens": 4, **body})
            error = info.value.body
            assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
            return error

        params = {
            "input[0].role": await refused({"input": [{"role": "bot", "content": "x"}]}),
            "input[0].content[1]": await refused(
                {"input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": "data:,"}]}]}
            ),
            "input[1].type": await refused({"input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": "msg_1"}]}),
            "input[0].arguments": await refused({"input": [{"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "{oops"}]}),
            "input[0]": await refused({"input": [{"type": "function_call_output", "output": "x"}]}),
            "input": await refused({"input": []}),
            "tools[0].type": await refused({"input": "x", "tools": [{"type": "file_search"}]}),
            "tool_choice": await refused({"input": "x", "tool_choice": "required"}),
            "text.format": await refused({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}),
            "max_output_tokens": await refused({"input": "x", "max_output_tokens": 0}),
            "temperature": await refused({"input": "x", "temperature": 3}),
            "background": await refused({"input": "x", "background": True}),
        }
        unknown = await refused({"input": "x", "previous_response_id": "resp_nope"}, openai.NotFoundError)
        model = await refused({"model": "gpt-9", "input": "x"}, openai.NotFoundError)
        await client.close()
    for param, error in params.items():
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == "invalid_request", (param, error)
    assert "input_image" in params["input[0].content[1]"]["message"]
    assert unknown["param"] == "previous_response_id" and unknown["code"] == "not_found" and "resp_nope" in unknown["message"]
    assert model["param"] == "model" and model["code"] == "model_not_found"


async def test_a_client_leaving_mid_stream_cancels_its_request_and_the_routes_are_counted():
    async with serving() as served:
        client = served.client()
        before = (await wait_runtime_idle(served.runtime)).metrics.finished.get("cancelled", 0)
        deltas = 0
        # The greedy answer to this prompt runs ~1,000 tokens: the client leaves long before.
        async with client.responses.stream(model=served.model, input=USER, max_output_tokens=3000, temperature=0) as stream:
            async for event in stream:
                deltas += event.type == "response.output_text.delta"
                if deltas == 3:
                    break
        stats = await wait_runtime_idle(served.runtime)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_unknown")
        await client.close()
        status, _, page = await raw_request(served.url, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
    assert deltas == 3 and stats.live_requests == 0 and stats.kv.live_tokens == 0
    assert stats.metrics.finished.get("cancelled", 0) == before + 1
    assert len(served.http.api.stored_responses) == 0  # a response that never finished is not kept
    assert status == 200 and b'route="/v1/responses",status="200"' in page and b'route="/v1/responses/{response_id}",status="404"' in page


# -- the mapping, the output and the store, without a server -------------------------


def test_a_conversation_maps_onto_the_chat_routes_generate_request():
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "Use "}, {"type": "input_text", "text": "tools."}]},
            {"type": "message", "role": "user", "content": "a"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "ok", "annotations": []}],
            },
            {"type": "function_call", "id": "fc_1", "call_id": "t1", "name": "get_time", "arguments": '{"zone": 1}'},
            {"type": "function_call_output", "call_id": "t1", "output": "12:00"},
            {"role": "user", "content": "next"},
        ],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "name": "get_time"},
        "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON, "strict": True}},
        "max_output_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
    }
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": "a"},
            {
                "role": "assistant",
                "content": "ok",
                "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "12:00"},
            {"role": "user", "content": "next"},
        ],
        "tools": [WEATHER, CLOCK],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}},
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
    }
    turn = responses_request(msgspec.convert(body, ra.ResponsesRequest), ResponseStore(4, 1 << 20))
    theirs = chat_request(msgspec.convert(chat, ChatCompletionRequest))
    fields = ("messages", "tools", "tool_choice", "response_format", "max_tokens", "sampling")
    assert {f: getattr(turn.generate, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert turn.history == theirs.messages[1:]  # (the instructions are not carried over)
    for choice in ("auto", "none", "required"):
        assert (
            responses_request(msgspec.convert({**body, "tool_choice": choice}, ra.ResponsesRequest), ResponseStore(4, 1 << 20)).generate.tool_choice == choice
        )
    text = responses_request(
        msgspec.convert({"model": "m", "input": "hi", "text": {"format": {"type": "text"}}}, ra.ResponsesRequest), ResponseStore(4, 1 << 20)
    )
    assert text.generate.messages == [{"role": "user", "content": "hi"}] and text.generate.response_format is None and text.generate.max_tokens is None


def _wire_bytes(data: bytes) -> list[tuple[str, dict]]:
    frames = [frame.split(b"\n") for frame in data.removesuffix(b"\n\n").split(b"\n\n")]
    return [(name.removeprefix(b"event: ").decode(), json.loads(line.removeprefix(b"data: "))) for name, line in frames]


def _wire(output: ResponsesOutput, events: list) -> list[tuple[str, dict]]:
    return _wire_bytes(b"".join(output.sse(event) for event in events))


def test_reasoning_text_and_calls_stream_as_ordered_items_and_errors_as_error_events():
    store = ResponseStore(4, 1 << 20)
    body = msgspec.convert({"model": "m", "input": "q", "stream": True}, ra.ResponsesRequest)
    output = ResponsesOutput(body, stream=True, store=store, history=[{"role": "user", "content": "q"}])
    events = [output.first_chunk()]
    usage = Usage(prompt_tokens=5, completion_tokens=7, cached_tokens=2)
    for event in (
        TokenDelta(request_id="r", token_ids=[1, 2], text="", reasoning="plan"),
        TokenDelta(request_id="r", token_ids=[3], text="", reasoning=" it"),
        TokenDelta(request_id="r", token_ids=[4], text="done"),
        ToolCallDelta(request_id="r", index=0, id="call-0", name="get_time"),
        ToolCallDelta(request_id="r", index=0, id="call-0", arguments='{"zone"'),
        ToolCall(request_id="r", index=0, id="call-0", name="get_time", arguments='{"zone": 1}'),
        ToolCall(request_id="r", index=1, id="call-1", name="get_weather", arguments='{"city": "Paris", "unit": "C"}'),
        Finished(request_id="r", finish_reason="stop", usage=usage),
    ):
        events += output.on_event(event)
    decoded = _wire(output, events)
    assert output.sse_end() == b""
    assert [data["sequence_number"] for _, data in decoded] == list(range(len(decoded)))
    assert [(name, data.get("output_index")) for name, data in decoded] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.output_item.added", 3),
        ("response.function_call_arguments.delta", 3),
        ("response.function_call_arguments.done", 3),
        ("response.output_item.done", 3),
        ("response.completed", None),
    ]
    assert [data["delta"] for name, data in decoded if name == "response.function_call_arguments.delta"][:2] == ['{"zone"', ": 1}"]
    response = decoded[-1][1]["response"]
    assert [(item["type"], item["status"]) for item in response["output"]] == [
        ("reasoning", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call", "completed"),
    ]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan it"}] and response["output"][0]["summary"] == []
    assert response["output"][2]["call_id"] == "call-0" and response["output"][2]["arguments"] == '{"zone": 1}'
    assert response["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 3},
        "total_tokens": 12,
    }
    # Stored: the response as answered, and the conversation with its output as the assistant's turn.
    stored = store.get(output.id)
    assert json.loads(stored.response) == response
    assert stored.messages() == [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "done",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_time", "arguments": {"zone": 1}}, "id": "call-0"},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, "id": "call-1"},
            ],
        },
    ]
    # Cut by max_output_tokens: the open item and the response are incomplete, a cut call too.
    cut = ResponsesOutput(body, stream=True)
    cut.first_chunk()
    cut.on_event(TokenDelta(request_id="r", token_ids=[1], text="abc"))
    cut_events = cut.on_event(ToolCall(request_id="r", index=0, id="c", name="get_time", arguments='{"zone": ', truncated=True))
    cut_events += cut.on_event(Finished(request_id="r", finish_reason="length", usage=usage))
    final = _wire(cut, cut_events)[-1]
    assert final[0] == "response.incomplete" and final[1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(item["type"], item["status"]) for item in final[1]["response"]["output"]] == [("message", "completed"), ("function_call", "incomplete")]
    # An error mid-stream: OpenAI's error fields as an `error` event, then `response.failed`.
    failed = ResponsesOutput(body, stream=True)
    failed.first_chunk()
    failed.on_event(TokenDelta(request_id="r", token_ids=[1], text="ab"))
    assert failed.on_event(Finished(request_id="r", finish_reason="error", usage=usage, error="boom")) == []
    (error_name, error), (failed_name, failed_data) = _wire_bytes(failed.sse_error(HttpError("internal", "boom", "input")))
    assert error_name == "error" and error == {"type": "error", "sequence_number": 5, "code": "internal", "message": "boom", "param": "input"}
    assert failed_name == "response.failed" and failed_data["sequence_number"] == 6
    assert failed_data["response"]["status"] == "failed" and failed_data["response"]["error"] == {"code": "internal", "message": "boom"}
    assert failed.error_body(HttpError("not_found", "gone"))[1] == 404


def test_the_store_keeps_the_most_recently_used_within_its_count_and_bytes():
    max_bytes = 1000 + 3 * ENTRY_OVERHEAD  # (each entry also costs its objects)
    store = ResponseStore(max_entries=3, max_bytes=max_bytes)
    history = [{"role": "user", "content": "x" * 50}]
    for name in "abc":
        assert store.put(name, b"{}", history)
    store.get("a")  # now the most recently used: "b" goes first
    assert store.put("d", b"{}", history) and len(store) == 3
    with pytest.raises(HttpError) as info:
        store.get("b", "previous_response_id")
    assert info.value.code == "not_found" and info.value.param == "previous_response_id"
    assert not store.put("huge", b"x" * max_bytes, [])  # alone over the bytes: not kept, nothing evicted
    assert len(store) == 3
    assert store.put("big", b"x" * 700, [])  # room made by evicting the least recently used
    assert len(store) <= 3 and store.num_bytes <= max_bytes and store.get("big").response == b"x" * 700
    with pytest.raises(HttpError):
        store.get("c")
    assert store.delete("big") and not store.delete("big")
    assert store.num_bytes == sum(entry.size for entry in store._entries.values())
    none = ResponseStore(max_entries=0, max_bytes=1000)
    assert not none.put("a", b"{}", []) and len(none) == 0
    config = msgspec.convert({"responses_store_max": 8, "responses_store_bytes": 1 << 20}, ServerConfig)
    assert (config.responses_store_max, config.responses_store_bytes) == (8, 1 << 20)
    assert (ServerConfig().responses_store_max, ServerConfig().responses_store_bytes) == (256, 64 << 20)
    for bad in ({"responses_store_max": -1}, {"responses_store_bytes": -1}, {"responses_store_max": "many"}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, ServerConfig)
