"""policies.images on its own: image parts found in chat messages in both shapes, their bytes
taken from bytes, base64 or data: URLs (remote URLs only through a fetch the server allows),
each limit a typed error before anything is decoded, and the ids the prefix cache keys an image
prompt by."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from policies.images import has_images, image_parts, key_ids, read_headers, remote_urls, without_image_bytes
from protocols.config import LimitsConfig
from protocols.errors import InvalidRequestError, RequestTooLargeError

LIMITS = LimitsConfig()


def png(width: int = 8, height: int = 6) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


TEXT = {"type": "text", "text": "What is this?"}


def test_both_shapes_are_found_and_rendered_as_placeholders_in_order():
    data = png()
    messages = [
        {"role": "system", "content": "Be brief."},
        user({"type": "image", "image": data}, TEXT),
        user({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(4, 4)).decode()}}),
        user({"type": "image", "image": base64.b64encode(png(2, 2)).decode()}),
    ]
    assert has_images(messages) and not has_images(messages[:1]) and not has_images(None)
    rendered, images = image_parts(messages, LIMITS)
    assert images == [data, png(4, 4), png(2, 2)]
    assert rendered[0] == messages[0]
    assert rendered[1]["content"] == [{"type": "image"}, TEXT]
    assert rendered[2]["content"] == rendered[3]["content"] == [{"type": "image"}]
    assert [(h.format, h.num_pixels) for h in read_headers(images, LIMITS)] == [("PNG", 48), ("PNG", 16), ("PNG", 4)]


def test_remote_urls_are_refused_unless_a_fetch_is_given():
    messages = [user({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, {"type": "image", "image": png()})]
    assert remote_urls(messages, LIMITS) == ["https://example.com/cat.png"]
    with pytest.raises(InvalidRequestError, match="allow_remote_images"):
        image_parts(messages, LIMITS)
    asked: list[tuple[str, int]] = []

    def fetch(url: str, max_bytes: int) -> bytes:
        asked.append((url, max_bytes))
        return png(3, 3)

    _, images = image_parts(messages, LIMITS, fetch)
    assert images == [png(3, 3), png()] and asked == [("https://example.com/cat.png", LIMITS.max_image_bytes)]


@pytest.mark.parametrize(
    "part,kind,match",
    [
        ({"type": "image", "image": 7}, InvalidRequestError, "must carry the image"),
        ({"type": "image", "image": "not base64!"}, InvalidRequestError, "not valid base64"),
        ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, InvalidRequestError, "data:image/"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,raw"}}, InvalidRequestError, "data:image/"),
        ({"type": "image", "image": b"x" * 101}, RequestTooLargeError, "max_image_bytes"),
        ({"type": "image", "image": "A" * 200}, RequestTooLargeError, "max_image_bytes"),  # by its length, before decoding
    ],
)
def test_a_bad_image_part_is_refused_typed(part, kind, match):
    with pytest.raises(kind, match=match) as refused:
        image_parts([user(part)], LimitsConfig(max_image_bytes=100))
    assert refused.value.field == "messages"


def test_too_many_images_are_refused_before_any_is_read_or_fetched():
    limits = LimitsConfig(max_images=2)
    messages = [user(*[{"type": "image_url", "image_url": {"url": f"https://example.com/{i}.png"}} for i in range(3)])]
    with pytest.raises(InvalidRequestError, match="max_images"):
        remote_urls(messages, limits)

    def fetch(url: str, max_bytes: int) -> bytes:
        return png()

    with pytest.raises(InvalidRequestError, match="max_images"):
        image_parts(messages, limits, fetch)


def test_the_request_pixels_are_bounded_together_from_the_headers():
    images = [png(100, 100), png(100, 100)]
    assert sum(h.num_pixels for h in read_headers(images, LimitsConfig(max_request_pixels=20_000))) == 20_000
    with pytest.raises(RequestTooLargeError, match="max_request_pixels"):
        read_headers(images, LimitsConfig(max_request_pixels=19_999))


def test_key_ids_part_at_the_first_image_token_when_the_images_differ():
    vocab, image_token = 100, 99
    ids = [5, 6, image_token, image_token, 7]
    a, same, other = key_ids(ids, image_token, ["d1"], vocab), key_ids(ids, image_token, ["d1"], vocab), key_ids(ids, image_token, ["d2"], vocab)
    assert a == same and a[:2] == other[:2] == [5, 6] and a[4] == other[4] == 7
    assert a[2] == a[3] >= vocab and other[2] >= vocab and a[2] != other[2]
    assert key_ids([5, 6, 7], image_token, ["d1"], vocab) == [5, 6, 7]


def test_a_checkpoint_keeps_each_images_digest_not_its_bytes():
    messages = [{"role": "system", "content": "hi"}, user({"type": "image", "image": png()}, TEXT), user({"type": "image_url", "image_url": {"url": "x"}})]
    kept = without_image_bytes(messages, ["d1", "d2"])
    assert kept[0] == messages[0]
    assert kept[1]["content"] == [{"type": "image", "digest": "d1"}, TEXT]
    assert kept[2]["content"] == [{"type": "image", "digest": "d2"}]
