"""Between OpenAI's shapes and the runtime's: request bodies to `GenerateRequest`s, events to
responses and stream chunks.

`decode_body` turns a body into a typed request or an `HttpError` naming the field;
`chat_request` / `completion_request` map it onto a `GenerateRequest` (refusing what has
no equivalent: `n > 1`, `logit_bias`, `echo`, several prompts); `ChatOutput` and
`CompletionOutput` take a request's events one at a time, returning the stream chunks each
becomes and keeping what the whole response needs. Synchronous and pure but for the
tokenizer's decoding of single tokens (logprobs), cached.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from net.http import openai_types as oa
from protocols.api import Event, Finished, GenerateRequest, SamplingParams, TokenDelta, TokenLogprob, ToolCall, new_request_id
from protocols.errors import ERROR_KINDS, ErrorCode, MlxrtError, error_code

T = TypeVar("T")


class HttpError(Exception):
    """A request refused by the HTTP layer itself (auth, routing, body, model name)."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param


def error_of(exc: BaseException, *, endpoint: str = "chat") -> HttpError:
    """The HTTP answer for a runtime error: its code, message and the OpenAI param at fault."""
    if isinstance(exc, HttpError):
        return exc
    field = getattr(exc, "field", None) if isinstance(exc, MlxrtError) else None
    message = str(exc) if isinstance(exc, MlxrtError) else "internal error; the server log has the details"
    return HttpError(error_code(exc), message, param_of(field, endpoint))


def param_of(field: str | None, endpoint: str) -> str | None:
    """A runtime field name as the OpenAI parameter it came from."""
    if field is None:
        return None
    field = field.removeprefix("sampling.")
    if field in ("prompt", "prompt_ids"):
        return "messages" if endpoint == "chat" else "prompt"
    return field


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
    if body.n != 1:
        raise HttpError("invalid_request", "n > 1 is not supported: send n separate requests", "n")
    if body.logit_bias:
        raise HttpError("invalid_request", "logit_bias is not supported", "logit_bias")
    sampling = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        **({"penalty_context_size": body.penalty_context_size} if body.penalty_context_size is not None else {}),
    )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return {
        "sampling": sampling,
        "stop": stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "request_id": body.request_id or new_request_id(),
        "priority": body.priority,
        "response_format": body.response_format,
        "jump_forward": body.jump_forward,
        "snapshot_at": body.snapshot_at,
        "checkpoint_every": body.checkpoint_every,
        "fill": body.fill,
        "speculative": body.speculative,
        "acceptance": body.acceptance,
    }


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
        **_common(body),
    )


