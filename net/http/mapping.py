"""OpenAI's request bodies as `GenerateRequest`s: `chat_request` / `completion_requests` map a
body onto requests (one per prompt; `choices` makes `n` of each; refusing what has no equivalent:
`suffix`), `sampling_params` is every route's sampling (Anthropic's and Responses' too), and the
`check_*` functions bound what one request may ask for (`[limits]`) before anything is rendered.
Synchronous and pure.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from net.http import openai_types as oa
from net.http.errors import HttpError
from protocols.api import GenerateRequest, SamplingParams, new_request_id
from protocols.config import LimitsConfig


def _common(body: oa.ChatCompletionRequest | oa.CompletionRequest) -> dict[str, Any]:
    """The GenerateRequest fields both endpoints share."""
    sampling = sampling_params(body)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return {
        "sampling": sampling,
        "stop": stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "request_id": body.request_id or new_request_id(),
        "priority": body.priority,
        "response_format": _response_format(body),
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "jump_forward": body.jump_forward,
        "snapshot_at": body.snapshot_at,
        "checkpoint_every": body.checkpoint_every,
        "fill": body.fill,
        "speculative": body.speculative,
        "acceptance": body.acceptance,
        "denoising": body.denoising,
    }


def _logit_bias(given: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as JSON object keys) with integer keys; ranges and
    sizes are the runtime's checks."""
    if not given:
        return None
    try:
        return {int(key): value for key, value in given.items()}
    except ValueError:
        raise HttpError("invalid_request", "logit_bias keys must be token ids (integers)", "logit_bias") from None


def sampling_params(body: msgspec.Struct) -> SamplingParams:
    """The sampling a request body asks for, on every route: each `SamplingParams` field the body
    has and sets (OpenAI's chat and completions have them all, Responses no penalties or
    `logit_bias`, Anthropic's the few it names; an unset one keeps the runtime's default),
    `logit_bias` keyed by token id."""
    given = {name: value for name in SamplingParams.__struct_fields__ if (value := getattr(body, name, None)) is not None}
    if "logit_bias" in given:
        given["logit_bias"] = _logit_bias(given["logit_bias"])
    return SamplingParams(**given)


def _response_format(body: oa.ChatCompletionRequest | oa.CompletionRequest) -> dict[str, Any] | None:
    """`response_format`, or vLLM's structured outputs (`structured_outputs`, `guided_*`) as one."""
    given = dict(body.structured_outputs or {})
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            given[key] = value
    if not given:
        return body.response_format
    if body.response_format is not None or len(given) != 1:
        raise HttpError(
            "invalid_request", "give one structured output: response_format, or one of structured_outputs' json, regex, choice, grammar", "structured_outputs"
        )
    ((kind, value),) = given.items()
    if kind == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except (ValueError, RecursionError):
            raise HttpError("invalid_request", "structured_outputs.json must be a JSON schema", "structured_outputs.json") from None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if kind == "regex" and isinstance(value, str):
        return {"type": "regex", "pattern": value}
    if kind == "grammar" and isinstance(value, str):
        return {"type": "grammar", "ebnf": value}
    if kind == "choice" and isinstance(value, list) and value and all(isinstance(c, str) and c for c in value):
        return {"type": "regex", "pattern": "(" + "|".join(re.escape(c) for c in value) + ")"}
    raise HttpError("invalid_request", f"structured_outputs.{kind} has the wrong type", f"structured_outputs.{kind}")


def chat_request(body: oa.ChatCompletionRequest) -> GenerateRequest:
    if body.top_logprobs and not body.logprobs:
        raise HttpError("invalid_request", "top_logprobs needs logprobs: true", "top_logprobs")
    return GenerateRequest(
        messages=chat_messages(body.messages),
        max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        tools=body.tools,
        tool_choice=body.tool_choice,
        stream_tool_calls=body.stream,
        **_common(body),
    )


