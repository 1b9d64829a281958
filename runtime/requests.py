"""Turning a `GenerateRequest` into an engine admission: validation and prompts.

`validate` raises `InvalidRequestError` naming the field; `render_prompt` turns
text or chat messages into token ids with the model's own tokenizer and chat
template (call it off the event loop: templates and long prompts take time).
"""

from __future__ import annotations

import math
from typing import Any

from protocols.api import GenerateRequest, SamplingParams
from protocols.model import ModelInfo
from runtime.errors import InvalidRequestError, RequestTooLargeError

MAX_TOP_LOGPROBS = 20
MAX_PENALTY_CONTEXT = 4096


def validate(request: GenerateRequest, info: ModelInfo) -> None:
    """Checks that need no tokenizer."""
    given = [name for name in ("prompt", "prompt_ids", "messages") if getattr(request, name) is not None]
    if len(given) != 1:
        raise InvalidRequestError(f"exactly one of prompt, prompt_ids, messages is required (got {given or 'none'})", field="prompt")
    if request.max_tokens is not None and (not isinstance(request.max_tokens, int) or request.max_tokens < 1):
        raise InvalidRequestError(f"max_tokens must be a positive integer, got {request.max_tokens!r}", field="max_tokens")
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", field="top_logprobs")
    if any(not isinstance(s, str) or not s for s in request.stop):
        raise InvalidRequestError("stop strings must be non-empty strings", field="stop")
    _check_ids(request.stop_token_ids, info.vocab_size, "stop_token_ids")
    if request.prompt_ids is not None:
        _check_ids(request.prompt_ids, info.vocab_size, "prompt_ids")
    if request.tools is not None and (not isinstance(request.tools, list) or not all(isinstance(t, dict) for t in request.tools)):
        raise InvalidRequestError("tools must be a list of objects", field="tools")
    if request.response_format is not None and request.ignore_eos:
        raise InvalidRequestError("ignore_eos cannot be combined with response_format: a finished grammar only allows end of sequence", field="ignore_eos")
    if request.snapshot_at is not None and (not isinstance(request.snapshot_at, int) or request.snapshot_at < 1):
        raise InvalidRequestError("snapshot_at must be a positive number of prompt tokens", field="snapshot_at")
    if request.messages is not None and (not request.messages or not all(isinstance(m, dict) for m in request.messages)):
        raise InvalidRequestError("messages must be a non-empty list of objects", field="messages")
    validate_sampling(request.sampling)


def validate_sampling(s: SamplingParams) -> None:
    checks = [
        ("temperature", s.temperature >= 0 and math.isfinite(s.temperature), "a finite number >= 0"),
        ("top_p", 0 < s.top_p <= 1, "in (0, 1]"),
        ("top_k", isinstance(s.top_k, int) and s.top_k >= 0, "an integer >= 0"),
        ("min_p", 0 <= s.min_p <= 1, "in [0, 1]"),
        ("repetition_penalty", s.repetition_penalty > 0 and math.isfinite(s.repetition_penalty), "a finite number > 0"),
        ("presence_penalty", math.isfinite(s.presence_penalty), "finite"),
        ("frequency_penalty", math.isfinite(s.frequency_penalty), "finite"),
        ("penalty_context_size", isinstance(s.penalty_context_size, int) and 1 <= s.penalty_context_size <= MAX_PENALTY_CONTEXT, f"an integer in [1, {MAX_PENALTY_CONTEXT}]"),
    ]
    for name, ok, expected in checks:
        if not ok:
            raise InvalidRequestError(f"sampling.{name} must be {expected}, got {getattr(s, name)!r}", field=f"sampling.{name}")


def _check_ids(ids: Any, vocab_size: int, field: str) -> None:
    if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"{field} must be token ids in [0, {vocab_size})", field=field)


def render_prompt(request: GenerateRequest, tokenizer: Any) -> list[int]:
    """Token ids of the request's prompt (blocking; run in a worker thread)."""
    if request.prompt_ids is not None:
        ids = list(request.prompt_ids)
    elif request.prompt is not None:
        bos = getattr(tokenizer, "bos_token", None)
        ids = tokenizer.encode(request.prompt, add_special_tokens=bos is None or not request.prompt.startswith(bos))
    else:
        try:
            text = tokenizer.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja and template errors come in many types
            raise InvalidRequestError(f"messages could not be rendered with the chat template: {exc}", field="messages") from exc
        ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidRequestError("the prompt is empty", field="prompt")
    return ids


def effective_max_tokens(request: GenerateRequest, num_prompt: int, info: ModelInfo, default: int) -> int:
    """max_tokens, capped so prompt + generation fits the context."""
    room = info.max_context - num_prompt
    if room < 1:
        raise RequestTooLargeError(
            f"prompt of {num_prompt} tokens leaves no room in the model's context of {info.max_context}", field="prompt"
        )
    return min(request.max_tokens or default, room)
