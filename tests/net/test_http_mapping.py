"""Between OpenAI's shapes and the runtime's, without a model: bodies decoded with the field at
fault named, requests mapped, events turned into chunks and whole responses."""

from __future__ import annotations

import msgspec
import pytest

from net.http import openai_types as oa
from net.http.errors import HttpError, decode_body, param_of
from net.http.mapping import chat_request, choices, completion_requests
from net.http.outputs import ChatOutput, CompletionOutput, ResponseIds, ending_error
from protocols.api import Finished, GenerateRequest, TokenDelta, ToolCall, Usage

IDS = ResponseIds(id="chatcmpl-r", created=1, model="m", fingerprint="fp")


def _chat(**body) -> oa.ChatCompletionRequest:
    return decode_body(msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}), oa.ChatCompletionRequest)


def _refused(call) -> HttpError:
    with pytest.raises(HttpError) as info:
        call()
    return info.value


def test_decoding_names_the_field_at_fault_and_ignores_unknown_fields():
    error = _refused(lambda: _chat(messages=[{"role": "user", "content": "x"}, {"role": "robot"}]))
    assert error.code == "invalid_request" and error.param == "messages[1].role"
    assert _refused(lambda: _chat(temperature="hot")).param == "temperature"
    assert _refused(lambda: _chat(top_logprobs=21)).param == "top_logprobs"
    assert _refused(lambda: decode_body(b"{", oa.ChatCompletionRequest)).param is None
    assert _chat(user="someone", store=False, metadata={"a": "b"}).model == "m"


def test_runtime_fields_are_named_as_the_openai_parameters_they_came_from():
    assert param_of("sampling.temperature", "chat") == "temperature"
    assert param_of("prompt_ids", "chat") == "messages" and param_of("prompt_ids", "completions") == "prompt"
    assert param_of("response_format", "chat") == "response_format" and param_of(None, "chat") is None


def test_chat_bodies_map_onto_generate_requests():
    request = chat_request(
        _chat(
            messages=[
                {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "content": "2", "tool_call_id": "c1"},
            ],
            max_tokens=5,
            max_completion_tokens=7,
            temperature=0,
            stop="END",
            seed=3,
            top_k=4,
            priority=2,
            logprobs=True,
            top_logprobs=2,
        )
    )
    system, assistant, tool = request.messages
    assert system == {"role": "system", "content": "be brief"}
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}} and assistant["content"] == ""
    assert tool["tool_call_id"] == "c1"
    assert request.max_tokens == 7 and request.stop == ["END"] and request.priority == 2
    assert request.sampling.temperature == 0 and request.sampling.seed == 3 and request.sampling.top_k == 4
    assert request.logprobs and request.top_logprobs == 2


def test_what_has_no_equivalent_is_refused_naming_it():
    assert len(choices([chat_request(_chat(n=3))], 3)) == 3
    assert _refused(lambda: choices([chat_request(_chat())], 65)).param == "n"
    assert _refused(lambda: chat_request(_chat(top_logprobs=2))).param == "top_logprobs"
    image = [{"type": "text", "text": "x"}, {"type": "image_url"}]
    assert _refused(lambda: chat_request(_chat(messages=[{"role": "user", "content": image}]))).param == "messages[0].content[1].type"
    bad_args = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1"}}]}]
    assert _refused(lambda: chat_request(_chat(messages=bad_args))).param == "messages[0].tool_calls[0].function.arguments"

    def completion(**body):
        return completion_requests(decode_body(msgspec.json.encode({"model": "m", **body}), oa.CompletionRequest))

    assert completion(prompt=["one"])[0].prompt == "one" and completion(prompt=[[5, 6]])[0].prompt_ids == [5, 6]
    assert [r.prompt for r in completion(prompt=["a", "b"])] == ["a", "b"]
    assert completion(prompt="x")[0].max_tokens == 16  # OpenAI's default for this endpoint
    echo = completion(prompt="x", echo=True, logprobs=2, max_tokens=0)[0]
    assert echo.prompt_logprobs == 2 and echo.max_tokens == 1  # (the generated token is left out)
    assert _refused(lambda: completion(prompt=[True, 2])).param == "prompt"
    assert _refused(lambda: completion(prompt="x", max_tokens=0)).param == "max_tokens"
    seeded = choices([chat_request(_chat(seed=5))], 3)
    assert [r.sampling.seed for r in seeded] == [5, 6, 7] and len({r.request_id for r in seeded}) == 3


def _finished(reason: str = "stop", completion: int = 3) -> Finished:
    return Finished(request_id="r", finish_reason=reason, usage=Usage(prompt_tokens=4, completion_tokens=completion, cached_tokens=2))  # type: ignore[arg-type]


def test_a_streamed_tool_call_is_a_tool_calls_delta_and_ends_with_tool_calls():
    output = ChatOutput(IDS, token_text=str, include_usage=True, stream=True)  # type: ignore[arg-type]
    chunks = [output.first_chunk()]
    chunks += output.on_event(TokenDelta(request_id="r", token_ids=[1], text="", reasoning="hmm"))
    chunks += output.on_event(ToolCall(request_id="r", index=0, id="call-1", name="f", arguments='{"a": 1}'))
    chunks += output.on_event(_finished())
    wire = [msgspec.to_builtins(c) for c in chunks]
    assert wire[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert wire[1]["choices"][0]["delta"] == {"reasoning_content": "hmm"}
    assert wire[2]["choices"][0]["delta"]["tool_calls"] == [
        {"id": "call-1", "function": {"name": "f", "arguments": '{"a": 1}'}, "type": "function", "index": 0}
    ]
    assert wire[3]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(w["usage"] is None for w in wire[:4])
    assert wire[4]["choices"] == [] and wire[4]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    whole = msgspec.to_builtins(output.response())
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f" and "index" not in whole["choices"][0]["message"]["tool_calls"][0]


def test_a_whole_completion_joins_its_text_and_requests_that_did_not_complete_are_errors():
    output = CompletionOutput(IDS, token_text=lambda i: f"<{i}>")
    assert output.on_event(TokenDelta(request_id="r", token_ids=[1, 2], text="ab")) == []
    output.on_event(TokenDelta(request_id="r", token_ids=[3], text="c"))
    output.on_event(_finished("length"))
    response = output.response()
    assert response.choices[0].text == "abc" and response.choices[0].finish_reason == "length" and response.usage.total_tokens == 7  # type: ignore[union-attr]
    assert ending_error(_finished("length")) is None
    assert ending_error(_finished("cancelled")).code == "shutting_down"  # type: ignore[union-attr]
    assert ending_error(_finished("error")).code == "internal"  # type: ignore[union-attr]


def test_several_choices_are_bulk_work_and_one_is_not():
    request = GenerateRequest(prompt="hi", request_id="r")
    assert [c.bulk for c in choices([request], 1)] == [False]
    many = choices([request, msgspec.structs.replace(request, prompt="ho")], 2)
    assert [c.request_id for c in many] == ["r-0", "r-1", "r-2", "r-3"] and all(c.bulk for c in many)
