"""Client mistakes answered 500 before (issue 26 finding 11): each is now a 4xx naming what is
wrong, and the server serves on."""

from __future__ import annotations

import json

import pytest

from tests.support.config import builtin_dir
from tests.support.http_serving import raw_request, serving
from tools.lora_adapters import make_lora_adapter

pytestmark = pytest.mark.server


def _post(path: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()


def _chat(model: str, **fields) -> bytes:
    return json.dumps({"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


@pytest.mark.parametrize(
    "case,status,param",
    [
        ("nested_body", 400, None),
        ("deep_tool_arguments", 400, "messages[0].tool_calls[0].function.arguments"),
        ("non_latin1_request_id", 400, "request_id"),
        ("crlf_request_id", 400, "request_id"),
        ("grammar_admitting_nothing", 400, "response_format"),
    ],
)
async def test_client_mistakes_are_4xx_naming_the_field(case, status, param):
    async with serving() as served:
        model = served.model
        body = {
            "nested_body": b"[" * 100_000 + b"]" * 100_000,
            "deep_tool_arguments": json.dumps(
                {
                    "model": model,
                    "messages": [
                        {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 50_000}}],
                        },
                        {"role": "user", "content": "hi"},
                    ],
                }
            ).encode(),
            "non_latin1_request_id": _chat(model, request_id="snow\u2603"),
            "crlf_request_id": _chat(model, request_id="a\r\nSet-Cookie: x=1"),
            "grammar_admitting_nothing": _chat(model, response_format={"type": "grammar", "ebnf": "root ::= root"}),
        }[case]
        got, headers, answer = await raw_request(served.url, _post("/v1/chat/completions", body), body)
        error = json.loads(answer)["error"]
        assert got == status and error["param"] == param, answer
        assert "set-cookie" not in headers
        ok, _, _ = await raw_request(served.url, _post("/v1/chat/completions", _chat(model)), _chat(model))
        assert ok == 200


async def test_an_adapter_config_with_an_infinite_rank_is_a_4xx(tmp_path):
    directory = make_lora_adapter(builtin_dir("tiny"), tmp_path / "inf", rank=4, num_layers=1)
    config = json.loads((directory / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = float("inf")  # written as `Infinity`
    (directory / "adapter_config.json").write_text(json.dumps(config))
    async with serving(http_adapter_updates=True) as served:
        body = json.dumps({"lora_name": "inf", "lora_path": str(directory)}).encode()
        got, _, answer = await raw_request(served.url, _post("/v1/load_lora_adapter", body), body)
    assert got == 422 and b"rank" in answer, answer
