"""Responses API `metadata` and `user`, kept with a stored response and echoed in it: bounded as
OpenAI documents (16 pairs, keys of 64 characters, values of 512; `user` a string, here of at
most 256 characters), each refusal an OpenAI 400 naming the field, before anything is rendered."""

from __future__ import annotations

import msgspec
import openai
import pytest

from net.http import responses_api_types as ra
from net.http.errors import HttpError, decode_body
from net.http.response_store import ResponseStore
from net.http.responses_api import MAX_METADATA_KEY_CHARS, MAX_METADATA_PAIRS, MAX_METADATA_VALUE_CHARS, MAX_USER_CHARS, responses_request
from tests.support.http_serving import serving


def _turn(**fields):
    body = decode_body(msgspec.json.encode({"model": "m", "input": "hi", **fields}), ra.ResponsesRequest)
    return responses_request(body, ResponseStore(4, 1 << 20))


def _refused(**fields) -> HttpError:
    with pytest.raises(HttpError) as info:
        _turn(**fields)
    assert info.value.code == "invalid_request"
    return info.value


def test_openais_documented_bounds_are_the_ones_checked():
    assert (MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS, MAX_USER_CHARS) == (16, 64, 512, 256)


def test_metadata_and_user_at_their_bounds_are_taken():
    # Characters, not bytes: 512 non-ASCII characters are within the bound.
    metadata = {f"{k:02d}" + "k" * (MAX_METADATA_KEY_CHARS - 2): "é" * MAX_METADATA_VALUE_CHARS for k in range(MAX_METADATA_PAIRS)}
    assert _turn(metadata=metadata, user="u" * MAX_USER_CHARS).generate.messages == [{"role": "user", "content": "hi"}]
    assert _turn(metadata={}, user="").history and _turn(metadata=None, user=None).history


def test_metadata_and_user_past_their_bounds_are_400s_naming_the_field():
    too_many = _refused(metadata={f"k{i}": "v" for i in range(MAX_METADATA_PAIRS + 1)})
    long_key = _refused(metadata={"k" * (MAX_METADATA_KEY_CHARS + 1): "v"})
    long_value = _refused(metadata={"note": "v" * (MAX_METADATA_VALUE_CHARS + 1)})
    long_user = _refused(user="u" * (MAX_USER_CHARS + 1))
    assert [e.param for e in (too_many, long_key, long_value, long_user)] == ["metadata", "metadata", "metadata", "user"]
    assert "17 pairs, at most 16" in str(too_many) and "65 characters" in str(long_key) and "'note'" in str(long_value)
    assert "257 characters, at most 256" in str(long_user)
    # Not strings: refused when the body is decoded, naming the field.
    for fields, param in (({"user": 7}, "user"), ({"metadata": {"k": 1}}, "metadata[...]"), ({"metadata": ["k"]}, "metadata")):
        with pytest.raises(HttpError) as info:
            _turn(**fields)
        assert info.value.param == param, fields


@pytest.mark.server
async def test_over_http_oversized_metadata_is_an_openai_400_and_nothing_is_stored():
    async with serving() as served:
        client = served.client()
        errors = []
        for extra in ({"metadata": {"k": "v" * 513}}, {"metadata": {str(i): "v" for i in range(17)}}, {"user": "u" * 300}):
            with pytest.raises(openai.BadRequestError) as info:
                await client.responses.create(model=served.model, input="hi", max_output_tokens=2, **extra)
            errors.append(info.value.body)
        ok = await client.responses.create(model=served.model, input="hi", max_output_tokens=2, metadata={"k": "v" * 512}, user="someone")
        stored = len(served.http.api.stored_responses)
        await client.close()
    assert [e["param"] for e in errors] == ["metadata", "metadata", "user"] and all(e["type"] == "invalid_request_error" for e in errors)
    assert ok.metadata == {"k": "v" * 512} and ok.user == "someone" and stored == 1
