"""Checks and prompts for a `GenerateRequest`: what `runtime.admission` calls.

`validate` raises `InvalidRequestError` naming the field, before any compute and
before anything large is built from the request (its limits come from `[limits]`);
`render_prompt` turns text or chat messages into token ids with the model's own
tokenizer and chat template, refusing a prompt too large for the context by its
size before tokenizing it (call it off the event loop).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeGuard

from protocols.api import DenoisingOptions, GenerateRequest, SamplingParams
from protocols.config import LimitsConfig
from protocols.errors import ContextLengthError, InvalidRequestError, RequestTooLargeError
from protocols.model import ModelInfo

MAX_TOP_LOGPROBS = 20
MAX_PENALTY_CONTEXT = 4096
MAX_MESSAGE_DEPTH = 32
MAX_SEED = (1 << 64) - 1
MAX_ADAPTER_NAME = 200
# Per-request logits controls: OpenAI's limits for logit_bias; bad words (each tokenized twice).
MAX_LOGIT_BIAS = 300
MAX_BIAS = 100
MAX_BAD_WORDS = 128
MAX_BAD_WORD_BYTES = 8192
# Request ids: safe in an HTTP header, a log line and a checkpoint file name, on every front.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:@-]{1,200}")


def check_request_id(request_id: object) -> None:
    """Raises `InvalidRequestError` (field `request_id`) unless the id is 1-200 letters, digits
    or `. _ : @ -`: it travels in headers (no CR/LF, ASCII) and names checkpoint files."""
    if not isinstance(request_id, str) or not REQUEST_ID.fullmatch(request_id):
        shown = repr(request_id)[:80]
        raise InvalidRequestError(f"request_id {shown} must be 1-200 letters, digits or . _ : @ -", field="request_id")


def validate(request: GenerateRequest, info: ModelInfo, limits: LimitsConfig = LimitsConfig()) -> None:
    """Checks that need no tokenizer."""
    given = [name for name in ("prompt", "prompt_ids", "messages") if getattr(request, name) is not None]
    if len(given) != 1:
        raise InvalidRequestError(f"exactly one of prompt, prompt_ids, messages is required (got {given or 'none'})", field="prompt")
    if request.max_tokens is not None and (not isinstance(request.max_tokens, int) or request.max_tokens < 1):
        raise InvalidRequestError(f"max_tokens must be a positive integer, got {request.max_tokens!r}", field="max_tokens")
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", field="top_logprobs")
    if request.truncate_prompt_tokens is not None and (not isinstance(request.truncate_prompt_tokens, int) or request.truncate_prompt_tokens < 1):
        raise InvalidRequestError("truncate_prompt_tokens must be a positive integer", field="truncate_prompt_tokens")
    if request.prompt_logprobs is not None and not 0 <= request.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", field="prompt_logprobs")
    if any(not isinstance(s, str) or not s for s in request.stop):
        raise InvalidRequestError("stop strings must be non-empty strings", field="stop")
    if len(request.stop) > limits.max_stop_strings:
        raise InvalidRequestError(f"at most {limits.max_stop_strings} stop strings (limits.max_stop_strings)", field="stop")
    if sum(len(s.encode()) for s in request.stop) > limits.max_stop_bytes:
        raise InvalidRequestError(f"stop strings exceed {limits.max_stop_bytes} bytes in all (limits.max_stop_bytes)", field="stop")
    check_ids(request.stop_token_ids, info.vocab_size, "stop_token_ids")
    if request.prompt_ids is not None:
        check_ids(request.prompt_ids, info.vocab_size, "prompt_ids")
    if request.prompt is not None and len(request.prompt) > (limit := max_prompt_bytes(info, limits)):
        # (Each character is a byte or more: refused here, without encoding it, rather than after
        # its text has gone to a tokenizing worker, which a busy machine may keep waiting.)
        raise _too_large_text(limit, "prompt")
    if request.tools is not None and (not isinstance(request.tools, list) or not all(isinstance(t, dict) for t in request.tools)):
        raise InvalidRequestError("tools must be a list of objects", field="tools")
    for field in ("response_format", "tools", "tool_choice"):
        _check_structure(getattr(request, field), field, limits)
    if request.messages is not None and _depth_exceeds(request.messages, MAX_MESSAGE_DEPTH):
        raise InvalidRequestError(f"messages are nested deeper than {MAX_MESSAGE_DEPTH} levels", field="messages")
    forced_call = request.tool_choice not in (None, "auto", "none")
    if (request.response_format is not None or forced_call) and request.ignore_eos:
        what = "response_format" if request.response_format is not None else "a forced tool_choice"
        raise InvalidRequestError(f"ignore_eos cannot be combined with {what}: a finished grammar only allows end of sequence", field="ignore_eos")
    if request.adapter is not None and (not isinstance(request.adapter, str) or not 0 < len(request.adapter) <= MAX_ADAPTER_NAME):
        raise InvalidRequestError(f"adapter must be a name of 1-{MAX_ADAPTER_NAME} characters", field="adapter")
    if request.checkpoint_every is not None and (not isinstance(request.checkpoint_every, int) or request.checkpoint_every < 0):
        raise InvalidRequestError("checkpoint_every must be an integer >= 0", field="checkpoint_every")
    if request.snapshot_at is not None and (not isinstance(request.snapshot_at, int) or request.snapshot_at < 1):
        raise InvalidRequestError("snapshot_at must be a positive number of prompt tokens", field="snapshot_at")
    if request.messages is not None and (not request.messages or not all(isinstance(m, dict) for m in request.messages)):
        raise InvalidRequestError("messages must be a non-empty list of objects", field="messages")
    validate_sampling(request.sampling)
    validate_denoising(request, info, limits)
    validate_logit_controls(request.sampling, info.vocab_size, request.max_tokens)


def validate_denoising(request: GenerateRequest, info: ModelInfo, limits: LimitsConfig = LimitsConfig()) -> None:
    """A diffusion model's request: its options in range, and what its denoising rule does not
    define refused by name (never silently ignored); options for another model refused."""
    options = request.denoising
    if not info.denoising:
        if options is not None:
            raise InvalidRequestError("denoising options apply to diffusion language models only", field="denoising")
        return
    if options is not None:
        check_denoising_options(options, info, limits)
    s, defaults = request.sampling, SamplingParams()
    refused = {
        "logprobs": request.logprobs or request.top_logprobs > 0,
        "prompt_logprobs": request.prompt_logprobs is not None,
        "response_format": request.response_format is not None,
        "tool_choice": request.tool_choice not in (None, "auto", "none"),
        "speculative": request.speculative is True,
        "fill": request.fill not in (None, "off"),
        "checkpoint_every": bool(request.checkpoint_every),
        "adapter": request.adapter is not None,
        "snapshot_at": request.snapshot_at is not None,
        "sampling": any(
            getattr(s, name) != getattr(defaults, name)
            for name in (
                "top_p",
                "top_k",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "logit_bias",
                "min_tokens",
                "allowed_token_ids",
                "bad_words",
            )
        ),
    }
    for name, asked in refused.items():
        if asked:
            what = "sampling filters, penalties and logits controls" if name == "sampling" else name
            raise InvalidRequestError(f"{what} do not apply to a diffusion language model's denoising (its rule: temperature and seed)", field=name)


def check_denoising_options(options: DenoisingOptions, info: ModelInfo, limits: LimitsConfig) -> None:
    """Each option an integer (a number for `threshold`) in range: the engine sizes arrays and
    loops by them, so a float or a bool there would fail a step shared with other requests."""
    if not isinstance(options, DenoisingOptions):
        raise InvalidRequestError("denoising must be an object of denoising options", field="denoising")
    canvas = options.canvas_length if _is_count(options.canvas_length) else info.canvas_length
    for name, value, most, why in (
        ("max_steps", options.max_steps, limits.max_denoise_steps, "limits.max_denoise_steps"),
        ("canvas_length", options.canvas_length, info.canvas_length, f"the model's {'block' if info.denoises_blocks else 'canvas'} length"),
        ("min_canvas_length", options.min_canvas_length, canvas, "the canvas length"),
    ):
        if value is not None and not (_is_count(value) and 1 <= value <= most):
            raise InvalidRequestError(f"denoising.{name} must be an integer in [1, {most}] ({why}), got {repr(value)[:40]}", field=f"denoising.{name}")
    threshold = options.threshold
    if threshold is not None and not (isinstance(threshold, int | float) and not isinstance(threshold, bool) and 0.0 <= threshold <= 1.0):
        raise InvalidRequestError(f"denoising.threshold must be a number in [0, 1], got {repr(threshold)[:40]}", field="denoising.threshold")


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_sampling(s: SamplingParams) -> None:
    checks = [
        ("seed", s.seed is None or (isinstance(s.seed, int) and 0 <= s.seed <= MAX_SEED), "an integer in [0, 2**64)"),
        ("temperature", s.temperature >= 0 and math.isfinite(s.temperature), "a finite number >= 0"),
        ("top_p", 0 < s.top_p <= 1, "in (0, 1]"),
        ("top_k", isinstance(s.top_k, int) and s.top_k >= 0, "an integer >= 0"),
        ("min_p", 0 <= s.min_p <= 1, "in [0, 1]"),
        ("repetition_penalty", s.repetition_penalty > 0 and math.isfinite(s.repetition_penalty), "a finite number > 0"),
        ("presence_penalty", math.isfinite(s.presence_penalty), "finite"),
        ("frequency_penalty", math.isfinite(s.frequency_penalty), "finite"),
        (
            "penalty_context_size",
            isinstance(s.penalty_context_size, int) and 1 <= s.penalty_context_size <= MAX_PENALTY_CONTEXT,
            f"an integer in [1, {MAX_PENALTY_CONTEXT}]",
        ),
    ]
    for name, ok, expected in checks:
        if not ok:
            raise InvalidRequestError(f"sampling.{name} must be {expected}, got {getattr(s, name)!r}", field=f"sampling.{name}")


def validate_logit_controls(s: SamplingParams, vocab_size: int, max_tokens: int | None = None) -> None:
    """`logit_bias`, `min_tokens`, `allowed_token_ids`, `bad_words`: types, ranges and sizes."""
    bias = s.logit_bias
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"sampling.logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases", field="sampling.logit_bias")
        check_ids(list(bias), vocab_size, "sampling.logit_bias")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and -MAX_BIAS <= v <= MAX_BIAS for v in bias.values()):
            raise InvalidRequestError(f"sampling.logit_bias values must be numbers in [-{MAX_BIAS}, {MAX_BIAS}]", field="sampling.logit_bias")
    if not isinstance(s.min_tokens, int) or isinstance(s.min_tokens, bool) or s.min_tokens < 0:
        raise InvalidRequestError(f"sampling.min_tokens must be an integer >= 0, got {s.min_tokens!r}", field="sampling.min_tokens")
    if max_tokens is not None and s.min_tokens > max_tokens:
        raise InvalidRequestError(f"sampling.min_tokens ({s.min_tokens}) must be at most max_tokens ({max_tokens})", field="sampling.min_tokens")
    if s.allowed_token_ids is not None:
        check_ids(s.allowed_token_ids, vocab_size, "sampling.allowed_token_ids")
        if not 0 < len(s.allowed_token_ids) <= vocab_size:
            raise InvalidRequestError(f"sampling.allowed_token_ids must hold 1-{vocab_size} token ids", field="sampling.allowed_token_ids")
    words = s.bad_words
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
            raise InvalidRequestError("sampling.bad_words must be a list of non-blank strings", field="sampling.bad_words")
        if len(words) > MAX_BAD_WORDS or sum(len(w.encode()) for w in words) > MAX_BAD_WORD_BYTES:
            raise InvalidRequestError(f"at most {MAX_BAD_WORDS} bad_words of {MAX_BAD_WORD_BYTES} bytes in all", field="sampling.bad_words")


def bad_words_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each bad word's token ids as vLLM forms them (blocking; run in a worker thread): the word
    without leading spaces, and with one leading space where that makes a new first token of the
    same length (so the word is banned at the start of the text and after a space)."""
    found: list[list[int]] = []
    for word in words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (bare, spaced):
            if ids and ids not in found and (ids is bare or (bare and ids[0] != bare[0] and len(ids) == len(bare))):
                found.append(ids)
    return found


