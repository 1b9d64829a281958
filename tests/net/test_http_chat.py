"""The OpenAI-compatible HTTP API driven by the official `openai` client: chat completions
streamed and whole, tools, structured output, logprobs, stops, seeds, usage, completions."""

from __future__ import annotations

import json

import jsonschema
import pytest

from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta
from tests.support.http_serving import serving
from tests.support.tool_schemas import CLOCK, WEATHER

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse(path):"}]


async def _native(rt, **request) -> tuple[list[int], str, Finished]:
    ids, text, finished = [], "", None
    async for event in rt.generate(GenerateRequest(**request)):
        if isinstance(event, TokenDelta):
            ids += event.token_ids
            text += event.text
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    return ids, text, finished


# Not marked `server` on purpose: the HTTP round trip that stays in `make test-fast` (docs/tests.md).
async def test_streamed_greedy_tokens_equal_the_in_process_stream():
    async with serving() as served:
        client = served.client()
        for max_tokens in (1, 7, 40):
            stream = await client.chat.completions.create(
                model=served.model,
                messages=MESSAGES,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"return_token_ids": True},
            )
            ids, text, reasons, usage, roles = [], "", [], None, []
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    ids += (choice.model_extra or {}).get("token_ids", [])
                    text += choice.delta.content or ""
                    roles += [choice.delta.role] if choice.delta.role else []
                    reasons += [choice.finish_reason] if choice.finish_reason else []
            native_ids, native_text, finished = await _native(
                served.runtime, messages=MESSAGES, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)
            )
            assert ids == native_ids and text == native_text
            assert roles == ["assistant"] and reasons == [finished.finish_reason]
            assert usage is not None and usage.completion_tokens == finished.usage.completion_tokens
            assert usage.prompt_tokens == finished.usage.prompt_tokens
        await client.close()


@pytest.mark.server
async def test_whole_chat_completion_and_cached_tokens_on_a_repeated_prompt():
    long_messages = [{"role": "user", "content": "Explain this code: " + "x = compute(y) + 1; " * 8}]
    async with serving() as served:
        client = served.client()
        first = await client.chat.completions.create(model=served.model, messages=long_messages, max_tokens=12, temperature=0)
        second = await client.chat.completions.create(model=served.model, messages=long_messages, max_tokens=12, temperature=0)
        await client.close()
        _, native_text, _ = await _native(served.runtime, messages=long_messages, max_tokens=12, sampling=SamplingParams(temperature=0.0))
    for response in (first, second):
        assert response.object == "chat.completion" and response.model == served.model and response.id.startswith("chatcmpl-")
        (choice,) = response.choices
        assert choice.message.role == "assistant" and choice.message.content == native_text
        assert choice.finish_reason == "length" and response.usage.completion_tokens == 12
        assert response.usage.total_tokens == response.usage.prompt_tokens + 12
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 16 <= second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


@pytest.mark.server
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"])
async def test_a_forced_tool_call_streams_as_tool_call_deltas_that_validate(choice):
    async with serving() as served:
        client = served.client()
        stream = await client.chat.completions.create(
            model=served.model,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER, CLOCK],
            tool_choice=choice,
            max_tokens=200,
            stream=True,
        )
        content, calls, reasons = "", [], []
        async for chunk in stream:
            for c in chunk.choices:
                content += c.delta.content or ""
                calls += c.delta.tool_calls or []
                reasons += [c.finish_reason] if c.finish_reason else []
        await client.close()
    assert reasons == ["tool_calls"]
    # The call streams as it is generated: its id and name first, then its arguments in pieces.
    assert calls[0].index == 0 and calls[0].type == "function" and calls[0].id and calls[0].function.name
    assert len(calls) > 3 and all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:])
    [(name, arguments)] = assembled(calls)
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[name]
    if isinstance(choice, dict):
        assert name == "get_time"
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])
    assert "<tool_call>" not in content


