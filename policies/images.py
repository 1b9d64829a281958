"""Images in chat messages (vision-language models): found, checked and decoded before any
compute, then rendered with the processor into token ids and pixel arrays (blocking; run in a
worker thread).

A message's content part is an image as
- `{"type": "image", "image": <bytes | base64 text | data: URL>}` (the native API, the socket), or
- `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` (OpenAI's shape).
Only images the request carries are read: a remote URL is refused (a server that fetches what a
prompt names is an SSRF hole) unless `server.allow_remote_images` is set (`runtime.remote_images`
fetches them first, bounded in bytes, time, redirects and hosts). Limits, each a typed error naming
the field: images per request, bytes per image, formats and pixels per image (both read from the
file's structure by `image_formats` before PIL sees it, so a bomb or a truncated file is refused
before it is decoded), and pixels of all the request's images together, from the same headers
before any is decoded; an animation's first frame only is decoded.

The prefix cache keys an image prompt by its token ids with every image position replaced by an
id past the vocabulary derived from the digests of the request's images (`key_ids`): the same
images and text are a hit, any other image is not, and text before the first image is shared
with any prompt that has it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.image_formats import ImageHeader, read_header
from protocols.config import LimitsConfig
from protocols.errors import InvalidRequestError, RequestTooLargeError

_IMAGE_TYPES = ("image", "image_url")


@dataclass(frozen=True)
class RenderedImages:
    """An image prompt: its ids, the processor's arrays (numpy), the images' digests, and the
    ids the prefix cache keys it by."""

    prompt_ids: list[int]
    arrays: dict[str, np.ndarray]
    digests: list[str]
    key_ids: list[int]


def has_images(messages: list[dict[str, Any]] | None) -> bool:
    return bool(messages) and any(_is_image(part) for m in messages or () for part in _parts(m))


Fetch = Callable[[str, int], bytes]


def image_parts(messages: list[dict[str, Any]], limits: LimitsConfig, fetch: Fetch | None = None) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The messages as the chat template sees them (each image part `{"type": "image"}`) and
    the images' bytes in order; an http(s) URL is read with `fetch(url, max_bytes)` where the
    server allows it, else refused. Raises `InvalidRequestError` / `RequestTooLargeError`."""
    images: list[bytes] = []
    rendered = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            if _is_image(part):
                if len(images) >= limits.max_images:
                    raise InvalidRequestError(f"at most {limits.max_images} images per request (limits.max_images)", field="messages")
                images.append(_image_bytes(part, limits, fetch))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    return rendered, images


def remote_urls(messages: list[dict[str, Any]], limits: LimitsConfig) -> list[str]:
    """The http(s) URLs the image parts name, in order (what `image_parts` will `fetch`).
    Raises `InvalidRequestError` for more than `limits.max_images` images, before any is fetched."""
    sources = [_source(part) for message in messages for part in _parts(message) if _is_image(part)]
    if len(sources) > limits.max_images:
        raise InvalidRequestError(f"at most {limits.max_images} images per request (limits.max_images)", field="messages")
    return [s for s in sources if isinstance(s, str) and s.startswith(("http://", "https://"))]


def read_headers(images: list[bytes], limits: LimitsConfig) -> list[ImageHeader]:
    """The images' headers (`image_formats.read_header`, each within `limits.max_image_pixels`),
    their pixels together within `limits.max_request_pixels`: all checked before any is decoded."""
    headers = [read_header(data, limits.max_image_pixels) for data in images]
    total = sum(header.num_pixels for header in headers)
    if total > limits.max_request_pixels:
        raise RequestTooLargeError(
            f"the request's {len(headers)} images have {total} pixels in all, more than {limits.max_request_pixels} (limits.max_request_pixels)",
            field="messages",
        )
    return headers


def decode_image(data: bytes, limits: LimitsConfig, header: ImageHeader | None = None) -> Any:
    """A PIL image in RGB (an animation's first frame), checked from its structure before PIL
    sees it (`image_formats.read_header`: an accepted format, whole, at most
    `limits.max_image_pixels` pixels; `header` where already read), then opened by that format's
    plugin alone."""
    from PIL import Image

    header = header or read_header(data, limits.max_image_pixels)
    try:
        image = Image.open(io.BytesIO(data), formats=(header.format,))
        width, height = image.size
    except Image.DecompressionBombError:
        raise RequestTooLargeError(f"an image has more pixels than {limits.max_image_pixels} (limits.max_image_pixels)", field="messages") from None
    except Exception:  # PIL raises several types for what is not an image it reads
        raise InvalidRequestError(f"an image is not a readable {header.format} file", field="messages") from None
    if width * height > limits.max_image_pixels:  # (PIL's view of the size, checked again)
        raise RequestTooLargeError(f"an image has {width}x{height} pixels, more than {limits.max_image_pixels} (limits.max_image_pixels)", field="messages")
    try:
        image.load()
        return image.convert("RGB")
    except Exception:
        raise InvalidRequestError("an image could not be decoded (truncated or damaged)", field="messages") from None


