"""A denoising request (a diffusion language model) over HTTP through the official `openai`
client: streamed like any other, the native API's answer, its settings in `extra_body`."""

from __future__ import annotations

import anthropic
import openai
import pytest

from protocols import DenoisingOptions, GenerateRequest, SamplingParams
from tests.support.config import make_config
from tests.support.diffusion import DIFFUSION_MODEL
from tests.support.events import collect
from tests.support.http_serving import serving

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


async def test_a_denoising_request_streams_through_the_openai_client_as_the_native_api_answers():
    async with serving(make_config(DIFFUSION_MODEL)) as served, served.client() as client:
        sampling = SamplingParams(temperature=0.0, seed=7)
        native = await collect(served.runtime.generate(GenerateRequest(messages=MESSAGES, max_tokens=24, ignore_eos=True, sampling=sampling)))
        stream = await client.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=24, temperature=0, seed=7, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == native.text
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # a canvas (16 positions) at a time
        fewer = GenerateRequest(messages=MESSAGES, max_tokens=8, ignore_eos=True, sampling=sampling, denoising=DenoisingOptions(max_steps=3))
        expected = await collect(served.runtime.generate(fewer))
        answer = await client.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=8, temperature=0, seed=7, extra_body={"ignore_eos": True, "denoising": {"max_steps": 3}}
        )
        assert answer.choices[0].message.content == expected.text
        with pytest.raises(openai.BadRequestError, match="diffusion"):
            await client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=4, logprobs=True)


async def test_a_denoising_request_through_the_anthropic_sdk_streams_its_canvases():
    async with serving(make_config(DIFFUSION_MODEL)) as served:
        client = anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0)
        extra = {"temperature": 0, "denoising": {"max_steps": 4, "canvas_length": 8}}
        events = await client.messages.create(model=served.model, max_tokens=20, messages=MESSAGES, stream=True, extra_body=extra)
        streamed = [event async for event in events]
        refused = client.messages.create(model=served.model, max_tokens=4, messages=MESSAGES, extra_body={"top_k": 5})
        with pytest.raises(anthropic.BadRequestError, match="diffusion"):
            await refused
        await client.close()
    text = "".join(e.delta.text for e in streamed if e.type == "content_block_delta")
    ended = next(e for e in streamed if e.type == "message_delta")
    assert ended.delta.stop_reason in ("end_turn", "max_tokens") and 0 < ended.usage.output_tokens <= 20
    assert text  # (random weights: some text, a canvas of 8 positions at a time)
