"""vLLM's request extras over HTTP: structured outputs (`structured_outputs`, `guided_*`) beside
`response_format`, and `truncate_prompt_tokens`."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.http_serving import serving

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "Pick one."}]


async def test_vllm_structured_outputs_constrain_the_answer():
    async with serving() as served:
        client = served.client()
        chat = client.chat.completions.create
        kwargs = dict(model=served.model, messages=MESSAGES, max_tokens=40, temperature=0)
        choice = await chat(**kwargs, extra_body={"structured_outputs": {"choice": ["red apple", "green (pear)", "blue+berry"]}})
        older = await chat(**kwargs, extra_body={"guided_choice": ["yes", "no"]})
        regex = await chat(**kwargs, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}
        as_json = await chat(**kwargs, extra_body={"guided_json": schema})
        completion = await client.completions.create(model=served.model, prompt="x", max_tokens=10, temperature=0, extra_body={"guided_regex": "ab+c"})
        both = chat(**kwargs, response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
        with pytest.raises(openai.BadRequestError) as refused:
            await both
        await client.close()
    assert choice.choices[0].message.content in ("red apple", "green (pear)", "blue+berry")
    assert older.choices[0].message.content in ("yes", "no")
    import re

    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].message.content)
    assert isinstance(json.loads(as_json.choices[0].message.content)["n"], int)
    assert re.fullmatch("ab+c", completion.choices[0].text) or completion.choices[0].finish_reason == "length"
    assert refused.value.body["param"] == "structured_outputs"


async def test_truncate_prompt_tokens_keeps_the_prompts_end():
    async with serving() as served:
        client = served.client()
        ids = list(range(10, 60))
        full = await client.completions.create(model=served.model, prompt=ids, max_tokens=4, temperature=0)
        cut = await client.completions.create(model=served.model, prompt=ids, max_tokens=4, temperature=0, extra_body={"truncate_prompt_tokens": 8})
        tail = await client.completions.create(model=served.model, prompt=ids[-8:], max_tokens=4, temperature=0)
        await client.close()
    assert full.usage.prompt_tokens == 50 and cut.usage.prompt_tokens == 8
    assert cut.choices[0].text == tail.choices[0].text


async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk():
    async with serving() as served:
        client = served.client()
        stream = await client.chat.completions.create(
            model=served.model,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
    final = chunks[-1].usage
    running = [c.usage for c in chunks[:-1]]
    assert chunks[-1].choices == [] and all(u is not None for u in running)
    assert {u.prompt_tokens for u in running} == {final.prompt_tokens}
    generated = [u.completion_tokens for u in running]
    assert generated == sorted(generated) and generated[0] == 0 and generated[-1] == final.completion_tokens
