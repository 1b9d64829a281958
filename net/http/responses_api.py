"""Between OpenAI's Responses API and the runtime: a request body to a `GenerateRequest`, events
to a response object and to its stream events.

A conversation maps onto the chat messages the chat route would send for it (`mapping.chat_messages`
renders both), so both routes render the same prompt: `instructions` is a leading system message;
a text `input` is one user message; message items keep their role (`developer` is a system
message) and their text parts joined; `function_call` items are the assistant's tool calls (joined
to the assistant message just before them), `function_call_output` items `tool` messages;
`reasoning` items are dropped. Tools are flat function tools, given to the template as chat's
nested ones; `tool_choice` and `text.format` become chat's `tool_choice` and `response_format`.
With `previous_response_id`, the stored conversation of that response (`response_store`) comes
between the instructions and the new input: the caller's own response only, in a chain of at most
`limits.max_response_chain` responses and `limits.max_response_history_bytes` of conversation.

`ResponsesOutput` takes the events one at a time: reasoning, text and tool calls become
`reasoning`, `message` and `function_call` output items in the order they come, streamed as
`response.*` events numbered by `sequence_number`, between `response.created` +
`response.in_progress` and `response.completed` (or `response.incomplete`). Synchronous and pure
but for the store the finished response goes into.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from net.http import openai_types as oa
from net.http import responses_api_types as ra
from net.http.errors import HttpError, openai_error
from net.http.mapping import chat_messages, sampling_params
from net.http.outputs import ending_error
from net.http.response_store import ResponseStore
from protocols.api import Event, Finished, GenerateRequest, TokenDelta, ToolCall, ToolCallDelta, new_request_id
from protocols.config import LimitsConfig

T = TypeVar("T")

# OpenAI's documented bounds on `metadata` (kept with a stored response and echoed in it).
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# `user` has no documented length (its successor `safety_identifier` has 128); it is echoed and
# stored, so it is bounded too.
MAX_USER_CHARS = 256

_AT = re.compile(r"^(?P<text>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def _convert(value: Any, kind: type[T], where: str) -> T:
    """A JSON value (one input item or part) as `kind`; a 400 naming the field under `where`."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        assert match is not None  # the pattern matches any text
        path = f"{where}{match['path'] or ''}"
        raise HttpError("invalid_request", f"{match['text']} (at {path})", path) from None


# -- requests ----------------------------------------------------------------------


@dataclass
class Turn:
    """A request as the runtime runs it, and the conversation it continues (what a stored
    response keeps, with its own output added)."""

    generate: GenerateRequest
    # The previous turns and this turn's input, as chat messages (the instructions excluded).
    history: list[dict[str, Any]]
    # Responses in its chain, its own included (what its stored entry records).
    depth: int = 1


def responses_request(body: ra.ResponsesRequest, store: ResponseStore, *, owner: str = "", limits: LimitsConfig = LimitsConfig()) -> Turn:
    """The request the body makes, continuing `owner`'s stored response it names, if any."""
    if body.background:
        raise HttpError("invalid_request", "background responses are not supported: leave `background` false", "background")
    check_metadata(body.metadata)
    if body.user is not None and len(body.user) > MAX_USER_CHARS:
        raise HttpError("invalid_request", f"`user` has {len(body.user)} characters, at most {MAX_USER_CHARS}", "user")
    history, depth = previous_turns(body.previous_response_id, store, owner, limits)
    history += input_messages(body.input)
    system = chat_messages([oa.ChatMessage(role="system", content=body.instructions)]) if body.instructions else []
    sampling = sampling_params(body)
    generate = GenerateRequest(
        messages=system + history,
        max_tokens=body.max_output_tokens,
        sampling=sampling,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        response_format=response_format(body.text),
        stream_tool_calls=body.stream,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        request_id=body.request_id or new_request_id(),
        priority=body.priority,
        jump_forward=body.jump_forward,
        snapshot_at=body.snapshot_at,
        checkpoint_every=body.checkpoint_every,
        fill=body.fill,
        speculative=body.speculative,
        acceptance=body.acceptance,
    )
    return Turn(generate, history, depth)


