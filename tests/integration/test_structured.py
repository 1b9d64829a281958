"""Structured output through xgrammar: schemas, regexes, grammars, tool calls, jump-forward."""

from __future__ import annotations

import json
import random
import re

import anyio
import jsonschema
import pytest

from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta, ToolCall
from runtime import InvalidRequestError, Runtime
from runtime.grammar import grammar_spec
from tests.support.config import make_config
from tests.support.tool_schemas import CLOCK, WEATHER


def _schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema: required keys, enums, bounded numbers and strings, nested arrays."""
    properties = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["integer", "number", "string", "enum", "boolean", "array"] + (["object"] if depth < 1 else []))
        if kind == "integer":
            spec = {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 500)}
        elif kind == "number":
            spec = {"type": "number", "minimum": -1000, "maximum": 1000}
        elif kind == "string":
            spec = {"type": "string", "maxLength": rng.randint(1, 12)}
        elif kind == "enum":
            spec = {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, True], rng.randint(1, 4))}
        elif kind == "boolean":
            spec = {"type": "boolean"}
        elif kind == "array":
            spec = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": rng.randint(0, 4)}
        else:
            spec = _schema(rng, depth + 1)
        properties[f"k{i}_{kind}"] = spec
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


async def _run(rt: Runtime, request: GenerateRequest) -> tuple[str, list[int], list[ToolCall], Finished]:
    text, ids, calls, finished = "", [], [], None
    async for event in rt.generate(request):
        if isinstance(event, TokenDelta):
            text += event.text
            ids += event.token_ids
        elif isinstance(event, ToolCall):
            calls.append(event)
        elif isinstance(event, Finished):
            finished = event
    return text, ids, calls, finished


@pytest.mark.slow
@pytest.mark.parametrize("model", ["builtin:tiny", "builtin:tiny-qwen2"])
async def test_a_hundred_schemas_all_validate(model):
    rng = random.Random(11)
    schemas = [_schema(rng) for _ in range(50)]
    async with Runtime.open(make_config(model, max_batch_size=8)) as rt:
        results: dict = {}

        async def constrained(i: int) -> None:
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}}
            request = GenerateRequest(prompt=f"record {i}:", max_tokens=400, response_format=fmt, jump_forward=i % 2 == 0)
            results[i] = await _run(rt, request)

        async def free(i: int) -> None:
            results[f"free{i}"] = await _run(rt, GenerateRequest(prompt_ids=[i + 1, 2, 3], max_tokens=30, ignore_eos=True))

        async with anyio.create_task_group() as tg:
            for i in range(len(schemas)):
                tg.start_soon(constrained, i)
            for i in range(6):  # unconstrained requests share the batches
                tg.start_soon(free, i)
    for i, schema in enumerate(schemas):
        text, _, _, finished = results[i]
        assert finished.finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert all(len(results[f"free{i}"][1]) == 30 for i in range(6))


async def test_json_object_regex_and_ebnf(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        # Free-form JSON has unbounded strings; sampling (seeded) lets a random model close them.
        sampling = SamplingParams(temperature=1.0, seed=3)
        text, *_ = await _run(rt, GenerateRequest(prompt="x", max_tokens=400, response_format={"type": "json_object"}, sampling=sampling))
        assert isinstance(json.loads(text), dict)
        text, *_ = await _run(rt, GenerateRequest(prompt="x", max_tokens=50, response_format={"type": "regex", "pattern": "[a-c]{2,5}-[0-9]{3}"}))
        assert re.fullmatch("[a-c]{2,5}-[0-9]{3}", text)
        ebnf = 'root ::= "answer: " ("yes" | "no") "."'
        text, *_ = await _run(rt, GenerateRequest(prompt="x", max_tokens=20, response_format={"type": "grammar", "ebnf": ebnf}))
        assert text in ("answer: yes.", "answer: no.")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"])
async def test_forced_tool_calls_arrive_as_events_and_validate(tiny_config, choice):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    async with Runtime.open(tiny_config) as rt:
        text, ids, calls, finished = await _run(
            rt, GenerateRequest(messages=messages, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=200, jump_forward=True)
        )
    assert finished.finish_reason == "stop" and len(calls) == 1
    call = calls[0]
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]
    if isinstance(choice, dict):
        assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])
    assert "<tool_call>" not in text and ids


async def test_jump_forward_needs_fewer_forwards_than_tokens(tiny_config):
    schema = {
        "type": "object",
        "properties": {"a_rather_long_constant_key_name": {"enum": ["first-option-value"]}, "another_long_key_for_the_test": {"type": "boolean"}},
        "required": ["a_rather_long_constant_key_name", "another_long_key_for_the_test"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}
    async with Runtime.open(tiny_config) as rt:
        counts = {}
        for jump in (False, True):
            before = (await rt.stats()).scheduler.steps
            text, ids, _, _ = await _run(rt, GenerateRequest(prompt="x", max_tokens=200, response_format=fmt, jump_forward=jump))
            counts[jump] = ((await rt.stats()).scheduler.steps - before, len(ids), json.loads(text))
    (plain_steps, plain_tokens, plain), (jump_steps, jump_tokens, jumped) = counts[False], counts[True]
    assert plain_steps >= plain_tokens, "without jump-forward every token costs a forward"
    assert jump_steps * 2 < jump_tokens, f"{jump_steps} forwards for {jump_tokens} tokens"
    assert plain.keys() == jumped.keys()


async def test_bad_formats_get_typed_errors(tiny_config):
    bad = [
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "response_format"),
        ({"type": "json_schema", "json_schema": {}}, "response_format"),
        ({"type": "grammar", "ebnf": "root ::= "}, "response_format"),
        ({"type": "xml"}, "response_format"),
        ({"type": "regex", "pattern": "a" * 70_000}, "response_format"),
    ]
    async with Runtime.open(tiny_config) as rt:
        for fmt, field in bad:
            with pytest.raises(InvalidRequestError) as info:
                await _run(rt, GenerateRequest(prompt="x", response_format=fmt))
            assert info.value.field == field
        with pytest.raises(InvalidRequestError) as info:
            await _run(rt, GenerateRequest(prompt="x", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}))
        assert info.value.field == "tool_choice"
        with pytest.raises(InvalidRequestError):
            await _run(rt, GenerateRequest(prompt="x", response_format={"type": "json_object"}, ignore_eos=True))
        # A forced tool call is a grammar too: it ends with end of sequence, so ignore_eos is refused.
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            with pytest.raises(InvalidRequestError) as info:
                await _run(rt, GenerateRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice=choice, ignore_eos=True))
            assert info.value.field == "ignore_eos"
        # Still serving.
        fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
        text, *_ = await _run(rt, GenerateRequest(prompt="x", max_tokens=100, response_format=fmt))
        assert isinstance(json.loads(text)["ok"], bool)


def test_tools_need_a_model_with_a_tool_call_format():
    with pytest.raises(InvalidRequestError) as info:
        grammar_spec(GenerateRequest(prompt="x", tools=[WEATHER], tool_choice="required"), tool_markers=None)
    assert info.value.field == "tools"