def check_ids(ids: Any, vocab_size: int, field: str) -> None:
    if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"{field} must be token ids in [0, {vocab_size})", field=field)


def _check_structure(value: Any, field: str, limits: LimitsConfig) -> None:
    """A response format or tool list small and shallow enough to compile (checked before use)."""
    if value is None or isinstance(value, str):
        return
    if _depth_exceeds(value, limits.max_grammar_depth):
        raise InvalidRequestError(f"{field} is nested deeper than {limits.max_grammar_depth} levels (limits.max_grammar_depth)", field=field)
    try:
        size = len(json.dumps(value))
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{field} must be plain JSON", field=field) from None
    if size > limits.max_grammar_bytes:
        raise InvalidRequestError(f"{field} exceeds {limits.max_grammar_bytes} bytes (limits.max_grammar_bytes)", field=field)


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether containers nest deeper than `limit` (level by level: deep input cannot blow the
    stack, and only containers are visited: a message list's strings cost one type check each)."""
    level = [value] if isinstance(value, _CONTAINERS) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        inner = []
        for node in level:
            children = node.values() if isinstance(node, dict) else node
            inner += [child for child in children if isinstance(child, _CONTAINERS)]
        level = inner
    return False


_CONTAINERS = (dict, list, tuple)


def max_prompt_bytes(info: ModelInfo, limits: LimitsConfig) -> int:
    """Prompt text longer than this cannot fit the context: each token covers at most
    `max_token_bytes` bytes (doubled for normalizers that shorten text)."""
    return limits.max_prompt_bytes or info.max_context * max(1, info.max_token_bytes) * 2


def check_text_size(text: str, limit: int, field: str) -> None:
    # Up to 4 bytes per character: count only when the characters alone might exceed it.
    if len(text) * 4 > limit and len(text.encode()) > limit:
        raise _too_large_text(limit, field)


def _too_large_text(limit: int, field: str) -> RequestTooLargeError:
    return RequestTooLargeError(f"the prompt has more than {limit} bytes, more than the context can hold", field=field)


def render_prompt(request: GenerateRequest, tokenizer: Any, max_bytes: int) -> list[int]:
    """Token ids of the request's prompt (blocking; run in a worker thread).

    Text that could not fit the context is refused by its size before it is tokenized.
    """
    if request.prompt_ids is not None:
        ids = list(request.prompt_ids)
    elif request.prompt is not None:
        check_text_size(request.prompt, max_bytes, "prompt")
        bos = getattr(tokenizer, "bos_token", None)
        ids = tokenizer.encode(request.prompt, add_special_tokens=bos is None or not request.prompt.startswith(bos))
    else:
        try:
            text = tokenizer.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja and template errors come in many types
            raise InvalidRequestError(f"messages could not be rendered with the chat template: {first_line(exc)}", field="messages") from None
        if not isinstance(text, str):
            raise InvalidRequestError("the chat template did not render text", field="messages")
        check_text_size(text, max_bytes, "messages")
        ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidRequestError("the prompt is empty", field="prompt")
    return ids[-request.truncate_prompt_tokens :] if request.truncate_prompt_tokens else ids


def effective_max_tokens(request: GenerateRequest, num_prompt: int, info: ModelInfo, default: int) -> int:
    """max_tokens, capped so prompt + generation fits the context."""
    room = info.max_context - num_prompt
    if room < 1:
        message = f"prompt of {num_prompt} tokens leaves no room in the model's context of {info.max_context}"
        raise ContextLengthError(message, num_tokens=num_prompt, max_context=info.max_context)
    return min(request.max_tokens or default, room)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