def check_metadata(metadata: dict[str, str] | None, param: str = "metadata") -> None:
    """OpenAI's bounds on `metadata`: at most 16 pairs, keys of at most 64 characters, values of at
    most 512; a 400 naming `param` otherwise."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise HttpError("invalid_request", f"`{param}` has {len(metadata)} pairs, at most {MAX_METADATA_PAIRS}", param)
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise HttpError("invalid_request", f"a `{param}` key of {len(key)} characters ({key[:16]!r}...), at most {MAX_METADATA_KEY_CHARS}", param)
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise HttpError("invalid_request", f"`{param}` value of {key!r} has {len(value)} characters, at most {MAX_METADATA_VALUE_CHARS}", param)


def previous_turns(response_id: str | None, store: ResponseStore, owner: str, limits: LimitsConfig) -> tuple[list[dict[str, Any]], int]:
    """The conversation `response_id` ended, and the depth of a response continuing it; a chain
    too long or a conversation too large is refused by its entry's figures, before it is decoded."""
    if response_id is None:
        return [], 1
    param = "previous_response_id"
    previous = store.get(response_id, param, owner=owner)
    if previous.depth >= limits.max_response_chain:
        limit = limits.max_response_chain
        raise HttpError(
            "too_large", f"{response_id!r} ends a chain of {previous.depth} responses, at most {limit} (limits.max_response_chain): start anew", param
        )
    if len(previous.history) > limits.max_response_history_bytes:
        size, limit = len(previous.history), limits.max_response_history_bytes
        raise HttpError("too_large", f"the conversation of {response_id!r} holds {size} bytes, more than {limit} (limits.max_response_history_bytes)", param)
    return previous.messages(), previous.depth + 1


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The input as the chat messages the chat route would take for it."""
    if isinstance(items, str):
        return chat_messages([oa.ChatMessage(role="user", content=items)])
    chat: list[oa.ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise HttpError("invalid_request", "an input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            message = _convert(item, ra.MessageItem, where)
            chat.append(oa.ChatMessage(role=message.role, content=_text(message.content, f"{where}.content")))
        elif kind == "function_call":
            call = _convert(item, ra.FunctionCallItem, where)
            tool_call = oa.ToolCallIn(function=oa.FunctionCallIn(name=call.name, arguments=_arguments(call.arguments, f"{where}.arguments")), id=call.call_id)
            last = chat[-1] if chat else None
            if last is not None and last.role == "assistant":  # the calls of the message just before
                last.tool_calls = [*(last.tool_calls or []), tool_call]
            else:
                chat.append(oa.ChatMessage(role="assistant", tool_calls=[tool_call]))
        elif kind == "function_call_output":
            result = _convert(item, ra.FunctionCallOutputItem, where)
            chat.append(oa.ChatMessage(role="tool", tool_call_id=result.call_id, content=_text(result.output, f"{where}.output")))
        elif kind == "reasoning":
            pass  # the model's earlier reasoning: not part of the prompt (as chat templates drop it)
        else:
            supported = "message, function_call, function_call_output, reasoning"
            raise HttpError("invalid_request", f"input items of type {kind!r} are not supported ({supported})", f"{where}.type")
    return chat_messages(chat)


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """A content's text: its text parts (input_text, output_text, refusal) joined."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        place = f"{where}[{j}]"
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            texts.append(_convert(part, ra.TextPart, place).text)
        elif kind == "refusal":
            texts.append(_convert(part, ra.RefusalPart, place).refusal)
        elif kind in ("input_image", "input_file", "input_audio"):
            raise HttpError("invalid_request", f"{kind} content is not supported (this server serves text models)", place)
        else:
            raise HttpError("invalid_request", f"content parts of type {kind!r} are not supported (input_text, output_text)", f"{place}.type")
    return "".join(texts)


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        raise HttpError("invalid_request", "function call arguments must be a JSON object", where) from None
    if not isinstance(value, dict):
        raise HttpError("invalid_request", "function call arguments must be a JSON object", where)
    return value


