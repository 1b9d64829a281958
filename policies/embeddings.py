"""Checks and token ids for an embedding call (`Runtime.embed`): pure, but for the tokenizer.

`embedding_options` settles the pooling and normalization (the call's, else `[embeddings]`'s);
`embedding_ids` turns the inputs (texts or token-id lists) into token ids, refusing what cannot
be embedded with `InvalidRequestError` naming the input (`input[2]`): no inputs, too many, an
empty one, an id outside the vocabulary; `RequestTooLargeError` for an input over the context or
too many tokens in all. Texts are tokenized as a completion prompt is (a BOS added unless the
text has one) and refused by size before tokenizing. Blocking: call it off the event loop.
"""

from __future__ import annotations

from typing import Any

from policies.validation import max_prompt_bytes
from protocols.config import EmbeddingsConfig, LimitsConfig, Pooling
from protocols.errors import InvalidRequestError, RequestTooLargeError
from protocols.model import ModelInfo

POOLINGS = ("last", "mean")


def embedding_options(pooling: Any, normalize: Any, config: EmbeddingsConfig) -> tuple[Pooling, bool]:
    if pooling is None:
        pooling = config.pooling
    if pooling not in POOLINGS:
        raise InvalidRequestError(f"pooling is one of {', '.join(POOLINGS)}, not {pooling!r}", field="pooling")
    if normalize is None:
        normalize = config.normalize
    if not isinstance(normalize, bool):
        raise InvalidRequestError("normalize is true or false", field="normalize")
    return pooling, normalize


def embedding_ids(inputs: Any, tokenizer: Any, info: ModelInfo, config: EmbeddingsConfig, limits: LimitsConfig) -> list[list[int]]:
    """Each input's token ids, in order (see the module docstring)."""
    if not isinstance(inputs, list) or not inputs:
        raise InvalidRequestError("input needs at least one text or token-id list", field="input")
    if len(inputs) > config.max_inputs:
        raise InvalidRequestError(f"at most {config.max_inputs} inputs per call (embeddings.max_inputs), not {len(inputs)}", field="input")
    max_bytes = max_prompt_bytes(info, limits)
    bos = getattr(tokenizer, "bos_token", None)
    ids: list[list[int]] = []
    total = 0
    for i, item in enumerate(inputs):
        field = f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError(f"{field} is an empty string", field=field)
            if len(item) * 4 > max_bytes and len(item.encode()) > max_bytes:
                raise RequestTooLargeError(f"{field} has more than {max_bytes} bytes, more than the context can hold", field=field)
            tokens = list(tokenizer.encode(item, add_special_tokens=bos is None or not item.startswith(bos)))
        elif isinstance(item, list):
            tokens = _token_ids(item, info.vocab_size, field)
        else:
            raise InvalidRequestError(f"{field} is a text or a list of token ids", field=field)
        if not tokens:
            raise InvalidRequestError(f"{field} has no tokens", field=field)
        if len(tokens) > info.max_context:
            raise RequestTooLargeError(f"{field} has {len(tokens)} tokens, more than the model's context ({info.max_context})", field=field)
        total += len(tokens)
        if total > config.max_tokens:
            raise RequestTooLargeError(f"the inputs have more than {config.max_tokens} tokens in all (embeddings.max_tokens)", field="input")
        ids.append(tokens)
    return ids


def _token_ids(item: list, vocab_size: int, field: str) -> list[int]:
    if not item:
        raise InvalidRequestError(f"{field} is an empty list of token ids", field=field)
    for j, token in enumerate(item):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise InvalidRequestError(f"{field}[{j}] = {token!r} is not a token id of the vocabulary (0..{vocab_size - 1})", field=field)
    return list(item)