def chat_messages(messages: list[oa.ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the chat template takes them."""
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: oa.ChatMessage, index: int) -> dict[str, Any]:
    """One message as chat templates expect it: text content, tool-call arguments as objects."""
    where = f"messages[{index}]"
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise HttpError("invalid_request", f"only text content parts are supported, got {part.type!r}", f"{where}.content[{j}].type")
            texts.append(part.text)
        content = "".join(texts)
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


def completion_request(body: oa.CompletionRequest) -> GenerateRequest:
    if body.echo:
        raise HttpError("invalid_request", "echo is not supported", "echo")
    if body.suffix:
        raise HttpError("invalid_request", "suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != 1:
        raise HttpError("invalid_request", "best_of > 1 is not supported", "best_of")
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise HttpError("invalid_request", "several prompts in one request are not supported: send them separately", "prompt")
        prompt = prompt[0]
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    if ids is not None and not (ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise HttpError("invalid_request", "prompt must be text, token ids, or a list of one of either", "prompt")
    return GenerateRequest(
        prompt=text,
        prompt_ids=ids,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        **_common(body),
    )


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
class ChatOutput:
    """One chat completion's events as chunks (`on_event`) and as a whole (`response`)."""

    ids: ResponseIds
    token_text: TokenTexts
    include_usage: bool = False
    return_token_ids: bool = False
    stream: bool = False
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[oa.ToolCallOut] = field(default_factory=list)
    logprobs: list[oa.LogprobOut] | None = None
    token_ids: list[int] = field(default_factory=list)
    finished: Finished | None = None

    def on_event(self, event: Event) -> list[oa.ChatCompletionChunk]:
        match event:
            case TokenDelta():
                return self._on_delta(event)
            case ToolCall():
                call = oa.ToolCallOut(id=event.id, function=oa.FunctionOut(name=event.name, arguments=event.arguments))
                self.calls.append(call)
                delta = oa.Delta(tool_calls=[msgspec.structs.replace(call, index=event.index)])
                return [self._chunk(oa.ChunkChoice(index=0, delta=delta))] if self.stream else []
            case Finished():
                self.finished = event
                return self._on_finished(event) if self.stream else []
        return []

    def first_chunk(self) -> oa.ChatCompletionChunk:
        return self._chunk(oa.ChunkChoice(index=0, delta=oa.Delta(role="assistant", content="")))

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
        choice = oa.ChunkChoice(index=0, delta=delta, logprobs=oa.ChoiceLogprobs(content=logprobs) if logprobs is not None else None)
        if self.return_token_ids:
            choice.token_ids = event.token_ids
        return [self._chunk(choice)]

    def _on_finished(self, finished: Finished) -> list[oa.ChatCompletionChunk]:
        if ending_error(finished) is not None:
            return []
        chunks = [self._chunk(oa.ChunkChoice(index=0, delta=oa.Delta(), finish_reason=self.finish_reason(finished)))]
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
            index=0,
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
        return chunk


def _chat_logprobs(logprobs: list[TokenLogprob], text) -> list[oa.LogprobOut]:
    out = []
    for lp in logprobs:
        token = text(lp.token_id)
        top = [oa.TopLogprobOut(token=(t := text(alt.token_id)), logprob=alt.logprob, bytes=list(t.encode())) for alt in lp.top or []]
        out.append(oa.LogprobOut(token=token, logprob=lp.logprob, bytes=list(token.encode()), top_logprobs=top))
    return out


@dataclass
class CompletionOutput:
    """One text completion's events as chunks and as a whole."""

    ids: ResponseIds
    token_text: TokenTexts
    include_usage: bool = False
    return_token_ids: bool = False
    stream: bool = False
    want_logprobs: bool = False
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: oa.CompletionLogprobs | None = None
    finished: Finished | None = None
    num_chars: int = 0

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
                self.finished = event
                if not self.stream or ending_error(event) is not None:
                    return []
                chunks = [self._chunk(oa.CompletionChoice(index=0, text="", finish_reason=event.finish_reason))]
                if self.include_usage:
                    chunks.append(oa.Completion(**self._ids(), choices=[], usage=usage_of(event)))
                return chunks
        return []

    def _on_delta(self, event: TokenDelta) -> list[oa.Completion]:
        # A raw completion keeps its text whole: a leading think block is text here too.
        text = event.reasoning + event.text
        self.text.append(text)
        self.token_ids += event.token_ids
        piece = None
        if self.want_logprobs and event.logprobs is not None:
            piece = _completion_logprobs(event.logprobs, self.token_text, self.num_chars)
            assert self.logprobs is not None
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(self.logprobs, name).extend(getattr(piece, name))
        self.num_chars += len(text)
        if not self.stream or not (text or (event.token_ids and (piece or self.return_token_ids))):
            return []
        choice = oa.CompletionChoice(index=0, text=text, finish_reason=None, logprobs=piece)
        if self.return_token_ids:
            choice.token_ids = event.token_ids
        return [self._chunk(choice)]

    def response(self) -> oa.Completion:
        finished = self.finished
        assert finished is not None, "response() after the Finished event"
        choice = oa.CompletionChoice(index=0, text="".join(self.text), finish_reason=finished.finish_reason, logprobs=self.logprobs)
        if self.return_token_ids:
            choice.token_ids = self.token_ids
        return oa.Completion(**self._ids(), choices=[choice], usage=usage_of(finished))

    def _ids(self) -> dict[str, Any]:
        return {"id": self.ids.id, "created": self.ids.created, "model": self.ids.model, "system_fingerprint": self.ids.fingerprint}

    def _chunk(self, choice: oa.CompletionChoice) -> oa.Completion:
        chunk = oa.Completion(**self._ids(), choices=[choice])
        if self.include_usage:
            chunk.usage = None
        return chunk


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
