"""`POST /v1/embeddings` in OpenAI's shape: `input` a string, a list of strings, a list of token
ids or a list of token-id lists; one vector per input from the model's final hidden states
(`Serving.embed`), as floats or, with `encoding_format: "base64"`, as the base64 of their
little-endian float32 bytes (what OpenAI's SDK decodes, and asks for by default). mlxrt's own
fields: `pooling` ("last" or "mean") and `normalize`. `dimensions` is refused unless it is the
model's width (vectors are never truncated). Bad input is a 400 naming the field (`input[2]`)."""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

import msgspec

from net.http.errors import HttpError
from protocols.config import Pooling
from protocols.errors import InvalidRequestError
from runtime.serving import Serving

INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None
    # mlxrt's own (default: `[embeddings]`).
    pooling: Pooling | None = None
    normalize: bool | None = None


class Embedding(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def inputs_of(body: EmbeddingRequest) -> list[str] | list[list[int]]:
    """The inputs as a list (one string or one token-id list is one input); their items are
    checked by the runtime, which names the one at fault."""
    value = body.input
    if isinstance(value, str):
        return [value]
    if not value:
        raise HttpError("invalid_request", "input is an empty list", "input")
    if all(isinstance(item, str) for item in value):
        return value
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return [value]
    if all(isinstance(item, list) for item in value):
        return value
    raise HttpError("invalid_request", f"input is {INPUT_SHAPES}, not a mixture", "input")


def check_dimensions(body: EmbeddingRequest, width: int) -> None:
    """Vectors have the model's width: `dimensions` may only name it (0: not known here)."""
    if body.dimensions is not None and width and body.dimensions != width:
        raise HttpError("invalid_request", f"dimensions must be the model's embedding width, {width} (vectors are not truncated)", "dimensions")


async def embed(runtime: Serving, body: EmbeddingRequest, model: str | None) -> tuple[list[list[float]], int]:
    """The vectors and token count; a single input's errors name `input` itself."""
    single = isinstance(body.input, str) or not all(isinstance(item, str | list) for item in body.input)
    try:
        vectors, num_tokens = await runtime.embed(inputs_of(body), model=model, pooling=body.pooling, normalize=body.normalize)
    except InvalidRequestError as exc:
        if single and exc.field is not None and exc.field.startswith("input[0]"):
            exc.field = "input" + exc.field.removeprefix("input[0]")
        raise
    if vectors:
        check_dimensions(body, len(vectors[0]))
    return vectors, num_tokens


def encode_response(body: EmbeddingRequest, vectors: list[list[float]], num_tokens: int) -> bytes:
    """The response JSON (blocking for many long vectors: run it in a worker thread)."""
    as_base64 = body.encoding_format == "base64"
    data = [Embedding(index=i, embedding=_base64(vector) if as_base64 else vector) for i, vector in enumerate(vectors)]
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return msgspec.json.encode(EmbeddingResponse(data=data, model=body.model, usage=usage))


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
