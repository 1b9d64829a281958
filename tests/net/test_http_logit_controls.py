"""Per-request logits controls over HTTP with the official `openai` client: OpenAI's
`logit_bias`, vLLM's `min_tokens`, `allowed_token_ids` and `bad_words` as extra body fields,
each giving exactly the native runtime's stream for the same `SamplingParams`; typed 400s for
bad values."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from policies.validation import MAX_LOGIT_BIAS, bad_words_ids
from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta
from tests.support.http_serving import serving
from tests.support.mlx_reference import load_reference

pytestmark = pytest.mark.server

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse(path):"}]
MAX_TOKENS = 10


async def _native(rt, stop_token_ids: list[int] | None = None, **sampling) -> tuple[list[int], str, str]:
    """The native runtime's token ids, text and finish reason for the same chat (greedy, with
    these sampling fields)."""
    ids, text, finished = [], "", None
    request = GenerateRequest(
        messages=MESSAGES, max_tokens=MAX_TOKENS, stop_token_ids=stop_token_ids or [], sampling=SamplingParams(temperature=0.0, **sampling)
    )
    async for event in rt.generate(request):
        if isinstance(event, TokenDelta):
            ids += event.token_ids
            text += event.text
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None and finished.finish_reason in ("stop", "length")
    return ids, text, finished.finish_reason


async def _chat(client, model: str, extra: dict[str, Any], **kw) -> tuple[list[int], str, str]:
    response = await client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True, **extra}, **kw
    )
    (choice,) = response.choices
    return (choice.model_extra or {})["token_ids"], choice.message.content or "", choice.finish_reason


async def test_controls_over_http_equal_the_native_runtime():
    _, tokenizer = load_reference("builtin:tiny")
    async with serving() as served:
        client, rt = served.client(), served.runtime
        greedy, _, _ = await _native(rt)

        # OpenAI's logit_bias, keys as strings: a large bias makes greedy output that token, on
        # both endpoints.
        ids, _, _ = await _chat(client, served.model, {}, logit_bias={"500": 100})
        assert ids == [500] * MAX_TOKENS
        completion = await client.completions.create(
            model=served.model, prompt="def parse(path):", max_tokens=4, temperature=0, logit_bias={"500": 100}, extra_body={"return_token_ids": True}
        )
        assert completion.choices[0].model_extra["token_ids"] == [500] * 4
        bias = {greedy[0]: -100.0, greedy[2]: -5.0}
        got = await _chat(client, served.model, {}, logit_bias={str(k): v for k, v in bias.items()})
        assert got[0][0] != greedy[0] and got == await _native(rt, logit_bias=bias)

        # min_tokens: the greedy first token as a stop token is held off for four tokens.
        stop = [greedy[0]]
        ids, _, reason = await _chat(client, served.model, {"stop_token_ids": stop})
        assert ids == [] and reason == "stop"
        got = await _chat(client, served.model, {"stop_token_ids": stop, "min_tokens": 4})
        assert len(got[0]) >= 4 and greedy[0] not in got[0][:4]
        assert got == await _native(rt, stop_token_ids=stop, min_tokens=4)

        # allowed_token_ids: every token is one of them.
        allowed = [5, 77, 300, 301, 640, 900]
        got = await _chat(client, served.model, {"allowed_token_ids": allowed})
        assert got[0] and set(got[0]) <= set(allowed)
        assert got == await _native(rt, allowed_token_ids=allowed)

        # bad_words: a word whose tokenization is a token of the greedy stream; it never appears.
        token = next(t for t in greedy if [t] in bad_words_ids([tokenizer.decode([t])], tokenizer))
        word = tokenizer.decode([token])
        got = await _chat(client, served.model, {"bad_words": [word]})
        assert token not in got[0] and got[0] != greedy[: len(got[0])]
        assert got == await _native(rt, bad_words=[word])

        # Such a request neither speculates nor fast-forwards, and says why.
        sampling = SamplingParams(temperature=0.0, bad_words=[word])
        (*_, finished) = [e async for e in rt.generate(GenerateRequest(messages=MESSAGES, max_tokens=3, speculative=True, fill="echo", sampling=sampling))]
        assert isinstance(finished, Finished) and finished.spec is not None and finished.fill is not None
        assert "logits processing" in (finished.spec.refused or "") and "bypass" in (finished.fill.refused or "")
        await client.close()


async def _status_error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        await call
    return info.value


async def test_bad_values_are_typed_400s_naming_the_field():
    async with serving() as served:
        client = served.client()

        def chat(extra: dict[str, Any] | None = None, **kw):
            return client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=4, extra_body=extra, **kw)

        cases = [
            ("logit_bias", chat(logit_bias={"99999": 1})),  # not in the vocabulary
            ("logit_bias", chat(logit_bias={"5": 101})),
            ("logit_bias", chat(logit_bias={"5": -100.5})),
            ("logit_bias", chat(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)})),
            ("logit_bias", chat(logit_bias={"five": 1})),
            ("min_tokens", chat({"min_tokens": 5})),  # more than max_tokens
            ("min_tokens", chat({"min_tokens": -1})),
            ("allowed_token_ids", chat({"allowed_token_ids": [1, 99999]})),
            ("allowed_token_ids", chat({"allowed_token_ids": []})),
            ("bad_words", chat({"bad_words": ["fine", ""]})),
        ]
        for field, call in cases:
            error = await _status_error(call)
            assert error.status_code == 400, (field, error)
            assert error.body["type"] == "invalid_request_error" and error.body["param"] == field, (field, error.body)
            assert error.body["code"] == "invalid_request" and error.body["message"]
        await client.close()