def chat_messages(messages: list[oa.ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the chat template takes them."""
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: oa.ChatMessage, index: int) -> dict[str, Any]:
    """One message as chat templates expect it: text content, tool-call arguments as objects."""
    where = f"messages[{index}]"
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    content: str | list[oa.ContentPart] | list[dict[str, Any]] | None = message.content
    if isinstance(message.content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(message.content):
            if part.type == "image_url" and part.image_url is not None:
                # Checked, decoded and refused where need be by admission (`policies.images`).
                parts.append({"type": "image", "image": part.image_url.url})
            elif part.type == "text" and part.text is not None:
                parts.append({"type": "text", "text": part.text})
            else:
                raise HttpError("invalid_request", f"content parts are text or image_url, got {part.type!r}", f"{where}.content[{j}].type")
        # Text alone is joined (as every chat template takes it); images keep the parts.
        content = parts if any(p["type"] == "image" for p in parts) else "".join(p["text"] for p in parts)
    out["content"] = content if content is not None else ""
    for key in ("name", "tool_call_id", "reasoning_content"):
        if (value := getattr(message, key)) is not None:
            out[key] = value
    if message.tool_calls:
        out["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(message.tool_calls)]
    return out


def _tool_call(call: oa.ToolCallIn, where: str) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):  # (50,000 `[` is too deep for any decoder)
            raise HttpError("invalid_request", "tool call arguments must be a JSON object", f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise HttpError("invalid_request", "tool call arguments must be a JSON object", f"{where}.function.arguments")
    out = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
    return out


# What `[limits]` allows when the caller gives no config (the defaults).
DEFAULT_LIMITS = LimitsConfig()


def completion_requests(body: oa.CompletionRequest, limits: LimitsConfig = DEFAULT_LIMITS) -> list[GenerateRequest]:
    """One request per prompt (a list of texts or of token-id lists is several prompts); too
    many prompts (x n) are refused before any is built."""
    check_choices(len(prompt_list(body.prompt)), body.n, limits)
    if body.suffix:
        raise HttpError("invalid_request", "suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise HttpError("invalid_request", "best_of other than n is not supported", "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise HttpError("invalid_request", "max_tokens: 0 only makes sense with echo (the prompt's own logprobs)", "max_tokens")
    prompts = prompt_list(body.prompt)
    common = _common(body)
    out: list[GenerateRequest] = []
    for i, prompt in enumerate(prompts):
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        if ids is not None and not (ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise HttpError("invalid_request", "prompt must be text, token ids, or a list of either", "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        out.append(
            GenerateRequest(
                prompt=text,
                prompt_ids=ids,
                # `max_tokens: 0` (echo): one token is generated, and left out of the answer.
                max_tokens=body.max_tokens or (1 if body.max_tokens == 0 else None),
                logprobs=body.logprobs is not None,
                top_logprobs=body.logprobs or 0,
                prompt_logprobs=body.logprobs or 0 if body.echo and body.logprobs is not None else body.prompt_logprobs,
                **common,
            )
        )
    return out


def choices(requests: list[GenerateRequest], n: int, limits: LimitsConfig = DEFAULT_LIMITS) -> list[GenerateRequest]:
    """`n` choices of each request, each a request of its own: ids `<id>-<k>` when there are
    several; a seeded request's choices take seeds seed, seed + 1, ... (distinct, reproducible).
    Several are bulk work (`GenerateRequest.bulk`): they yield to other clients' streams."""
    check_choices(len(requests), n, limits)
    if len(requests) * n == 1:
        return requests
    out: list[GenerateRequest] = []
    for request in requests:
        for k in range(n):
            seed = request.sampling.seed + k if request.sampling.seed is not None else None
            sampling = msgspec.structs.replace(request.sampling, seed=seed)
            out.append(msgspec.structs.replace(request, request_id=f"{request.request_id}-{len(out)}", sampling=sampling, bulk=True))
    return out


# -- what one request may ask for (`[limits]`), checked before anything is rendered --


def prompt_list(prompt: Any) -> list[Any]:
    """A completion body's prompts (a list of texts or of token-id lists is several)."""
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]


def check_choices(num_prompts: int, n: int, limits: LimitsConfig) -> None:
    """Prompts x n within `limits.max_choices` (each choice is a request of its own)."""
    limit = limits.max_choices
    if num_prompts * n > limit:
        param = "prompt" if num_prompts > limit else "n"
        raise HttpError("invalid_request", f"at most {limit} choices per request (prompts x n, {num_prompts} x {n}; limits.max_choices)", param)


def check_scored_prompt_tokens(num_tokens: int, limits: LimitsConfig, param: str) -> None:
    """Prompt tokens scored for prompt logprobs, all choices together, within `limits.max_prompt_logprobs_tokens`."""
    limit = limits.max_prompt_logprobs_tokens
    if num_tokens > limit:
        message = f"prompt logprobs would score {num_tokens} prompt tokens (prompts x n); at most {limit} (limits.max_prompt_logprobs_tokens)"
        raise HttpError("invalid_request", message, param)


def check_messages(num_messages: int, num_parts: int, limits: LimitsConfig, field: str = "messages") -> None:
    """Messages and their content parts within `limits.max_messages` and `limits.max_content_parts`
    (each is rendered by the chat template: checked before it is)."""
    if num_messages > limits.max_messages:
        raise HttpError("invalid_request", f"{field}: {num_messages} items, at most {limits.max_messages} per request (limits.max_messages)", field)
    if num_parts > limits.max_content_parts:
        message = f"{field}: {num_parts} content parts in all, at most {limits.max_content_parts} per request (limits.max_content_parts)"
        raise HttpError("invalid_request", message, field)


def chat_parts(messages: list[oa.ChatMessage]) -> int:
    """Content parts and tool calls of OpenAI chat messages, in all."""
    return sum((len(m.content) if isinstance(m.content, list) else 0) + len(m.tool_calls or []) for m in messages)
