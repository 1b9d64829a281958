"""What one HTTP request may ask for (issue 46): choices, scored prompt tokens, messages and content
parts, tokenizer work. Each bound is refused typed and named (OpenAI's `param`, Anthropic's
message) before any prompt is rendered, the value at the bound is served, and the server serves on."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anthropic
import msgspec
import openai
import pytest

from protocols.config import LimitsConfig
from tests.support.config import make_config
from tests.support.http_serving import Served, raw_request, serving

pytestmark = pytest.mark.server

# Small bounds, so that the request at each bound is cheap.
LIMITS = LimitsConfig(max_choices=4, max_prompt_logprobs_tokens=40, max_messages=6, max_content_parts=8, max_tokenize_bytes=2000, max_detokenize_tokens=50)


@asynccontextmanager
async def _served() -> AsyncIterator[tuple[Served, openai.AsyncOpenAI, anthropic.AsyncAnthropic]]:
    """A server with the small bounds, and an `openai` and an `anthropic` client for it."""
    async with serving(msgspec.structs.replace(make_config(), limits=LIMITS)) as served, served.client() as client, _claude(served) as claude:
        yield served, client, claude


def _claude(served: Served) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=60.0)


async def _post(url: str, path: str, payload: dict) -> tuple[int, dict]:
    body = json.dumps(payload).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()
    status, _, answer = await raw_request(url, head, body)
    return status, json.loads(answer)


def _counting_renders(served) -> list[int]:
    """Count the prompts the runtime renders for the HTTP layer (`prompt_token_ids`)."""
    calls: list[int] = []
    render = served.runtime.prompt_token_ids

    async def counted(request):
        calls.append(1)
        return await render(request)

    served.runtime.prompt_token_ids = counted
    return calls


def _turns(count: int, content) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": content} for i in range(count - 1)] + [{"role": "user", "content": content}]


async def test_batched_prompts_past_max_choices_are_refused_before_any_is_rendered():
    async with _served() as (served, client, _):
        renders = _counting_renders(served)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=served.model, prompt=["hi"] * 200, echo=True, max_tokens=1)
        assert refused.value.body["param"] == "prompt" and "limits.max_choices" in refused.value.body["message"]
        assert renders == []
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=served.model, prompt=["hi", "ho"], n=3, echo=True, max_tokens=1)
        assert refused.value.body["param"] == "n" and renders == []
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "hi"}], n=5, max_tokens=1)
        assert refused.value.body["param"] == "n"
        at_bound = await client.completions.create(model=served.model, prompt=["hi", "ho"], n=2, max_tokens=2, temperature=0)
        assert len(at_bound.choices) == 4


async def test_prompt_logprobs_past_the_scored_token_bound_are_refused():
    async with _served() as (served, client, _):
        ids = list(range(10, 30))  # 20 tokens: x 2 choices is the bound, x 3 is past it
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=served.model, prompt=ids, n=3, echo=True, logprobs=5, max_tokens=1)
        assert refused.value.body["param"] == "logprobs" and "limits.max_prompt_logprobs_tokens" in refused.value.body["message"]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=served.model, prompt=ids * 3, max_tokens=1, extra_body={"prompt_logprobs": 2})
        assert refused.value.body["param"] == "prompt_logprobs"
        with pytest.raises(openai.BadRequestError) as refused:  # text: bounded as rendered
            await client.completions.create(model=served.model, prompt="hello world " * 30, echo=True, logprobs=1, max_tokens=1)
        assert refused.value.body["param"] == "logprobs"
        at_bound = await client.completions.create(model=served.model, prompt=ids, n=2, echo=True, logprobs=5, max_tokens=1, temperature=0)
        assert [len(c.logprobs.tokens) for c in at_bound.choices] == [21, 21]
        plain = await client.completions.create(model=served.model, prompt=ids * 3, n=3, max_tokens=2, temperature=0)
        assert len(plain.choices) == 3  # (no prompt logprobs: the bound does not apply)


async def test_chat_messages_and_content_parts_past_their_bounds_are_refused():
    async with _served() as (served, client, _):
        renders = _counting_renders(served)
        parts = [{"type": "text", "text": "a"}] * 2
        for messages, what in ((_turns(7, "hi"), "limits.max_messages"), (_turns(5, parts), "limits.max_content_parts")):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model=served.model, messages=messages, max_tokens=1, stream=True)
            assert refused.value.body["param"] == "messages" and what in refused.value.body["message"]
        assert renders == []
        answer = await client.chat.completions.create(model=served.model, messages=_turns(4, parts), max_tokens=2, temperature=0)
        assert answer.choices[0].finish_reason == "length"
        status, error = await _post(served.url, "/v1/responses", {"model": served.model, "input": _turns(7, "hi"), "max_output_tokens": 2})
        assert status == 400 and error["error"]["param"] == "input"
        status, _ = await _post(served.url, "/v1/responses", {"model": served.model, "input": _turns(6, "hi"), "max_output_tokens": 2, "store": False})
        assert status == 200


async def test_anthropic_messages_and_blocks_past_their_bounds_are_refused_in_anthropics_shape():
    async with _served() as (served, _, claude):
        results = [{"type": "tool_result", "tool_use_id": f"t{i}", "content": [{"type": "text", "text": "ok"}] * 2} for i in range(3)]
        cases = [
            (_turns(7, "hi"), "limits.max_messages"),
            ([{"role": "user", "content": [{"type": "text", "text": "a"}] * 9}], "limits.max_content_parts"),
            ([{"role": "user", "content": results}], "limits.max_content_parts"),  # 3 results + their 6 blocks
        ]
        for messages, what in cases:
            for call in (claude.messages.create, claude.messages.count_tokens):
                extra = {"max_tokens": 2} if call == claude.messages.create else {}
                with pytest.raises(anthropic.BadRequestError) as refused:
                    await call(model=served.model, messages=messages, **extra)
                error = refused.value.body["error"]
                assert error["type"] == "invalid_request_error" and error["message"].startswith("messages:") and what in error["message"]
        at_bound = await claude.messages.create(model=served.model, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 8}], max_tokens=2)
        assert at_bound.stop_reason == "max_tokens"


async def test_tokenizer_routes_past_their_bounds_are_refused_typed():
    async with _served() as (served, _, _):
        status, error = await _post(served.url, "/tokenize", {"model": served.model, "prompt": "x" * 2001})
        assert status == 413 and error["error"]["param"] == "prompt" and "limits.max_tokenize_bytes" in error["error"]["message"]
        status, answer = await _post(served.url, "/tokenize", {"model": served.model, "prompt": "hello world " * 166, "return_token_strs": True})
        assert status == 200 and answer["token_strs"] and len(answer["token_strs"]) == answer["count"]
        status, error = await _post(served.url, "/tokenize", {"model": served.model, "messages": _turns(7, "hi")})
        assert status == 400 and error["error"]["param"] == "messages"
        status, error = await _post(served.url, "/detokenize", {"model": served.model, "tokens": [100] * 51})
        assert status == 400 and error["error"]["param"] == "tokens" and "limits.max_detokenize_tokens" in error["error"]["message"]
        status, answer = await _post(served.url, "/detokenize", {"model": served.model, "tokens": [100] * 50})
        assert status == 200 and answer["prompt"]


async def test_the_token_strings_tokenize_returns_are_each_tokens_own_text():
    async with _served() as (served, _, _):
        status, answer = await _post(served.url, "/tokenize", {"model": served.model, "prompt": "hello world, hello", "return_token_strs": True})
        tokenizer = served.runtime.tokenizer_for(None)
        assert status == 200 and answer["token_strs"] == [tokenizer.decode([t]) for t in answer["tokens"]]


def test_the_default_bounds_hold_a_full_context_of_prompt_logprobs_and_a_long_conversation():
    limits = LimitsConfig()
    assert limits.max_prompt_logprobs_tokens >= 8192 and limits.max_choices >= 16
    assert limits.max_messages >= 1024 and limits.max_content_parts >= limits.max_messages