def chat_tools(tools: list[ra.Tool] | None) -> list[dict[str, Any]] | None:
    """Flat function tools as chat's nested ones (what chat templates take): a namespace's
    functions among them, hosted web search left out (it is not offered to the model)."""
    if tools is None:
        return None
    functions = [t for tool in tools for t in (tool.tools if isinstance(tool, ra.NamespaceTool) else [tool]) if isinstance(t, ra.FunctionTool)]
    if tools and not functions:
        return None  # (only hosted tools: the template is given none)
    out = []
    for tool in functions:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.parameters is not None:
            function["parameters"] = tool.parameters
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: ra.ToolChoice) -> str | dict[str, Any]:
    if isinstance(choice, ra.ToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def response_format(text: ra.TextConfig | None) -> dict[str, Any] | None:
    match text.format if text is not None else None:
        case ra.FormatJsonObject():
            return {"type": "json_object"}
        case ra.FormatJsonSchema() as fmt:
            schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema}
            if fmt.strict is not None:
                schema["strict"] = fmt.strict
            return {"type": "json_schema", "json_schema": schema}
    return None


def output_messages(output: list[ra.OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the assistant message a chat client would send back: its text,
    its calls (reasoning dropped, as for reasoning input items)."""
    texts = [part.text for item in output if isinstance(item, ra.MessageOut) for part in item.content]
    calls = [
        oa.ToolCallIn(function=oa.FunctionCallIn(name=item.name, arguments=_object(item.arguments)), id=item.call_id)
        for item in output
        if isinstance(item, ra.FunctionCallOut)
    ]
    return chat_messages([oa.ChatMessage(role="assistant", content="".join(texts) if texts or not calls else None, tool_calls=calls or None)])


def _object(text: str) -> dict[str, Any]:
    """A call's arguments as an object; {} for a call the output ended inside."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# -- responses ---------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """An id no client can guess (a stored response's is all it takes to read it): 128 bits from
    the OS's CSPRNG (uuid4 fixes 6 of its 128)."""
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass
class _Item:
    """One output item as it is generated."""

    kind: str  # "reasoning", "message" or "function_call"
    index: int
    id: str
    parts: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    status: ra.ItemStatus = "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def out(self, *, empty: bool = False) -> ra.OutputItem:
        """The item (`empty`: as `response.output_item.added` opens it)."""
        text = "" if empty else self.text
        if self.kind == "function_call":
            return ra.FunctionCallOut(id=self.id, call_id=self.call_id, name=self.name, arguments=text, status=self.status)
        if self.kind == "reasoning":
            return ra.ReasoningOut(id=self.id, summary=[], content=[] if empty else [ra.ReasoningText(text=text)], status=self.status)
        return ra.MessageOut(id=self.id, status=self.status, content=[] if empty else [ra.OutputText(text=text)])

    def part(self, *, empty: bool = False) -> ra.OutputText | ra.ReasoningText:
        text = "" if empty else self.text
        return ra.ReasoningText(text=text) if self.kind == "reasoning" else ra.OutputText(text=text)


@dataclass
class ResponsesOutput:
    """One response's events as stream events (`on_event`) and as a whole (`response`). A
    response that completes (or is cut by max_output_tokens) goes into `store` with `history`,
    the conversation it continued, when given."""

    body: ra.ResponsesRequest
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    stream: bool = False
    store: ResponseStore | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    # Whose it is in the store (`middleware.request_owner`), and its depth in its chain.
    owner: str = ""
    depth: int = 1
    items: list[_Item] = field(default_factory=list)
    # The reasoning or message item text goes to (a call's item is never open: its events are its own).
    open: _Item | None = None
    # Calls being generated, by their index.
    calls: dict[int, _Item] = field(default_factory=dict)
    reasoning_tokens: int = 0
    finished: Finished | None = None
    final: ra.Response | None = None
    sequence: int = 0

    def first_chunk(self) -> list[ra.StreamEvent]:
        return [
            ra.ResponseCreated(sequence_number=self._next(), response=self._snapshot()),
            ra.ResponseInProgress(sequence_number=self._next(), response=self._snapshot()),
        ]

    def on_event(self, event: Event) -> list[ra.StreamEvent]:
        events: list[ra.StreamEvent] = []
        match event:
            case TokenDelta():
                if event.reasoning:
                    self.reasoning_tokens += 0 if event.text else len(event.token_ids)
                    events += self._add("reasoning", event.reasoning)
                if event.text:
                    events += self._add("message", event.text)
            case ToolCallDelta():
                events += self._on_call_delta(event)
            case ToolCall():
                events += self._on_call(event)
            case Finished():
                self.finished = event
                if ending_error(event) is not None:
                    return []
                events += self._close("incomplete" if event.finish_reason == "length" else "completed")
                for index in list(self.calls):  # (calls end with their ToolCall; none should be left)
                    item = self.calls.pop(index)
                    item.status = "incomplete"
                    events += self._call_done(item)
                self.final = self._response(event)
                if self.store is not None:
                    history = self.history + output_messages(self.final.output)
                    self.store.put(self.final.id, msgspec.json.encode(self.final), history, owner=self.owner, depth=self.depth)
                if self.final.status == "incomplete":
                    events.append(ra.ResponseIncomplete(sequence_number=self._next(), response=self.final))
                else:
                    events.append(ra.ResponseCompleted(sequence_number=self._next(), response=self.final))
        return events if self.stream else []

    def _add(self, kind: str, text: str) -> list[ra.StreamEvent]:
        events: list[ra.StreamEvent] = []
        item = self.open
        if item is None or item.kind != kind:
            events += self._close("completed")
            item = self.open = self._new(kind)
            events.append(ra.OutputItemAdded(sequence_number=self._next(), output_index=item.index, item=item.out(empty=True)))
            events.append(
                ra.ContentPartAdded(sequence_number=self._next(), item_id=item.id, output_index=item.index, content_index=0, part=item.part(empty=True))
            )
        item.parts.append(text)
        delta = ra.ReasoningTextDelta if kind == "reasoning" else ra.OutputTextDelta
        events.append(delta(sequence_number=self._next(), item_id=item.id, output_index=item.index, content_index=0, delta=text))
        return events

    def _close(self, status: ra.ItemStatus) -> list[ra.StreamEvent]:
        item = self.open
        if item is None:
            return []
        self.open = None
        item.status = status
        done = ra.ReasoningTextDone if item.kind == "reasoning" else ra.OutputTextDone
        return [
            done(sequence_number=self._next(), item_id=item.id, output_index=item.index, content_index=0, text=item.text),
            ra.ContentPartDone(sequence_number=self._next(), item_id=item.id, output_index=item.index, content_index=0, part=item.part()),
            ra.OutputItemDone(sequence_number=self._next(), output_index=item.index, item=item.out()),
        ]

    def _on_call_delta(self, event: ToolCallDelta) -> list[ra.StreamEvent]:
        """A call as it is generated: its item opens with its name, then its arguments stream."""
        if event.name is not None:
            events = self._close("completed")
            item = self.calls[event.index] = self._new("function_call", call_id=event.id, name=event.name)
            return [*events, ra.OutputItemAdded(sequence_number=self._next(), output_index=item.index, item=item.out(empty=True))]
        call = self.calls.get(event.index)
        if call is None or not event.arguments:
            return []
        call.parts.append(event.arguments)
        return [ra.FunctionCallArgumentsDelta(sequence_number=self._next(), item_id=call.id, output_index=call.index, delta=event.arguments)]

    def _on_call(self, event: ToolCall) -> list[ra.StreamEvent]:
        """A call complete: the rest of its arguments (all of them if it did not stream), then done."""
        events: list[ra.StreamEvent] = []
        streaming = self.calls.pop(event.index, None)
        if streaming is not None:
            item = streaming
        else:
            events += self._close("completed")
            item = self._new("function_call", call_id=event.id, name=event.name)
            events.append(ra.OutputItemAdded(sequence_number=self._next(), output_index=item.index, item=item.out(empty=True)))
        streamed = item.text
        rest = event.arguments[len(streamed) :] if event.arguments.startswith(streamed) else ""
        if rest:
            events.append(ra.FunctionCallArgumentsDelta(sequence_number=self._next(), item_id=item.id, output_index=item.index, delta=rest))
        item.parts = [event.arguments]
        item.status = "incomplete" if event.truncated else "completed"
        return events + self._call_done(item)

    def _call_done(self, item: _Item) -> list[ra.StreamEvent]:
        return [
            ra.FunctionCallArgumentsDone(sequence_number=self._next(), item_id=item.id, output_index=item.index, name=item.name, arguments=item.text),
            ra.OutputItemDone(sequence_number=self._next(), output_index=item.index, item=item.out()),
        ]

    def _new(self, kind: str, **fields: Any) -> _Item:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, len(self.items), new_id(prefix), **fields)
        self.items.append(item)
        return item

    def _next(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def _snapshot(self, status: str = "in_progress", **fields: Any) -> ra.Response:
        """The response object, as far as it is known (`output` as the items stand)."""
        body = self.body
        return ra.Response(
            id=self.id,
            created_at=self.created_at,
            status=status,  # type: ignore[arg-type]
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=body.model,
            output=[item.out() for item in self.items],
            parallel_tool_calls=body.parallel_tool_calls,
            previous_response_id=body.previous_response_id,
            store=body.store,
            temperature=body.temperature,
            text=body.text or ra.TextConfig(),
            tool_choice=body.tool_choice,
            tools=body.tools or [],
            top_p=body.top_p,
            user=body.user,
            metadata=body.metadata or {},
            **fields,
        )

    def _response(self, finished: Finished) -> ra.Response:
        u = finished.usage
        usage = ra.ResponseUsage(
            input_tokens=u.prompt_tokens,
            input_tokens_details=ra.InputTokensDetails(cached_tokens=u.cached_tokens),
            output_tokens=u.completion_tokens,
            output_tokens_details=ra.OutputTokensDetails(reasoning_tokens=self.reasoning_tokens),
            total_tokens=u.prompt_tokens + u.completion_tokens,
        )
        if finished.finish_reason == "length":
            return self._snapshot("incomplete", incomplete_details=ra.IncompleteDetails(reason="max_output_tokens"), usage=usage)
        return self._snapshot("completed", completed_at=int(time.time()), usage=usage)

    def response(self) -> ra.Response:
        assert self.final is not None, "response() after the Finished event"
        return self.final

    # -- the wire: `event: <type>` + `data: <json>`, no terminator -----------------------

    def sse(self, chunk: ra.StreamEvent | list[ra.StreamEvent]) -> bytes:
        if isinstance(chunk, list):  # (the opening pair)
            return b"".join(self.sse(event) for event in chunk)
        kind = str(type(chunk).__struct_config__.tag)
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(chunk) + b"\n\n"

    def sse_end(self) -> bytes:
        return b""  # response.completed (or .incomplete) ended it

    def sse_error(self, error: HttpError) -> bytes:
        """The error event, then `response.failed` with the response as it stood."""
        body = openai_error(error)[0].error  # (OpenAI's words and code: `context_length_exceeded` for a prompt too long)
        event = ra.ErrorEvent(sequence_number=self._next(), code=body.code, message=body.message, param=error.param)
        failed = self._snapshot("failed", error=ra.ResponseError(code=body.code or error.code, message=body.message))
        return self.sse(event) + self.sse(ra.ResponseFailed(sequence_number=self._next(), response=failed))

    def error_body(self, error: HttpError) -> tuple[Any, int]:
        return openai_error(error)