def assembled(deltas) -> list[tuple[str, str]]:
    """Streamed tool-call deltas put together as a client does: by index, the name from the
    first, the arguments concatenated."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        name, arguments = calls.setdefault(d.index, ["", ""])
        calls[d.index] = [name + (d.function.name or ""), arguments + (d.function.arguments or "")]
    return [(name, arguments) for name, arguments in calls.values()]


@pytest.mark.server
async def test_streamed_tool_call_arguments_add_up_to_the_whole_responses_arguments():
    async with serving() as served:
        client = served.client()
        kwargs = dict(
            model=served.model, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0
        )
        whole = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(**kwargs, stream=True)
        deltas = [d async for chunk in stream for c in chunk.choices for d in c.delta.tool_calls or []]
        await client.close()
    [call] = whole.choices[0].message.tool_calls
    assert assembled(deltas) == [(call.function.name, call.function.arguments)]


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_tool_call_cut_by_max_tokens_is_a_truncated_call_never_markup(stream):
    """Cut inside its arguments: a tool call with what was generated, finish_reason length;
    cut before its name: no call and no markup (the content stays empty)."""
    async with serving() as served:
        client = served.client()
        kwargs = dict(model=served.model, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice="required", temperature=0)
        full = await client.chat.completions.create(**kwargs, max_tokens=200)
        [complete] = full.choices[0].message.tool_calls
        answers = []
        for max_tokens in (full.usage.completion_tokens - 8, 3):
            if not stream:
                answer = (await client.chat.completions.create(**kwargs, max_tokens=max_tokens)).choices[0]
                answers.append(
                    (answer.message.content or "", [(c.function.name, c.function.arguments) for c in answer.message.tool_calls or []], answer.finish_reason)
                )
                continue
            chunks = await client.chat.completions.create(**kwargs, max_tokens=max_tokens, stream=True)
            content, deltas, reasons = "", [], []
            async for chunk in chunks:
                for c in chunk.choices:
                    content += c.delta.content or ""
                    deltas += c.delta.tool_calls or []
                    reasons += [c.finish_reason] if c.finish_reason else []
            answers.append((content, assembled(deltas), reasons[0]))
        await client.close()
    (cut_content, cut_calls, cut_reason), (early_content, early_calls, early_reason) = answers
    assert "<tool_call>" not in cut_content + early_content and "{" not in cut_content + early_content
    assert cut_reason == early_reason == "length"
    [(name, arguments)] = cut_calls
    assert name == complete.function.name and complete.function.arguments.startswith(arguments) and arguments != complete.function.arguments
    assert early_calls == []


@pytest.mark.server
async def test_an_auto_tool_call_arrives_as_tool_calls_not_markup():
    # Random weights never choose a call on their own: a regex format makes this answer one.
    markup = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "C"\}\}\n</tool_call>'
    async with serving() as served:
        client = served.client()
        kwargs = dict(model=served.model, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice="auto", max_tokens=60)
        fmt = {"response_format": {"type": "regex", "pattern": markup}}
        whole = await client.chat.completions.create(**kwargs, extra_body=fmt)
        stream = await client.chat.completions.create(**kwargs, extra_body=fmt, stream=True)
        content, calls = "", []
        async for chunk in stream:
            for c in chunk.choices:
                content += c.delta.content or ""
                calls += c.delta.tool_calls or []
        await client.close()
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and not message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("get_weather", {"city": "Paris", "unit": "C"})]
    [(name, arguments)] = assembled(calls)
    assert (name, json.loads(arguments)) == ("get_weather", {"city": "Paris", "unit": "C"})
    assert "<tool_call>" not in content


@pytest.mark.server
async def test_json_schema_strict_output_validates_and_json_object_parses():
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    async with serving() as served:
        client = served.client()
        for seed in (1, 2, 3):
            response = await client.chat.completions.create(
                model=served.model,
                messages=[{"role": "user", "content": "A person, please."}],
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
                max_tokens=120,
                temperature=1.0,
                seed=seed,
            )
            assert response.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(response.choices[0].message.content), schema)
        response = await client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "JSON"}], response_format={"type": "json_object"}, max_tokens=200, seed=4
        )
        await client.close()
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)


@pytest.mark.server
async def test_logprobs_and_top_logprobs_per_generated_token():
    async with serving() as served:
        client = served.client()
        whole = await client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
        stream = await client.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
        streamed = [lp async for chunk in stream for c in chunk.choices if c.logprobs for lp in c.logprobs.content]
        await client.close()
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 10
    assert "".join(lp.token for lp in content) == whole.choices[0].message.content
    for lp in content:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0.0
        assert lp.logprob == pytest.approx(max(t.logprob for t in lp.top_logprobs))  # greedy takes the best
        assert bytes(lp.bytes).decode(errors="replace") == lp.token or lp.bytes == list(lp.token.encode())
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in content]


@pytest.mark.server
async def test_stop_strings_end_the_text_before_them():
    async with serving() as served:
        client = served.client()
        free = await client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=30, temperature=0)
        text = free.choices[0].message.content
        stop = text[10:13]
        cut = text[: text.index(stop)]
        stopped = await client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=30, temperature=0, stop=[stop, "never-there"])
        stream = await client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=30, temperature=0, stop=stop, stream=True)
        streamed, reasons = "", []
        async for chunk in stream:
            for c in chunk.choices:
                streamed += c.delta.content or ""
                reasons += [c.finish_reason] if c.finish_reason else []
        await client.close()
    assert stopped.choices[0].message.content == cut == streamed
    assert stopped.choices[0].finish_reason == "stop" and reasons == ["stop"]


@pytest.mark.server
async def test_a_seed_reproduces_sampled_output_and_penalties_pass_through():
    async with serving() as served:
        client = served.client()

        async def sample(seed: int, **extra) -> str:
            response = await client.chat.completions.create(
                model=served.model, messages=MESSAGES, max_tokens=16, temperature=1.0, top_p=0.95, seed=seed, extra_body=extra or None
            )
            return response.choices[0].message.content

        first, again, other = await sample(7), await sample(7), await sample(8)
        penalized = [await sample(7, repetition_penalty=1.3, top_k=20, min_p=0.01) for _ in range(2)]
        penalized += [
            (
                await client.chat.completions.create(
                    model=served.model, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=7, presence_penalty=1.5, frequency_penalty=1.0
                )
            )
            .choices[0]
            .message.content
        ]
        await client.close()
    assert first == again and first != other
    assert penalized[0] == penalized[1]


@pytest.mark.server
async def test_text_completions_from_text_and_token_ids():
    async with serving() as served:
        client = served.client()
        whole = await client.completions.create(model=served.model, prompt="def parse(path):", max_tokens=9, temperature=0, logprobs=2)
        ids = served.runtime.tokenizer.encode("def parse(path):")
        from_ids = await client.completions.create(model=served.model, prompt=ids, max_tokens=9, temperature=0)
        stream = await client.completions.create(
            model=served.model, prompt="def parse(path):", max_tokens=9, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        streamed, usage = "", None
        async for chunk in stream:
            streamed += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        await client.close()
        _, native_text, finished = await _native(served.runtime, prompt="def parse(path):", max_tokens=9, sampling=SamplingParams(temperature=0.0))
    choice = whole.choices[0]
    assert whole.object == "text_completion" and choice.text == native_text == streamed
    assert from_ids.choices[0].text == native_text and from_ids.usage.prompt_tokens == len(ids)
    assert choice.finish_reason == finished.finish_reason == "length" and usage.completion_tokens == 9
    # The legacy shape keys alternatives by their text: two that decode alike (a partial UTF-8 "�") are one.
    assert len(choice.logprobs.tokens) == 9 and all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)


@pytest.mark.server
async def test_models_lists_the_served_model():
    async with serving() as served:
        client = served.client()
        models = [m async for m in client.models.list()]
        one = await client.models.retrieve(served.model)
        await client.close()
    assert [m.id for m in models] == [served.model] == [one.id]
    assert models[0].owned_by == "mlxrt" and models[0].created > 0


@pytest.mark.server
async def test_reasoning_arrives_as_reasoning_content():
    pattern = "<think>plan it</think>done"
    async with serving() as served:
        client = served.client()
        response = await client.chat.completions.create(
            model=served.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=40,
            extra_body={"response_format": {"type": "regex", "pattern": pattern}},
        )
        await client.close()
    message = response.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == "plan it"
    assert message.content == "done"


@pytest.mark.server
async def test_native_extras_pass_through_as_body_fields():
    async with serving() as served:
        client = served.client()
        raw = await client.chat.completions.with_raw_response.create(
            model=served.model,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            extra_body={"request_id": "mine-1", "priority": 3, "fill": "echo", "jump_forward": True, "stop_token_ids": [], "ignore_eos": True},
        )
        response = raw.parse()
        duplicate_ok = await client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=2, extra_body={"request_id": "mine-1"})
        bad = None
        try:
            await client.chat.completions.create(model=served.model, messages=MESSAGES, extra_body={"fill": "sometimes"})
        except Exception as exc:
            bad = exc
        await client.close()
        _, native_text, _ = await _native(served.runtime, messages=MESSAGES, max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    assert raw.headers["x-request-id"] == "mine-1" and response.id == "chatcmpl-mine-1"
    assert response.choices[0].message.content == native_text  # echo spans keep greedy output exact
    assert duplicate_ok.id == "chatcmpl-mine-1"  # the first one ended: its id is free again
    assert getattr(bad, "status_code", None) == 400 and bad.body["param"] == "fill"  # type: ignore[union-attr]
