"""The tokenizer routes, in vLLM's shapes (lm-eval's `RemoteTokenizer` and load generators use them):
`POST /tokenize` (a prompt, or messages rendered as generation renders them), `POST /detokenize`
and `GET /tokenizer_info`. Tokenizing is CPU work, bounded by `[limits]` (`check_sizes`: text
bytes, messages, token ids) before it starts; it runs in a worker thread, or past
`scheduler.bulk_tokenize_bytes` in a low-priority worker process (`runtime.offload`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from net.http import openai_types as oa
from net.http.errors import HttpError
from net.http.mapping import chat_messages, chat_parts, check_messages
from policies.images import has_images
from policies.validation import render_prompt
from protocols.api import GenerateRequest
from protocols.config import LimitsConfig
from protocols.errors import MlxrtError


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    # Exactly one of the two.
    prompt: str | None = None
    messages: Annotated[list[oa.ChatMessage], msgspec.Meta(min_length=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    # Default: true for a prompt (as a completion tokenizes it), false for messages (the template has them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


def check_sizes(body: TokenizeRequest | DetokenizeRequest, limits: LimitsConfig) -> None:
    """What the body asks of the tokenizer within `[limits]`, checked on arrival: a prompt's bytes
    (413), messages and their parts, token ids to decode."""
    if isinstance(body, DetokenizeRequest):
        if len(body.tokens) > limits.max_detokenize_tokens:
            message = f"{len(body.tokens)} token ids; at most {limits.max_detokenize_tokens} per request (limits.max_detokenize_tokens)"
            raise HttpError("invalid_request", message, "tokens")
        return
    limit = limits.max_tokenize_bytes
    if body.prompt is not None and len(body.prompt) * 4 > limit and len(body.prompt.encode()) > limit:
        raise HttpError("body_too_large", f"the prompt has more than {limit} bytes (limits.max_tokenize_bytes)", "prompt")
    if body.messages is not None:
        check_messages(len(body.messages), chat_parts(body.messages), limits)


def tokenize(tokenizer: Any, body: TokenizeRequest, max_bytes: int, max_model_len: int, token_text: Callable[[int], str] | None = None) -> TokenizeResponse:
    """Blocking: run in a worker thread or process (`runtime.offload`). `token_text`: each token's
    text (cached), else decoded here."""
    if (body.prompt is None) == (body.messages is None):
        raise HttpError("invalid_request", "give exactly one of `prompt` and `messages`", "prompt")
    if body.continue_final_message and body.add_generation_prompt:
        raise HttpError("invalid_request", "continue_final_message needs add_generation_prompt: false", "continue_final_message")
    try:
        if body.prompt is not None:
            if len(body.prompt.encode()) > max_bytes:
                raise HttpError("body_too_large", f"the prompt has more than {max_bytes} bytes (limits.max_tokenize_bytes)", "prompt")
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            tokens = _render(tokenizer, body, max_bytes)
    except MlxrtError as exc:
        raise HttpError("invalid_request", str(exc), "messages") from None
    return token_response(tokenizer, tokens, body, max_model_len, token_text)


def token_response(
    tokenizer: Any, tokens: list[int], body: TokenizeRequest, max_model_len: int, token_text: Callable[[int], str] | None = None
) -> TokenizeResponse:
    # Each distinct token decoded once (a long prompt repeats few of the vocabulary's tokens).
    decoded: dict[int, str] = {}
    text = token_text or (lambda t: decoded[t] if t in decoded else decoded.setdefault(t, tokenizer.decode([t])))
    strs = [text(t) for t in tokens] if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens, token_strs=strs)


def image_request(body: TokenizeRequest) -> GenerateRequest | None:
    """Messages with images, as a chat request renders them: counted by the runtime (each image
    expanded by the model's processor, as generation runs it); None without images. Another
    rendering of images is refused: it would count each image as its placeholder."""
    if body.messages is None:
        return None
    messages = chat_messages(body.messages)
    if not has_images(messages):
        return None
    if not body.add_generation_prompt or body.add_special_tokens or body.continue_final_message:
        raise HttpError("invalid_request", "messages with images are tokenized only as a chat request renders them", "messages")
    return GenerateRequest(messages=messages, tools=body.tools)


def _render(tokenizer: Any, body: TokenizeRequest, max_bytes: int) -> list[int]:
    """Messages as a chat request renders them (the same call: `policies.validation.render_prompt`),
    unless the body asks for another rendering (no generation prompt, special tokens)."""
    assert body.messages is not None
    messages = chat_messages(body.messages)
    if body.add_generation_prompt and not body.add_special_tokens:
        return render_prompt(GenerateRequest(messages=messages, tools=body.tools), tokenizer, max_bytes)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message, tokenize=False
        )
    except Exception as exc:  # jinja and template errors come in many types
        raise HttpError("invalid_request", f"messages could not be rendered with the chat template: {type(exc).__name__}", "messages") from None
    if len(text.encode()) > max_bytes:
        raise HttpError("body_too_large", f"the rendered messages have more than {max_bytes} bytes (limits.max_tokenize_bytes)", "messages")
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


def detokenize(tokenizer: Any, body: DetokenizeRequest, vocab_size: int) -> DetokenizeResponse:
    """Blocking: run in a worker thread or process (`runtime.offload`)."""
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab_size:
            raise HttpError("invalid_request", f"token id {token} is outside the vocabulary (0..{vocab_size - 1})", f"tokens[{i}]")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))


def tokenize_json(tokenizer: Any, *args: Any) -> bytes:
    """`tokenize`'s answer as JSON bytes, encoded where it ran: a megabyte's tokens (and their
    strings) are encoded by the worker, not by the server's process beside the MLX thread."""
    return msgspec.json.encode(tokenize(tokenizer, *args))


def detokenize_json(tokenizer: Any, *args: Any) -> bytes:
    """`detokenize`'s answer as JSON bytes, encoded where it ran (see `tokenize_json`)."""
    return msgspec.json.encode(detokenize(tokenizer, *args))


def tokenizer_info(tokenizer: Any, max_model_len: int, vocab_size: int) -> dict[str, Any]:
    """The tokenizer's special tokens, chat template and limits (vLLM's `/tokenizer_info` fields)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    info: dict[str, Any] = {"tokenizer_class": type(hf).__name__, "model_max_length": max_model_len, "vocab_size": vocab_size}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(hf, name, None)
        info[name] = value if isinstance(value, str) else None
    template = getattr(hf, "chat_template", None)
    info["chat_template"] = template if isinstance(template, str) else None
    info["add_bos_token"] = bool(getattr(hf, "add_bos_token", False))
    return info
