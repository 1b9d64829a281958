"""Between OpenAI's shapes and the runtime's: request bodies to `GenerateRequest`s, events to
responses and stream chunks.

`decode_body` turns a body into a typed request or an `HttpError` naming the field;
`chat_request` / `completion_requests` map it onto `GenerateRequest`s (one per prompt; `choices`
makes `n` of each; refusing what has no equivalent: `suffix`); `ChatOutput` and
`CompletionOutput` take a request's events one at a time, returning the stream chunks each
becomes and keeping what the whole response needs, and how their chunks and errors go on
the wire (`OpenAIWire`; `net.http.anthropic` has the Anthropic routes' own). Synchronous and
pure but for the tokenizer's decoding of single tokens (logprobs), cached.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from net.http import openai_types as oa
from protocols.api import Event, Finished, GenerateRequest, SamplingParams, TokenDelta, TokenLogprob, ToolCall, ToolCallDelta, new_request_id
from protocols.config import LimitsConfig
from protocols.errors import ERROR_KINDS, ContextLengthError, ErrorCode, MlxrtError, error_code, reduce_error

T = TypeVar("T")


class HttpError(Exception):
    """A request refused by the HTTP layer itself (auth, routing, body, model name)."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param

    def __reduce__(self) -> tuple:
        return reduce_error(self)


class ContextLengthExceeded(HttpError):
    """A prompt with no room in the model's context, with its figures: each API words it its
    own way (OpenAI's code `context_length_exceeded`, Anthropic's "prompt is too long")."""

    def __init__(self, message: str, param: str | None, *, num_tokens: int, max_context: int):
        super().__init__("too_large", message, param)
        self.num_tokens = num_tokens
        self.max_context = max_context


def error_of(exc: BaseException, *, endpoint: str = "chat") -> HttpError:
    """The HTTP answer for a runtime error: its code, message and the OpenAI param at fault."""
    if isinstance(exc, HttpError):
        return exc
    field = getattr(exc, "field", None) if isinstance(exc, MlxrtError) else None
    message = str(exc) if isinstance(exc, MlxrtError) else "internal error; the server log has the details"
    if isinstance(exc, ContextLengthError):
        return ContextLengthExceeded(message, param_of(field, endpoint), num_tokens=exc.num_tokens, max_context=exc.max_context)
    return HttpError(error_code(exc), message, param_of(field, endpoint))


