"""Hostile `denoising` options in an HTTP body (OpenAI and Anthropic routes): a 400 naming the
field for each, before any compute; the server goes on answering."""

from __future__ import annotations

import json

import msgspec
import pytest

from protocols.config import LimitsConfig
from tests.support.config import make_config
from tests.support.diffusion import DIFFUSION_MODEL
from tests.support.http_serving import raw_request, serving

pytestmark = pytest.mark.server

HOSTILE = [
    ("max_steps", 0),
    ("max_steps", -1),
    ("max_steps", 5),  # past limits.max_denoise_steps (4 here)
    ("max_steps", 1 << 31),
    ("max_steps", 1 << 63),
    ("max_steps", 1 << 64),
    ("max_steps", 2.5),
    ("max_steps", "3"),
    ("max_steps", True),
    ("canvas_length", 0),
    ("canvas_length", 17),  # longer than the model's canvas (16)
    ("canvas_length", 1 << 63),
    ("canvas_length", 1.5),
    ("min_canvas_length", 1 << 31),
    ("min_canvas_length", -3),
    ("threshold", 1.5),
    ("threshold", "high"),
]


async def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n".encode()
    status, _, answer = await raw_request(url, head, data)
    return status, json.loads(answer)


async def test_hostile_denoising_options_get_a_400_naming_the_field_on_both_routes():
    config = msgspec.structs.replace(make_config(DIFFUSION_MODEL), limits=LimitsConfig(max_denoise_steps=4))
    async with serving(config) as served:
        messages = [{"role": "user", "content": "Hi"}]
        for name, value in HOSTILE:
            chat = {"model": served.model, "messages": messages, "max_tokens": 4, "denoising": {name: value}}
            status, answer = await _post(served.url, "/v1/chat/completions", chat)
            assert status == 400 and name in json.dumps(answer), (name, value, status, answer)
            anthropic = {"model": served.model, "messages": messages, "max_tokens": 4, "denoising": {name: value}}
            status, answer = await _post(served.url, "/v1/messages", anthropic)
            assert status == 400 and name in json.dumps(answer), (name, value, status, answer)
        ok = {"model": served.model, "messages": messages, "max_tokens": 4, "denoising": {"max_steps": 4, "canvas_length": 16}}
        status, answer = await _post(served.url, "/v1/chat/completions", ok)
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("length", "stop")
