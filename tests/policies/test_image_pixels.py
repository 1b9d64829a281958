"""Pixels per request (`limits.max_request_pixels`): all of a request's images are measured from
their headers, together, before any is decoded; past the total the request is refused typed
(413-kind `RequestTooLargeError`, field "messages") and no image has been decoded."""

from __future__ import annotations

import io

import msgspec
import numpy as np
import pytest
from PIL import Image

from policies import images as image_prompts
from policies.images import read_headers, render_images
from protocols.config import LimitsConfig
from protocols.errors import RequestTooLargeError

IMAGE_TOKEN = 99


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


class _Processor:
    """What `render_images` needs of a processor: ids with an image placeholder per image."""

    def __call__(self, text: list[str], images: list[list[Image.Image]], return_tensors: str) -> dict[str, np.ndarray]:
        return {"input_ids": np.array([[1] + [IMAGE_TOKEN] * len(images[0]) + [2]]), "pixel_values": np.zeros((len(images[0]), 3, 2, 2))}


def _decoded(monkeypatch) -> list[tuple[int, int]]:
    sizes: list[tuple[int, int]] = []
    original = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: sizes.append(self.size) or original(self))
    return sizes


def test_the_default_bounds_a_request_at_two_images_of_the_largest_size():
    limits = LimitsConfig()
    assert limits.max_request_pixels == 50_000_000 == 2 * limits.max_image_pixels
    assert msgspec.convert({"max_request_pixels": 1}, LimitsConfig).max_request_pixels == 1
    for bad in (0, -1, "many"):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"max_request_pixels": bad}, LimitsConfig)


def test_images_each_within_their_limit_but_past_the_request_total_are_refused_before_any_is_decoded(monkeypatch):
    limits = LimitsConfig(max_images=8, max_image_pixels=10_000, max_request_pixels=25_000)
    decoded = _decoded(monkeypatch)
    images = [_png(100, 80)] * 3 + [_png(20, 10)]  # 8,000 pixels each, then 200: 24,200
    rendered = render_images("<image>" * 4, images, _Processor(), IMAGE_TOKEN, 1000, limits)
    assert rendered.prompt_ids.count(IMAGE_TOKEN) == 4 and set(decoded) == {(100, 80), (20, 10)}
    images.append(_png(30, 30))  # (PIL loads what it saves: made before counting)
    decoded.clear()
    with pytest.raises(RequestTooLargeError) as info:
        render_images("<image>" * 5, images, _Processor(), IMAGE_TOKEN, 1000, limits)
    assert decoded == []
    assert info.value.field == "messages" and "limits.max_request_pixels" in str(info.value) and "25100 pixels" in str(info.value)


def test_the_headers_are_read_once_and_a_single_image_past_its_own_limit_names_that_limit(monkeypatch):
    limits = LimitsConfig(max_image_pixels=1000, max_request_pixels=1_000_000)
    with pytest.raises(RequestTooLargeError, match=r"limits\.max_image_pixels"):
        read_headers([_png(20, 20), _png(40, 40)], limits)
    reads: list[int] = []
    original = image_prompts.read_header
    monkeypatch.setattr(image_prompts, "read_header", lambda data, max_pixels: reads.append(len(data)) or original(data, max_pixels))
    render_images("<image>" * 2, [_png(20, 20), _png(10, 30)], _Processor(), IMAGE_TOKEN, 1000, limits)
    assert len(reads) == 2