# Runtime field names as the Responses API's parameters (endpoint "responses").
RESPONSES_PARAMS = {"messages": "input", "prompt": "input", "prompt_ids": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def param_of(field: str | None, endpoint: str) -> str | None:
    """A runtime field name as the OpenAI (or Anthropic, endpoint "messages") parameter it came from."""
    if field is None:
        return None
    field = field.removeprefix("sampling.")
    if endpoint == "responses":
        return RESPONSES_PARAMS.get(field, field)
    if field in ("prompt", "prompt_ids"):
        return "messages" if endpoint in ("chat", "messages") else "prompt"
    if field == "stop" and endpoint == "messages":
        return "stop_sequences"
    return field


def openai_error(error: HttpError) -> tuple[oa.ErrorResponse, int]:
    """OpenAI's error JSON for an error, and its HTTP status (`ERROR_KINDS`)."""
    kind = ERROR_KINDS[error.code]
    if isinstance(error, ContextLengthExceeded):  # (OpenAI's words and code, which clients such as the Codex CLI act on)
        message = f"This model's maximum context length is {error.max_context} tokens. However, your input resulted in {error.num_tokens} tokens. Please reduce the length of the input."
        return oa.ErrorResponse(oa.ErrorBody(message=message, type=kind.openai_type, param=error.param, code="context_length_exceeded")), kind.http_status
    return oa.ErrorResponse(oa.ErrorBody(message=str(error), type=kind.openai_type, param=error.param, code=error.code)), kind.http_status


class Output(Protocol):
    """One request's events as a response: chunks while streaming (`on_event`, opened by
    `first_chunk`), the whole response once `Finished` came (`response`), and how both go on
    the wire: each chunk as server-sent event bytes, the stream's terminator, an error event
    mid-stream, and the error body (with its status) a refusal answers with."""

    stream: bool
    finished: Finished | None

    def first_chunk(self) -> Any | None: ...

    def on_event(self, event: Event) -> list[Any]: ...

    def response(self) -> Any: ...

    def sse(self, chunk: Any) -> bytes: ...

    def sse_end(self) -> bytes: ...

    def sse_error(self, error: HttpError) -> bytes: ...

    def error_body(self, error: HttpError) -> tuple[Any, int]: ...


class OpenAIWire:
    """OpenAI's wire: `data: <json>` events ended by `data: [DONE]`; an error mid-stream is a
    data event holding the error JSON."""

    def sse(self, chunk: Any) -> bytes:
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    def sse_end(self) -> bytes:
        return b"data: [DONE]\n\n"

    def sse_error(self, error: HttpError) -> bytes:
        return self.sse(self.error_body(error)[0])

    def error_body(self, error: HttpError) -> tuple[Any, int]:
        return openai_error(error)


_AT = re.compile(r"^(?P<text>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def decode_body(body: bytes, kind: type[T]) -> T:
    """A request body as `kind`; a 400 naming the field (e.g. `messages[0].role`) otherwise."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        assert match is not None  # the pattern matches any text
        path = (match["path"] or "").lstrip(".") or None
        raise HttpError("invalid_request", f"{match['text']}{f' (at {path})' if path else ''}", path) from None
    except msgspec.DecodeError as exc:
        raise HttpError("invalid_request", f"the body is not valid JSON: {exc}") from None


# -- requests ----------------------------------------------------------------------


def _common(body: oa.ChatCompletionRequest | oa.CompletionRequest) -> dict[str, Any]:
    """The GenerateRequest fields both endpoints share."""
    sampling = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        logit_bias=_logit_bias(body.logit_bias),
        **native_sampling(body),
    )
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


def native_sampling(body: oa.NativeExtras) -> dict[str, Any]:
    """`SamplingParams` fields among the extras that have defaults of their own there:
    `penalty_context_size` when given, vLLM's logits controls."""
    given = {"penalty_context_size": body.penalty_context_size} if body.penalty_context_size is not None else {}
    return {**given, "min_tokens": body.min_tokens, "allowed_token_ids": body.allowed_token_ids, "bad_words": body.bad_words}


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


# -- responses ---------------------------------------------------------------------


class TokenTexts:
    """The text of single tokens (for logprobs), decoded once each (at most the vocabulary)."""

    def __init__(self, tokenizer: Callable[[], Any]):
        # The tokenizer, asked for when first needed.
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer().decode([token_id])
        return text


def running_usage(prompt_tokens: int, completion_tokens: int) -> oa.UsageInfo:
    """A streamed chunk's usage so far (vLLM's `continuous_usage_stats`; cached tokens are known at the end)."""
    return oa.UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=oa.PromptTokensDetails(cached_tokens=0),
    )


def usage_of(finished: Finished) -> oa.UsageInfo:
    u = finished.usage
    return oa.UsageInfo(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details=oa.PromptTokensDetails(cached_tokens=u.cached_tokens),
    )


def ending_error(finished: Finished) -> HttpError | None:
    """The error a request that did not complete ends with (None for stop and length)."""
    if finished.finish_reason == "error":
        code = finished.error_code if finished.error_code in ERROR_KINDS else "internal"
        return HttpError(code, f"generation failed: {finished.error or 'see the server log'}")  # type: ignore[arg-type]
    if finished.finish_reason == "cancelled":
        return HttpError("shutting_down", finished.error or "the request was cancelled before it finished (the server is shutting down)")
    return None


@dataclass
class ResponseIds:
    """What every response and chunk of one request repeats."""

    id: str
    created: int
    model: str
    fingerprint: str


@dataclass
class ChatOutput(OpenAIWire):
    """One chat completion's events as chunks (`on_event`) and as a whole (`response`)."""

    ids: ResponseIds
    token_text: TokenTexts
    include_usage: bool = False
    return_token_ids: bool = False
    stream: bool = False
    # Its position among the response's choices (`n`).
    index: int = 0
    # With `stream_options.continuous_usage_stats`: the prompt's tokens (every chunk's usage so far).
    usage_prompt_tokens: int | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[oa.ToolCallOut] = field(default_factory=list)
    logprobs: list[oa.LogprobOut] | None = None
    token_ids: list[int] = field(default_factory=list)
    finished: Finished | None = None
    # The argument text streamed so far of each call being generated, by index.
    streamed_arguments: dict[int, str] = field(default_factory=dict)

    def on_event(self, event: Event) -> list[oa.ChatCompletionChunk]:
        match event:
            case TokenDelta():
                return self._on_delta(event)
            case ToolCallDelta():
                return self._on_call_delta(event) if self.stream else []
            case ToolCall():
                call = oa.ToolCallOut(id=event.id, function=oa.FunctionOut(name=event.name, arguments=event.arguments))
                self.calls.append(call)
                if not self.stream:
                    return []
                streamed = self.streamed_arguments.pop(event.index, None)
                if streamed is None:  # not streamed: the whole call in one chunk
                    return [self._chunk(oa.ChunkChoice(index=self.index, delta=oa.Delta(tool_calls=[msgspec.structs.replace(call, index=event.index)])))]
                rest = event.arguments[len(streamed) :] if event.arguments.startswith(streamed) else ""
                return [self._call_chunk(event.index, oa.FunctionDeltaOut(arguments=rest))] if rest else []
            case Finished():
                self.finished = event
                return self._on_finished(event) if self.stream else []
        return []

    def first_chunk(self) -> oa.ChatCompletionChunk:
        return self._chunk(oa.ChunkChoice(index=self.index, delta=oa.Delta(role="assistant", content="")))

    def _on_call_delta(self, event: ToolCallDelta) -> list[oa.ChatCompletionChunk]:
        """A call as it is generated: its id and name first, then its arguments in fragments."""
        if event.name is not None:
            self.streamed_arguments[event.index] = ""
            return [self._call_chunk(event.index, oa.FunctionDeltaOut(name=event.name, arguments=""), event.id)]
        self.streamed_arguments[event.index] = self.streamed_arguments.get(event.index, "") + event.arguments
        return [self._call_chunk(event.index, oa.FunctionDeltaOut(arguments=event.arguments))]

    def _call_chunk(self, index: int, function: oa.FunctionDeltaOut, call_id: str | None = None) -> oa.ChatCompletionChunk:
        part = oa.ToolCallDeltaOut(index=index, function=function, id=call_id, type="function" if call_id else None)
        return self._chunk(oa.ChunkChoice(index=self.index, delta=oa.Delta(tool_calls=[part])))

    def _on_delta(self, event: TokenDelta) -> list[oa.ChatCompletionChunk]:
        self.content.append(event.text)
        self.reasoning.append(event.reasoning)
        self.token_ids += event.token_ids
        logprobs = _chat_logprobs(event.logprobs, self.token_text) if event.logprobs is not None else None
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        if not self.stream or not (event.text or event.reasoning or (event.token_ids and (logprobs or self.return_token_ids))):
            return []
        delta = oa.Delta(content=event.text or None, reasoning_content=event.reasoning or None)
        choice = oa.ChunkChoice(index=self.index, delta=delta, logprobs=oa.ChoiceLogprobs(content=logprobs) if logprobs is not None else None)
        if self.return_token_ids:
            choice.token_ids = event.token_ids
        return [self._chunk(choice)]

    def _on_finished(self, finished: Finished) -> list[oa.ChatCompletionChunk]:
        if ending_error(finished) is not None:
            return []
        chunks = [self._chunk(oa.ChunkChoice(index=self.index, delta=oa.Delta(), finish_reason=self.finish_reason(finished)))]
        if self.include_usage:
            chunks.append(oa.ChatCompletionChunk(**self._ids(), choices=[], usage=usage_of(finished)))
        return chunks

    def finish_reason(self, finished: Finished) -> str:
        return "tool_calls" if self.calls and finished.finish_reason == "stop" else finished.finish_reason

    def response(self) -> oa.ChatCompletion:
        finished = self.finished
        assert finished is not None, "response() after the Finished event"
        text, reasoning = "".join(self.content), "".join(self.reasoning)
        message = oa.AssistantMessage(content=text if text or not self.calls else None)
        if reasoning:
            message.reasoning_content = reasoning
        if self.calls:
            message.tool_calls = self.calls
        choice = oa.ChatChoice(
            index=self.index,
            message=message,
            finish_reason=self.finish_reason(finished),
            logprobs=oa.ChoiceLogprobs(content=self.logprobs) if self.logprobs is not None else None,
        )
        if self.return_token_ids:
            choice.token_ids = self.token_ids
        return oa.ChatCompletion(**self._ids(), choices=[choice], usage=usage_of(finished))

    def _ids(self) -> dict[str, Any]:
        return {"id": self.ids.id, "created": self.ids.created, "model": self.ids.model, "system_fingerprint": self.ids.fingerprint}

    def _chunk(self, choice: oa.ChunkChoice) -> oa.ChatCompletionChunk:
        chunk = oa.ChatCompletionChunk(**self._ids(), choices=[choice])
        if self.include_usage:
            chunk.usage = None
        if self.usage_prompt_tokens is not None:
            chunk.usage = running_usage(self.usage_prompt_tokens, len(self.token_ids))
        return chunk


def _chat_logprobs(logprobs: list[TokenLogprob], text) -> list[oa.LogprobOut]:
    out = []
    for lp in logprobs:
        token = text(lp.token_id)
        top = [oa.TopLogprobOut(token=(t := text(alt.token_id)), logprob=alt.logprob, bytes=list(t.encode())) for alt in lp.top or []]
        out.append(oa.LogprobOut(token=token, logprob=lp.logprob, bytes=list(token.encode()), top_logprobs=top))
    return out


@dataclass
class CompletionOutput(OpenAIWire):
    """One text completion's events as chunks and as a whole. With `echo`, the prompt
    (`echo_text`, its tokens `echo_ids`) comes first, its tokens scored in the logprobs (the
    first null); with `discard` (`max_tokens: 0`) the generated token is left out."""

    ids: ResponseIds
    token_text: TokenTexts
    include_usage: bool = False
    return_token_ids: bool = False
    stream: bool = False
    want_logprobs: bool = False
    index: int = 0
    echo_text: str | None = None
    echo_ids: list[int] | None = None
    discard: bool = False
    # vLLM's `prompt_logprobs` in the choice.
    want_prompt_logprobs: bool = False
    # With `stream_options.continuous_usage_stats`: the prompt's tokens (every chunk's usage so far).
    usage_prompt_tokens: int | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: oa.CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, oa.PromptLogprobOut] | None] | None = None
    finished: Finished | None = None
    num_chars: int = 0
    started: bool = False

    def __post_init__(self) -> None:
        if self.want_logprobs:
            self.logprobs = oa.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

    def first_chunk(self) -> None:
        return None  # text completions have no role chunk

    def on_event(self, event: Event) -> list[oa.Completion]:
        match event:
            case TokenDelta():
                return self._on_delta(event)
            case Finished():
                self.finished = event = self._without_discarded(event)
                chunks = self._echo_chunk(None) if not self.started else []  # (an echo of a request that generated nothing)
                if not self.stream or ending_error(event) is not None:
                    return []
                chunks.append(self._chunk(oa.CompletionChoice(index=self.index, text="", finish_reason=event.finish_reason)))
                if self.include_usage:
                    chunks.append(oa.Completion(**self._ids(), choices=[], usage=usage_of(event)))
                return chunks
        return []

    def _without_discarded(self, finished: Finished) -> Finished:
        if not self.discard:
            return finished
        return msgspec.structs.replace(finished, finish_reason="length", usage=msgspec.structs.replace(finished.usage, completion_tokens=0))

    def _echo_chunk(self, scored: list[TokenLogprob] | None) -> list[oa.Completion]:
        """The prompt, when echoed: first in the text, its tokens scored in the logprobs."""
        self.started = True
        if scored is not None and self.want_prompt_logprobs:
            self.prompt_logprobs = [None, *(_prompt_logprob(lp, self.token_text) for lp in scored)]
        if self.echo_text is None:
            return []
        piece = None
        if self.want_logprobs:
            piece = _echo_logprobs(self.echo_ids or [], scored or [], self.token_text)
            self._add_logprobs(piece)
        self.text.append(self.echo_text)
        self.num_chars += len(self.echo_text)
        if not self.stream:
            return []
        return [self._chunk(oa.CompletionChoice(index=self.index, text=self.echo_text, finish_reason=None, logprobs=piece))]

    def _add_logprobs(self, piece: oa.CompletionLogprobs) -> None:
        assert self.logprobs is not None
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.logprobs, name).extend(getattr(piece, name))

    def _on_delta(self, event: TokenDelta) -> list[oa.Completion]:
        chunks = self._echo_chunk(event.prompt_logprobs) if not self.started else []
        if self.discard:
            return chunks
        # A raw completion keeps its text whole: a leading think block is text here too.
        text = event.reasoning + event.text
        self.text.append(text)
        self.token_ids += event.token_ids
        piece = None
        if self.want_logprobs and event.logprobs is not None:
            piece = _completion_logprobs(event.logprobs, self.token_text, self.num_chars)
            self._add_logprobs(piece)
        self.num_chars += len(text)
        if not self.stream or not (text or (event.token_ids and (piece or self.return_token_ids))):
            return chunks
        choice = oa.CompletionChoice(index=self.index, text=text, finish_reason=None, logprobs=piece)
        if self.return_token_ids:
            choice.token_ids = event.token_ids
        return [*chunks, self._chunk(choice)]

    def response(self) -> oa.Completion:
        return oa.Completion(**self._ids(), choices=[self.choice()], usage=usage_of(self.finished))  # type: ignore[arg-type]

    def choice(self) -> oa.CompletionChoice:
        finished = self.finished
        assert finished is not None, "response() after the Finished event"
        choice = oa.CompletionChoice(index=self.index, text="".join(self.text), finish_reason=finished.finish_reason, logprobs=self.logprobs)
        if self.return_token_ids:
            choice.token_ids = self.token_ids
        if self.want_prompt_logprobs:
            choice.prompt_logprobs = self.prompt_logprobs or [None]
        return choice

    def _ids(self) -> dict[str, Any]:
        return {"id": self.ids.id, "created": self.ids.created, "model": self.ids.model, "system_fingerprint": self.ids.fingerprint}

    def _chunk(self, choice: oa.CompletionChoice) -> oa.Completion:
        chunk = oa.Completion(**self._ids(), choices=[choice])
        if self.include_usage:
            chunk.usage = None
        if self.usage_prompt_tokens is not None:
            chunk.usage = running_usage(self.usage_prompt_tokens, len(self.token_ids))
        return chunk


