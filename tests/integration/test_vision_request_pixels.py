"""`limits.max_request_pixels` on a served vision-language model: images each within
`limits.max_image_pixels` but together past the request's total are refused typed before any is
decoded, and the runtime goes on serving."""

from __future__ import annotations

import io

import msgspec
import pytest
from PIL import Image

from protocols import GenerateRequest, SamplingParams
from protocols.errors import RequestTooLargeError
from runtime import Runtime
from runtime.config import LimitsConfig
from tests.support.config import make_config
from tests.support.events import collect
from tests.support.vision import QUESTION, VISION_MODEL


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG", optimize=True)
    return out.getvalue()


def _request(images: list[bytes]) -> GenerateRequest:
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": QUESTION}]
    return GenerateRequest(messages=[{"role": "user", "content": content}], max_tokens=3, ignore_eos=True, sampling=SamplingParams(temperature=0.0))


@pytest.mark.slow
async def test_images_past_the_request_total_are_refused_before_decoding_and_the_runtime_goes_on(monkeypatch):
    limits = LimitsConfig(max_images=4, max_image_pixels=1_000_000, max_request_pixels=1_500_000)
    config = msgspec.structs.replace(make_config(VISION_MODEL), limits=limits)
    large, small = _png(1000, 800), _png(40, 30)  # 800,000 pixels each: two are 1.6M
    decoded: list[tuple[int, int]] = []
    original = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self.size) or original(self))
    async with Runtime.open(config) as rt:
        decoded.clear()  # (the load's warm-up decodes an image of its own)
        with pytest.raises(RequestTooLargeError) as info:
            await collect(rt.generate(_request([large, large])))
        assert decoded == []
        served = await collect(rt.generate(_request([large, small])))
    refused = info.value
    assert refused.field == "messages" and "limits.max_request_pixels" in str(refused) and "1600000 pixels" in str(refused)
    assert len(served.tokens) == 3 and (1000, 800) in decoded
