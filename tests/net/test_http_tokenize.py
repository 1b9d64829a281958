"""The tokenizer routes (vLLM's shapes): `/tokenize` renders messages exactly as a chat request
does (its count is the request's prompt_tokens), a prompt as a completion does; `/detokenize`
inverts it; `/tokenizer_info` is what lm-eval's remote tokenizer reads; bad input is a typed 400."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.http_serving import raw_request, serving
from tests.support.tool_schemas import WEATHER

pytestmark = pytest.mark.server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a tokenizer?"}]


class Http:
    """JSON over raw requests (each on a fresh connection)."""

    def __init__(self, url: str):
        self.url = url

    async def post(self, path: str, json_body: Any) -> Answer:
        body = json.dumps(json_body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return Answer(*await raw_request(self.url, head.encode(), body))

    async def get(self, path: str) -> Answer:
        return Answer(*await raw_request(self.url, f"GET {path} HTTP/1.1\r\nHost: localhost\r\n".encode()))


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status_code, self.headers, self.text = status, headers, body.decode()

    def json(self) -> Any:
        return json.loads(self.text)


async def test_tokenize_counts_what_a_chat_request_prefills():
    async with serving() as served:
        http = Http(served.url)
        client = served.client()
        chat = await client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=1)
        with_tools = await client.chat.completions.create(model=served.model, messages=MESSAGES, tools=[WEATHER], max_tokens=1)
        plain = (await http.post("/tokenize", {"model": served.model, "messages": MESSAGES})).json()
        tooled = (await http.post("/tokenize", {"messages": MESSAGES, "tools": [WEATHER], "return_token_strs": True})).json()
        completion = await client.completions.create(model=served.model, prompt="Once upon a time", max_tokens=1)
        prompt = (await http.post("/tokenize", {"prompt": "Once upon a time"})).json()
        await client.close()
        tokenizer = served.runtime.tokenizer
    assert plain["count"] == len(plain["tokens"]) == chat.usage.prompt_tokens
    assert plain["max_model_len"] == served.runtime.model_info.max_context
    assert tooled["count"] == with_tools.usage.prompt_tokens > plain["count"]
    assert "".join(tooled["token_strs"]) == tokenizer.decode(tooled["tokens"])
    assert prompt["tokens"] == tokenizer.encode("Once upon a time") and prompt["count"] == completion.usage.prompt_tokens


async def test_detokenize_inverts_tokenize_and_info_names_the_special_tokens():
    text = "The quick brown fox, 42 times."
    async with serving() as served:
        http = Http(served.url)
        ids = (await http.post("/tokenize", {"prompt": text, "add_special_tokens": False})).json()["tokens"]
        back = (await http.post("/detokenize", {"tokens": ids})).json()
        info = (await http.get("/tokenizer_info")).json()
        tokenizer = served.runtime.tokenizer
    assert back == {"prompt": text}
    hf = tokenizer._tokenizer
    assert info["eos_token"] == hf.eos_token and info["chat_template"] == hf.chat_template
    assert info["model_max_length"] == served.runtime.model_info.max_context and info["vocab_size"] == served.runtime.model_info.vocab_size


async def test_bad_tokenizer_requests_are_typed_400s_and_404s():
    async with serving() as served:
        http = Http(served.url)
        vocab = served.runtime.model_info.vocab_size
        cases = {
            "prompt": await http.post("/tokenize", {}),
            "prompt ": await http.post("/tokenize", {"prompt": "a", "messages": MESSAGES}),
            "messages[0].role": await http.post("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}),
            "tokens[1]": await http.post("/detokenize", {"tokens": [1, vocab]}),
            "tokens": await http.post("/detokenize", {"tokens": "abc"}),
        }
        unknown = await http.post("/tokenize", {"model": "gpt-4o", "prompt": "x"})
        wrong_method = await http.get("/tokenize")
        metrics = (await http.get("/metrics")).text
    for field, answer in cases.items():
        assert answer.status_code == 400, (field, answer.text)
        assert answer.json()["error"]["param"] == field.strip(), (field, answer.json())
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    # Counted under their own routes in /metrics.
    assert 'route="/tokenize",status="400"' in metrics and 'route="/detokenize",status="400"' in metrics