def _echo_logprobs(prompt_ids: list[int], scored: list[TokenLogprob], text) -> oa.CompletionLogprobs:
    """An echoed prompt's tokens in the logprobs: the first unscored (null), the rest scored."""
    out = oa.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        token = text(token_id)
        lp = scored[i - 1] if 0 < i <= len(scored) else None
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob if lp is not None else None)
        assert out.top_logprobs is not None
        out.top_logprobs.append({text(alt.token_id): alt.logprob for alt in lp.top or []} if lp is not None else None)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def _prompt_logprob(lp: TokenLogprob, text) -> dict[str, oa.PromptLogprobOut]:
    """vLLM's entry for a scored prompt token: its own score and its alternatives', by token id."""
    entry = {
        str(alt.token_id): oa.PromptLogprobOut(logprob=alt.logprob, rank=rank, decoded_token=text(alt.token_id)) for rank, alt in enumerate(lp.top or [], 1)
    }
    entry[str(lp.token_id)] = oa.PromptLogprobOut(logprob=lp.logprob, rank=lp.rank, decoded_token=text(lp.token_id))
    return entry


def _completion_logprobs(logprobs: list[TokenLogprob], text, offset: int) -> oa.CompletionLogprobs:
    out = oa.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for lp in logprobs:
        token = text(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        assert out.top_logprobs is not None
        out.top_logprobs.append({text(alt.token_id): alt.logprob for alt in lp.top or []})
        out.text_offset.append(offset)
        offset += len(token)
    return out
