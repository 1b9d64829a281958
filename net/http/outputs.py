"""Runtime events as OpenAI's responses: `ChatOutput` and `CompletionOutput` take a request's
events one at a time, returning the stream chunks each becomes and keeping what the whole response
needs, and say how their chunks and errors go on the wire (`OpenAIWire`; `net.http.anthropic` and
`net.http.responses_api` have their own). `Output` is what every route's output object offers the
app. Synchronous and pure but for the tokenizer's decoding of single tokens (logprobs), cached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from net.http import openai_types as oa
from net.http.errors import HttpError, openai_error
from protocols.api import Event, Finished, TokenDelta, TokenLogprob, ToolCall, ToolCallDelta
from protocols.errors import ERROR_KINDS


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
