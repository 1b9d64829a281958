"""An image in an OpenAI chat message over HTTP (the official `openai` client): a `data:` URL is
answered as the native API answers the same image; a remote URL and a decompression bomb are
typed 400s."""

from __future__ import annotations

import io

import openai
import pytest
from PIL import Image

from protocols import GenerateRequest, SamplingParams
from tests.support.config import make_config
from tests.support.events import collect
from tests.support.http_serving import serving
from tests.support.vision import QUESTION, VISION_MODEL, data_url, image_message, png

pytestmark = pytest.mark.server


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
        Image.new("RGB", (8000, 8000)).save(bomb, format="PNG")  # 64M pixels, ~190 KB
        with pytest.raises(openai.BadRequestError, match="max_image_pixels"):
            await client.chat.completions.create(model=served.model, messages=_chat(data_url(bomb.getvalue())), max_tokens=4)
        # Text-only chats on the same server are unchanged.
        text = await client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
        assert text.usage.completion_tokens == 3
