"""`POST /v1/embeddings` through the official `openai` client: floats and base64 (the SDK's default,
decoded by the SDK) carry the same float32 values as `Runtime.embed`; texts, token ids and lists of
either; usage counts the inputs' tokens; bad input is a typed 400 naming the field; the route is
counted in /metrics."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.config import make_config
from tests.support.http_serving import raw_request, serving

pytestmark = pytest.mark.server

TEXTS = ["The quick brown fox", "def parse(path):", "x"]


def _config():
    config = make_config()
    config = msgspec.structs.replace(config, embeddings=msgspec.structs.replace(config.embeddings, max_inputs=4))
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, max_context=64))


async def _post(url: str, body: Any) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    status, _, answer = await raw_request(url, head.encode(), data)
    return status, json.loads(answer)


async def test_floats_and_base64_carry_the_runtime_s_vectors():
    async with serving(_config()) as served:
        client = served.client()
        floats = await client.embeddings.create(model=served.model, input=TEXTS, encoding_format="float")
        decoded = await client.embeddings.create(model=served.model, input=TEXTS)  # base64, decoded by the SDK
        one = await client.embeddings.create(model=served.model, input="The quick brown fox", encoding_format="float")
        width = served.runtime.model_info.embedding_size
        sized = await client.embeddings.create(model=served.model, input=TEXTS[:1], dimensions=width)
        direct, num_tokens = await served.runtime.embed(TEXTS)
        direct_one, _ = await served.runtime.embed(TEXTS[:1])  # (alone, not in a padded batch)
        tokenizer = served.runtime.tokenizer
        await client.close()
    assert floats.object == "list" and floats.model == served.model
    assert [d.index for d in floats.data] == [0, 1, 2] and all(d.object == "embedding" for d in floats.data)
    assert [d.embedding for d in floats.data] == direct  # float32 values, exactly
    assert [d.embedding for d in decoded.data] == direct
    assert one.data[0].embedding == direct_one[0] and len(one.data) == 1
    assert len(sized.data[0].embedding) == width == 64
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == num_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert one.usage.prompt_tokens == len(tokenizer.encode(TEXTS[0]))


async def test_token_ids_and_mlxrt_pooling_options():
    ids = [[5, 6, 7], [8, 9, 10, 11, 12]]
    async with serving(_config()) as served:
        client = served.client()
        listed = await client.embeddings.create(model=served.model, input=ids, encoding_format="float")
        single = await client.embeddings.create(model=served.model, input=ids[1], encoding_format="float")
        mean = await client.embeddings.create(model=served.model, input=ids, extra_body={"pooling": "mean", "normalize": False})
        direct_last, _ = await served.runtime.embed(ids)
        direct_single, _ = await served.runtime.embed(ids[1:])
        direct_mean, _ = await served.runtime.embed(ids, pooling="mean", normalize=False)
        await client.close()
    assert [d.embedding for d in listed.data] == direct_last and listed.usage.prompt_tokens == 8
    assert single.data[0].embedding == direct_single[0] and single.usage.total_tokens == 5
    assert [d.embedding for d in mean.data] == direct_mean
    assert abs(sum(x * x for x in direct_mean[0]) - 1.0) > 1e-3  # not normalized


async def test_bad_requests_are_typed_400s_naming_the_field():
    async with serving(_config()) as served:
        vocab = served.runtime.model_info.vocab_size
        client = served.client()
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model=served.model, input=["a", ""], encoding_format="float")
        assert caught.value.body["param"] == "input[1]" and caught.value.body["code"] == "invalid_request"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model=served.model, input="x", dimensions=1000)
        assert caught.value.body["param"] == "dimensions"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="text-embedding-3-small", input="x")
        await client.close()
        cases = {
            "input": {"input": []},
            "input ": {"input": ""},
            "input  ": {"input": ["a", [1, 2]]},
            "input[0]": {"input": [[1, vocab]]},
            "input   ": {"input": [1, -1]},
            "input    ": {"input": ["a"] * 5},
            "input[1]": {"input": [[1], list(range(1, 66))]},
            "input     ": {"input": list(range(1, 66))},
            "pooling": {"input": "x", "pooling": "max"},
            "encoding_format": {"input": "x", "encoding_format": "int8"},
            "normalize": {"input": "x", "normalize": "yes"},
        }
        answers = {field: await _post(served.url, {"model": served.model, **body}) for field, body in cases.items()}
        _, _, page = await raw_request(served.url, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
    for field, (status, answer) in answers.items():
        assert status == 400, (field, answer)
        assert answer["error"]["param"] == field.strip() and answer["error"]["type"] == "invalid_request_error", (field, answer)
    counts = {
        frozenset(s.labels.items()): s.value
        for family in text_string_to_metric_families(page.decode())
        for s in family.samples
        if s.name == "mlxrt:http_responses_total"
    }
    route = {"model_name": "builtin:tiny", "route": "/v1/embeddings"}
    assert counts[frozenset({**route, "status": "400"}.items())] == len(cases) + 2
    assert counts[frozenset({**route, "status": "404"}.items())] == 1


async def test_a_model_pool_embeds_with_the_model_named():
    async with serving(_config(), pool=True) as served:
        client = served.client()
        answer = await client.embeddings.create(model=served.model, input=TEXTS, encoding_format="float")
        direct, num_tokens = await served.runtime.embed(TEXTS, model=served.model)
        await client.close()
    assert [d.embedding for d in answer.data] == direct and answer.usage.prompt_tokens == num_tokens
