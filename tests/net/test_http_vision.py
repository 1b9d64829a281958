"""An image in an OpenAI chat message over HTTP (the official `openai` client): a `data:` URL is
answered as the native API answers the same image; a remote URL and a decompression bomb are
typed 400s."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import json
import threading
import time

import anthropic
import msgspec
import openai
import pytest
from PIL import Image

from protocols import GenerateRequest, SamplingParams
from tests.support.config import make_config
from tests.support.events import collect
from tests.support.http_serving import raw_request, serving
from tests.support.vision import QUESTION, VISION_MODEL, data_url, image_message, png

pytestmark = pytest.mark.server


def _rss() -> int:
    """This process's resident bytes now (Linux)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}]


async def test_a_data_url_image_gets_the_native_apis_text_and_bad_images_are_400s():
    async with serving(make_config(VISION_MODEL)) as served, served.client() as client:
        native = await collect(served.runtime.generate(GenerateRequest(messages=image_message(png(7)), max_tokens=12, sampling=SamplingParams(temperature=0))))
        answer = await client.chat.completions.create(model=served.model, messages=_chat(data_url(png(7))), max_tokens=12, temperature=0)
        assert answer.choices[0].message.content == native.text
        assert answer.usage.prompt_tokens == native.last.usage.prompt_tokens
        again = await client.chat.completions.create(model=served.model, messages=_chat(data_url(png(7))), max_tokens=12, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
        with pytest.raises(openai.BadRequestError, match="remote image URLs"):
            await client.chat.completions.create(model=served.model, messages=_chat("https://169.254.169.254/latest/meta-data.png"), max_tokens=4)
        bomb = io.BytesIO()
        Image.new("RGB", (8000, 8000)).save(bomb, format="PNG")  # 64M pixels (192 MB decoded), ~190 KB
        before = _rss()
        with pytest.raises(openai.BadRequestError, match="max_image_pixels"):
            await client.chat.completions.create(model=served.model, messages=_chat(data_url(bomb.getvalue())), max_tokens=4)
        assert _rss() - before < 64 * 2**20  # (the server is this process: decoding it would add 192 MB)
        # /tokenize counts the image's tokens as the chat request prefilled them.
        head = "POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"

        async def tokenize(**extra) -> tuple[int, bytes]:
            body = json.dumps({"messages": _chat(data_url(png(7))), **extra}).encode()
            code, _, answered = await raw_request(served.url, head.format(len(body)).encode(), body)
            return code, answered

        code, answered = await tokenize()
        assert code == 200 and json.loads(answered)["count"] == native.last.usage.prompt_tokens, answered
        code, answered = await tokenize(add_special_tokens=True)
        assert code == 400 and b"only as a chat request renders them" in answered, answered
        # Text-only chats on the same server are unchanged.
        text = await client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
        assert text.usage.completion_tokens == 3


async def test_an_anthropic_image_block_gets_the_native_apis_text():
    async with serving(make_config(VISION_MODEL)) as served:
        client = anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0)
        native = await collect(served.runtime.generate(GenerateRequest(messages=image_message(png(8)), max_tokens=12, sampling=SamplingParams(temperature=0))))
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(8)).decode()}}
        message = await client.messages.create(
            model=served.model,
            max_tokens=12,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}],
            extra_body={"temperature": 0},
        )
        assert message.content[0].text == native.text
        # (Anthropic counts cache reads apart: the native run left this image's prefix cached.)
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == native.last.usage.prompt_tokens
        assert message.usage.cache_read_input_tokens == native.last.usage.prompt_tokens - 1
        remote = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:1/secret.png"}}
        with pytest.raises(anthropic.BadRequestError, match="remote image URLs"):
            await client.messages.create(model=served.model, max_tokens=4, messages=[{"role": "user", "content": [remote]}])
        await client.close()


async def test_an_image_in_an_anthropic_tool_result_is_read_as_a_user_turn_after_it():
    # A screenshot a tool took (as Claude Code sends one): the model sees the image.
    tool = {"name": "screenshot", "description": "Take a screenshot.", "input_schema": {"type": "object", "properties": {}}}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(9)).decode()}}
    asked = [
        {"role": "user", "content": "What is on the screen?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
    ]

    def result(content: list) -> dict:
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]}

    async with serving(make_config(VISION_MODEL)) as served:
        client = anthropic.AsyncAnthropic(base_url=served.url, api_key="unused", max_retries=0)

        async def ask(messages: list[dict]):
            return await client.messages.create(model=served.model, max_tokens=8, tools=[tool], messages=messages, extra_body={"temperature": 0})

        text = {"type": "text", "text": "Here it is."}
        in_result = await ask([*asked, result([text, image])])
        after = await ask([*asked, result([text]), {"role": "user", "content": [image]}])
        without = await ask([*asked, result([text])])
        await client.close()
    used = lambda m: m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)  # noqa: E731
    assert used(in_result) == used(after) and in_result.content == after.content
    assert used(in_result) > used(without) + 16  # the image's tokens are in the prompt


@contextlib.contextmanager
def _image_host(routes: dict[str, tuple[int, bytes, float]]):
    """A local HTTP server answering `path -> (status, body, seconds to wait first)`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body, wait = routes.get(self.path, (404, b"", 0.0))
            time.sleep(wait)
            self.send_response(status)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_remote_images_are_fetched_only_when_allowed_and_within_limits():
    big = png(10, 600, 600)
    routes = {"/cat.png": (200, png(9), 0.0), "/big.png": (200, big, 0.0), "/slow.png": (200, png(9), 5.0), "/gone.png": (404, b"", 0.0)}
    config = msgspec.structs.replace(make_config(VISION_MODEL), limits=msgspec.structs.replace(make_config().limits, max_image_bytes=len(big) - 1))
    with _image_host(routes) as host:
        async with serving(config, allow_remote_images=True, remote_image_timeout_s=2.0) as served, served.client() as client:
            # Loopback is not a public address: refused before any connection unless allowed.
            with pytest.raises(openai.BadRequestError, match=r"not a public address.*remote_image_allowed_networks"):
                await client.chat.completions.create(model=served.model, messages=_chat(f"{host}/cat.png"), max_tokens=4)
        allowed = {"remote_image_allowed_networks": ["127.0.0.1"]}
        async with serving(config, allow_remote_images=True, remote_image_timeout_s=2.0, **allowed) as served, served.client() as client:
            fetched = await client.chat.completions.create(model=served.model, messages=_chat(f"{host}/cat.png"), max_tokens=8, temperature=0)
            sent = await client.chat.completions.create(model=served.model, messages=_chat(data_url(png(9))), max_tokens=8, temperature=0)
            assert fetched.choices[0].message.content == sent.choices[0].message.content
            for path, words in (("/big.png", "max_image_bytes"), ("/slow.png", "could not be fetched"), ("/gone.png", "could not be fetched")):
                with pytest.raises(openai.BadRequestError, match=words):
                    await client.chat.completions.create(model=served.model, messages=_chat(f"{host}{path}"), max_tokens=4)
        async with serving(make_config(VISION_MODEL)) as served, served.client() as client:  # the default: off
            with pytest.raises(openai.BadRequestError, match="allow_remote_images"):
                await client.chat.completions.create(model=served.model, messages=_chat(f"{host}/cat.png"), max_tokens=4)
