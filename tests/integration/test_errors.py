"""Bad input gets a typed error; everyone else keeps going."""

from __future__ import annotations

import random

import anyio
import pytest

from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta
from runtime import ConfigError, InvalidRequestError, RequestTooLargeError, Runtime, RuntimeConfig, ServerBusyError
from tests.support.config import make_config
from tests.support.mlx_reference import greedy_tokens, load_reference

BAD_REQUESTS = {
    "empty prompt ids": GenerateRequest(prompt_ids=[]),
    "empty prompt text": GenerateRequest(prompt=""),
    "no prompt": GenerateRequest(),
    "two prompts": GenerateRequest(prompt="a", prompt_ids=[1]),
    "negative max_tokens": GenerateRequest(prompt_ids=[1, 2], max_tokens=-1),
    "zero max_tokens": GenerateRequest(prompt_ids=[1, 2], max_tokens=0),
    "negative temperature": GenerateRequest(prompt_ids=[1, 2], sampling=SamplingParams(temperature=-0.5)),
    "top_p zero": GenerateRequest(prompt_ids=[1, 2], sampling=SamplingParams(top_p=0.0)),
    "token id out of vocab": GenerateRequest(prompt_ids=[1, 10**6]),
    "negative token id": GenerateRequest(prompt_ids=[-1]),
    "bad stop": GenerateRequest(prompt_ids=[1], stop=[""]),
    "too many top logprobs": GenerateRequest(prompt_ids=[1], top_logprobs=1000),
    "messages not objects": GenerateRequest(messages=["hi"]),
}


async def _expect_error(rt: Runtime, request: GenerateRequest, error: type[Exception]) -> Exception:
    with pytest.raises(error) as info:
        async for _ in rt.generate(request):
            pass
    return info.value


async def test_bad_requests_get_typed_errors_and_others_are_unaffected(tiny_config):
    model, tokenizer = load_reference("builtin:tiny")
    prompt = [random.Random(5).randrange(1000) for _ in range(12)]
    reference = greedy_tokens(model, tokenizer, prompt, 30)
    async with Runtime.open(tiny_config) as rt:
        context = rt.model_info.max_context
        bad = dict(BAD_REQUESTS, **{"prompt longer than context": GenerateRequest(prompt_ids=[1] * context)})
        good_tokens: list[int] = []

        async def good():
            async for event in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=30)):
                if isinstance(event, TokenDelta):
                    good_tokens.extend(event.token_ids)
                    await anyio.sleep(0)  # yield: the bad requests interleave with this stream

        async with anyio.create_task_group() as tg:
            tg.start_soon(good)
            for name, request in bad.items():
                error = await _expect_error(rt, request, InvalidRequestError)
                assert str(error), name
        assert good_tokens == reference
        too_long = await _expect_error(rt, bad["prompt longer than context"], RequestTooLargeError)
        assert too_long.field == "prompt"
        assert (await rt.stats()).live_requests == 0


async def test_field_is_named(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        error = await _expect_error(rt, BAD_REQUESTS["negative temperature"], InvalidRequestError)
        assert error.field == "sampling.temperature"
        error = await _expect_error(rt, BAD_REQUESTS["negative max_tokens"], InvalidRequestError)
        assert error.field == "max_tokens"


async def test_duplicate_request_id_is_rejected(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        request = GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=200, ignore_eos=True, request_id="same")
        async for _event in rt.generate(request):
            await _expect_error(rt, request, InvalidRequestError)
            break


async def test_full_queue_answers_busy_at_once():
    config = make_config(max_batch_size=1, max_queued_requests=1)
    async with Runtime.open(config) as rt:
        outcomes: list = []

        async def submit(i):
            try:
                async for event in rt.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=50, ignore_eos=True)):
                    if isinstance(event, Finished):
                        outcomes.append(event.finish_reason)
            except ServerBusyError:
                outcomes.append("busy")

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(submit, i)
        assert "busy" in outcomes and "length" in outcomes


def test_unknown_config_key_is_a_config_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[model]\npath = "builtin:tiny"\n[scheduler]\nmax_batch = 4\n')
    with pytest.raises(ConfigError) as info:
        RuntimeConfig.load(path)
    assert "bad.toml" in str(info.value) and "max_batch" in str(info.value)