def render_images(text: str, images: list[bytes], processor: Any, image_token_id: int, vocab_size: int, limits: LimitsConfig) -> RenderedImages:
    """The processor's ids and arrays for a rendered prompt `text` (one image placeholder per
    image) and its images' bytes."""
    headers = read_headers(images, limits)
    pictures = [decode_image(data, limits, header) for data, header in zip(images, headers, strict=True)]
    try:
        out = processor(text=[text], images=[pictures], return_tensors="np")
    except Exception as exc:  # the processor's own checks (placeholders against images, sizes)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise InvalidRequestError(f"the images could not be processed: {first}", field="messages") from None
    ids = [int(t) for t in out["input_ids"][0]]
    arrays = {name: np.asarray(value) for name, value in out.items() if name != "input_ids"}
    digests = [hashlib.sha256(data).hexdigest() for data in images]
    if image_token_id not in ids:
        raise InvalidRequestError("the prompt has images but the chat template rendered no image placeholder for them", field="messages")
    return RenderedImages(prompt_ids=ids, arrays=arrays, digests=digests, key_ids=key_ids(ids, image_token_id, digests, vocab_size))


def render_image_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tokenizer: Any,
    vocab_size: int,
    max_bytes: int,
    limits: LimitsConfig,
    fetch: Fetch | None = None,
) -> RenderedImages:
    """An image chat request's prompt (blocking; run in a worker thread): the messages rendered
    with the chat template (image parts as the model's placeholder), then the processor."""
    from policies.validation import check_text_size, first_line

    processor = getattr(tokenizer, "processor", None)
    if processor is None:
        raise InvalidRequestError("this model takes no images (it is not a vision-language model)", field="messages")
    messages, images = image_parts(messages, limits, fetch)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja and template errors come in many types
        raise InvalidRequestError(f"messages could not be rendered with the chat template: {first_line(exc)}", field="messages") from None
    if not isinstance(text, str):
        raise InvalidRequestError("the chat template did not render text", field="messages")
    check_text_size(text, max_bytes, "messages")
    image_token_id = getattr(processor, "image_token_id", None)
    if not isinstance(image_token_id, int):
        image_token_id = tokenizer.convert_tokens_to_ids(getattr(processor, "image_token", "<image>"))
    return render_images(text, images, processor, image_token_id, vocab_size, limits)


def warm_up_image_prompt(tokenizer: Any, vocab_size: int) -> RenderedImages:
    """A small image and question rendered as a request's would be (the load's warm-up)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 48), (128, 96, 64)).save(out, format="PNG")
    messages = [{"role": "user", "content": [{"type": "image", "image": out.getvalue()}, {"type": "text", "text": "What is this?"}]}]
    return render_image_prompt(messages, None, tokenizer, vocab_size, 1 << 20, LimitsConfig())


def key_ids(ids: list[int], image_token_id: int, digests: list[str], vocab_size: int) -> list[int]:
    """`ids` with each image position replaced by an id past the vocabulary named by the
    request's image digests (so prompts with other images part at their first image token)."""
    named = hashlib.sha256("|".join(digests).encode()).digest()
    key = vocab_size + int.from_bytes(named[:6], "big")
    return [key if t == image_token_id else t for t in ids]


def without_image_bytes(messages: list[dict[str, Any]], digests: list[str]) -> list[dict[str, Any]]:
    """`messages` with each image part replaced by `{"type": "image", "digest": ...}` (in
    order): what a checkpoint keeps of them."""
    names = iter(digests)
    return [{**m, "content": [{"type": "image", "digest": next(names, "")} if _is_image(p) else p for p in _parts(m)]} if _parts(m) else m for m in messages]


def _parts(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else []


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in _IMAGE_TYPES


def _source(part: dict[str, Any]) -> Any:
    if part.get("type") == "image_url":
        source = part.get("image_url")
        return source.get("url") if isinstance(source, dict) else source
    return part.get("image")


def _image_bytes(part: dict[str, Any], limits: LimitsConfig, fetch: Fetch | None) -> bytes:
    source = _source(part)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith(("http://", "https://")) and fetch is not None:
        data = fetch(source, limits.max_image_bytes)
    elif isinstance(source, str):
        data = _text_image(source, limits)
    else:
        raise InvalidRequestError("an image part must carry the image: bytes, base64 text or a data: URL", field="messages")
    if len(data) > limits.max_image_bytes:
        raise RequestTooLargeError(f"an image has more than {limits.max_image_bytes} bytes (limits.max_image_bytes)", field="messages")
    return data


def _text_image(source: str, limits: LimitsConfig) -> bytes:
    if source.startswith(("http://", "https://")):
        raise InvalidRequestError(
            "remote image URLs are not fetched (server.allow_remote_images is off); send the image itself as a data: URL (base64)", field="messages"
        )
    if source.startswith("data:"):
        header, sep, source = source.partition(",")
        if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise InvalidRequestError("an image data: URL must be data:image/<format>;base64,<data>", field="messages")
    # Base64 is 4 characters per 3 bytes: refused by its length before it is decoded.
    if len(source) > (limits.max_image_bytes + 2) // 3 * 4 + 4:
        raise RequestTooLargeError(f"an image has more than {limits.max_image_bytes} bytes (limits.max_image_bytes)", field="messages")
    try:
        return base64.b64decode(source, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("an image is not valid base64", field="messages") from None
