"""Between Anthropic's Messages API and the runtime: request bodies to `GenerateRequest`s, events
to a message and to its stream events, errors to Anthropic's error body.

A conversation maps onto the chat messages the OpenAI route would send for the same
conversation (`mapping.chat_messages` renders both), so both routes render the same prompt:
`system` is a leading system message, text blocks are joined, a `tool_use` block is an assistant
tool call (its input the arguments object), a `tool_result` block a `tool` message (its images,
a screenshot a tool took, a user turn right after it: chat templates place images in user
turns), a `thinking` block the assistant's `reasoning_content`; `image` blocks are image parts
(vision-language models); tools are OpenAI function tools and `tool_choice` any / tool / none is
"required" / that function / "none". Documents, server tools and a final assistant message to
continue (prefill) are refused, naming the field.

`MessagesOutput` takes the events one at a time: reasoning, text and tool calls become
thinking, text and tool_use blocks, in the order they come, streamed as `content_block_*`
events between `message_start` and `message_delta` + `message_stop`. Synchronous and pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from net.http import anthropic_types as at
from net.http import openai_types as oa
from net.http.errors import ContextLengthExceeded, HttpError, decode_body
from net.http.mapping import chat_messages, check_messages, sampling_params
from net.http.outputs import ending_error
from protocols.api import Event, Finished, GenerateRequest, TokenDelta, ToolCall, ToolCallDelta, new_request_id
from protocols.config import LimitsConfig
from protocols.errors import ERROR_KINDS

# Anthropic's error types by HTTP status (others: invalid_request_error below 500, api_error above).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
# Anthropic's "overloaded" status: a full queue or request limit (code `busy`) answers with it.
OVERLOADED = 529


def anthropic_error(error: HttpError) -> tuple[at.ErrorResponse, int]:
    """Anthropic's error body for an error, and its HTTP status: the code's (`ERROR_KINDS`),
    529 for a server too busy to take it. The message names the field at fault."""
    status = OVERLOADED if error.code == "busy" else ERROR_KINDS[error.code].http_status
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    message = str(error)
    if isinstance(error, ContextLengthExceeded):  # (Anthropic's words, which Claude Code reads the figures from)
        message = f"prompt is too long: {error.num_tokens} tokens > {error.max_context} maximum"
    elif error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return at.ErrorResponse(error=at.ErrorDetail(type=kind, message=message)), status


# -- requests ----------------------------------------------------------------------


def messages_request(body: at.MessagesRequest) -> GenerateRequest:
    messages, tools, tool_choice = _prompt(body)
    return GenerateRequest(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=body.max_tokens,
        sampling=sampling_params(body),
        stop=list(body.stop_sequences or []),
        request_id=new_request_id(),
        stream_tool_calls=body.stream,
        denoising=body.denoising,
    )


def count_request(body: at.CountTokensRequest) -> GenerateRequest:
    """What `messages_request` renders the prompt from (for counting its tokens)."""
    messages, tools, tool_choice = _prompt(body)
    return GenerateRequest(messages=messages, tools=tools, tool_choice=tool_choice)


def map_body(tokenizer: Any, raw: bytes, kind: type[at.CountTokensRequest], limits: LimitsConfig) -> tuple[str, bool, GenerateRequest]:
    """A Messages (or count_tokens) body decoded, its sizes checked and mapped: the model it
    names, whether it streams, and the request. A tokenizer job (`runtime.offload`): a big
    conversation (thousands of blocks: tens of ms of Python) is mapped in the worker process, off
    the GIL the MLX thread needs; `tokenizer` is unused."""
    body = decode_body(raw, kind)
    check_sizes(body, limits)
    if isinstance(body, at.MessagesRequest):
        return body.model, body.stream, messages_request(body)
    return body.model, False, count_request(body)


def check_sizes(body: at.CountTokensRequest, limits: LimitsConfig) -> None:
    """Messages and content blocks (a tool result's own blocks and the system's included) within
    `limits.max_messages` / `limits.max_content_parts`: checked before anything is mapped or rendered."""
    parts = len(body.system) if isinstance(body.system, list) else 0
    for message in body.messages:
        if isinstance(message.content, list):
            parts += len(message.content)
            parts += sum(len(b.content) for b in message.content if isinstance(b, at.ToolResultBlock) and isinstance(b.content, list))
    check_messages(len(body.messages), parts, limits)


def _prompt(body: at.CountTokensRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """The chat messages, tools and tool choice the OpenAI route would take for this conversation."""
    last = body.messages[-1]
    if last.role == "assistant":
        where = f"messages[{len(body.messages) - 1}].role"
        raise HttpError("invalid_request", "continuing a final assistant message (prefill) is not supported; end with a user message", where)
    if body.messages[0].role == "system":  # (a system message comes later in a conversation: the opening one is `system`)
        raise HttpError("invalid_request", "the first message is the user's; give instructions before it in `system`", "messages[0].role")
    chat: list[oa.ChatMessage] = []
    system = body.system if isinstance(body.system, str) else "".join(block.text for block in body.system or [])
    if system:
        chat.append(oa.ChatMessage(role="system", content=system))
    for i, message in enumerate(body.messages):
        chat += _chat(message, f"messages[{i}]")
    return chat_messages(chat), _tools(body.tools), _tool_choice(body.tool_choice)


def _chat(message: at.MessageParam, where: str) -> list[oa.ChatMessage]:
    if isinstance(message.content, str):
        return [oa.ChatMessage(role=message.role, content=message.content)]
    if message.role == "assistant":
        return [_assistant(message.content, where)]
    if message.role == "system":
        return [_system(message.content, where)]
    return _user(message.content, where)


def _system(blocks: list[at.ContentBlock], where: str) -> oa.ChatMessage:
    """A system message in the conversation: its text blocks joined."""
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, at.TextBlock):
            raise _refused(block, f"{where}.content[{j}]", "system")
        texts.append(block.text)
    return oa.ChatMessage(role="system", content="".join(texts))


def _user(blocks: list[at.ContentBlock], where: str) -> list[oa.ChatMessage]:
    """A user turn: its text as user messages, each tool result as a `tool` message, in order."""
    out: list[oa.ChatMessage] = []
    pending: list[str | oa.ContentPart] = []  # (text as str: joined at once where no image is among it)
    for j, block in enumerate(blocks):
        place = f"{where}.content[{j}]"
        match block:
            case at.TextBlock(text=text):
                pending.append(text)
            case at.ImageBlock(source=source):
                pending.append(oa.ContentPart(type="image_url", image_url=oa.ImageUrl(url=_image_url(source, place))))
            case at.ToolResultBlock():
                if pending:
                    out.append(_user_message(pending))
                    pending = []
                content, images = _tool_result(block.content, place)
                out.append(oa.ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=content))
                if images:  # (chat templates render images in user turns: the result's follow it)
                    out.append(oa.ChatMessage(role="user", content=images))
            case _:
                raise _refused(block, place, "user")
    if pending or not out:
        out.append(_user_message(pending))
    return out


def _user_message(pending: list[str | oa.ContentPart]) -> oa.ChatMessage:
    """A user message of text and images; text alone joined (as `chat_messages` would join it)."""
    texts = [part for part in pending if isinstance(part, str)]
    if len(texts) == len(pending):
        return oa.ChatMessage(role="user", content="".join(texts))
    parts = [oa.ContentPart(type="text", text=part) if isinstance(part, str) else part for part in pending]
    return oa.ChatMessage(role="user", content=parts)


def _image_url(source: at.ImageSource, where: str) -> str:
    """An image block's source as the chat route takes it (a data: URL; a URL as given, for
    admission to refuse)."""
    if source.type == "base64" and source.data is not None and source.media_type is not None:
        return f"data:{source.media_type};base64,{source.data}"
    if source.type == "url" and source.url is not None:
        return source.url
    raise HttpError("invalid_request", "an image source is base64 (media_type, data) or url", f"{where}.source")


def _tool_result(
    content: str | list[at.TextBlock | at.ImageBlock | at.DocumentBlock] | None, where: str
) -> tuple[str | list[oa.ContentPart] | None, list[oa.ContentPart]]:
    """A tool result's text (the tool message), and its images (a screenshot a tool took: they
    follow the tool message as a user turn, where chat templates place images)."""
    if not isinstance(content, list):
        return content, []
    parts, images = [], []
    for k, block in enumerate(content):
        match block:
            case at.TextBlock(text=text):
                parts.append(oa.ContentPart(type="text", text=text))
            case at.ImageBlock(source=source):
                images.append(oa.ContentPart(type="image_url", image_url=oa.ImageUrl(url=_image_url(source, f"{where}.content[{k}]"))))
            case _:
                raise _refused(block, f"{where}.content[{k}]", "tool_result")
    return parts, images


def _assistant(blocks: list[at.ContentBlock], where: str) -> oa.ChatMessage:
    """An assistant turn: its text, its thinking as reasoning, its tool uses as tool calls."""
    texts: list[oa.ContentPart] = []
    reasoning: list[str] = []
    calls: list[oa.ToolCallIn] = []
    for j, block in enumerate(blocks):
        match block:
            case at.TextBlock(text=text):
                texts.append(oa.ContentPart(type="text", text=text))
            case at.ThinkingBlock(thinking=thinking):
                reasoning.append(thinking)
            case at.RedactedThinkingBlock():
                pass  # Anthropic's encrypted reasoning: nothing a local model can read
            case at.ToolUseBlock():
                calls.append(oa.ToolCallIn(function=oa.FunctionCallIn(name=block.name, arguments=block.input), id=block.id))
            case _:
                raise _refused(block, f"{where}.content[{j}]", "assistant")
    return oa.ChatMessage(role="assistant", content=texts or None, tool_calls=calls or None, reasoning_content="".join(reasoning) if reasoning else None)


def _refused(block: Any, where: str, holder: str) -> HttpError:
    kind = str(type(block).__struct_config__.tag)
    if isinstance(block, at.DocumentBlock):
        return HttpError("invalid_request", f"{kind} content blocks are not supported (this server serves text and images)", where)
    if isinstance(block, at.ImageBlock):
        return HttpError("invalid_request", f"images are taken in user turns only, not in a {holder} block", where)
    return HttpError("invalid_request", f"a {holder} message cannot hold a {kind} block", f"{where}.type")


def _tools(tools: list[at.Tool] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise HttpError("invalid_request", f"server tools ({tool.type!r}) are not supported; give tools with an input_schema", f"tools[{i}].type")
        if tool.input_schema is None:
            raise HttpError("invalid_request", "a tool needs an input_schema", f"tools[{i}].input_schema")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: at.ToolChoice | None) -> str | dict[str, Any] | None:
    match choice:
        case at.ToolChoiceAuto():
            return "auto"
        case at.ToolChoiceAny():
            return "required"
        case at.ToolChoiceTool(name=name):
            return {"type": "function", "function": {"name": name}}
        case at.ToolChoiceNone():
            return "none"
    return None


# -- responses ---------------------------------------------------------------------


@dataclass
class _Block:
    kind: str
    parts: list[str] = field(default_factory=list)
    id: str = ""
    name: str = ""

    def out(self) -> at.BlockOut:
        text = "".join(self.parts)
        if self.kind == "thinking":
            return at.ThinkingOut(thinking=text)
        if self.kind == "tool_use":
            return at.ToolUseOut(id=self.id, name=self.name, input=_arguments(text))
        return at.TextOut(text=text)

    def empty(self) -> at.BlockOut:
        """The block as `content_block_start` opens it."""
        if self.kind == "tool_use":
            return at.ToolUseOut(id=self.id, name=self.name, input={})
        return at.ThinkingOut(thinking="") if self.kind == "thinking" else at.TextOut(text="")


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as an object; {} for a call the output ended inside (max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class MessagesOutput:
    """One message's events as stream events (`on_event`) and as a whole (`response`)."""

    id: str
    model: str
    stream: bool = False
    # The prompt's tokens, counted before it ran: what `message_start` reports.
    input_tokens: int = 0
    blocks: list[_Block] = field(default_factory=list)
    # The block deltas go to (a tool_use block is closed as soon as it opens).
    open: _Block | None = None
    finished: Finished | None = None

    def first_chunk(self) -> at.MessageStart:
        usage = at.Usage(input_tokens=self.input_tokens, output_tokens=0)
        return at.MessageStart(message=at.Message(id=self.id, model=self.model, content=[], stop_reason=None, stop_sequence=None, usage=usage))

    def on_event(self, event: Event) -> list[at.StreamEvent]:
        events: list[at.StreamEvent] = []
        match event:
            case TokenDelta():
                if event.reasoning:
                    events += self._add("thinking", event.reasoning, at.ThinkingDelta(thinking=event.reasoning))
                if event.text:
                    events += self._add("text", event.text, at.TextDelta(text=event.text))
            case ToolCallDelta(name=str() as name):  # a call begins: its block opens
                events += self._close()
                self.open = _Block("tool_use", id=event.id, name=name)
                self.blocks.append(self.open)
                events.append(at.ContentBlockStart(index=len(self.blocks) - 1, content_block=self.open.empty()))
            case ToolCallDelta():  # its input as it is generated
                if self.open is not None and self.open.kind == "tool_use":
                    self.open.parts.append(event.arguments)
                    events.append(at.ContentBlockDelta(index=len(self.blocks) - 1, delta=at.InputJsonDelta(partial_json=event.arguments)))
            case ToolCall():
                streamed = self.open if self.open is not None and self.open.kind == "tool_use" and self.open.id == event.id else None
                if streamed is not None:  # (its fragments added up to the call's arguments)
                    streamed.parts = [event.arguments]
                    events += self._close()
                else:
                    events += self._close()
                    block = _Block("tool_use", [event.arguments], id=event.id, name=event.name)
                    self.blocks.append(block)
                    index = len(self.blocks) - 1
                    delta = at.ContentBlockDelta(index=index, delta=at.InputJsonDelta(partial_json=event.arguments))
                    events += [at.ContentBlockStart(index=index, content_block=block.empty()), delta, at.ContentBlockStop(index=index)]
            case Finished():
                self.finished = event
                if ending_error(event) is not None:
                    return []
                events += self._close()
                events.append(at.MessageDelta(delta=at.StopDelta(stop_reason=self.stop_reason(event), stop_sequence=event.stop_sequence), usage=_usage(event)))
        return events if self.stream else []

    def _add(self, kind: str, text: str, delta: at.TextDelta | at.ThinkingDelta) -> list[at.StreamEvent]:
        events: list[at.StreamEvent] = []
        if self.open is None or self.open.kind != kind:
            events += self._close()
            self.open = _Block(kind)
            self.blocks.append(self.open)
            events.append(at.ContentBlockStart(index=len(self.blocks) - 1, content_block=self.open.empty()))
        self.open.parts.append(text)
        events.append(at.ContentBlockDelta(index=len(self.blocks) - 1, delta=delta))
        return events

    def _close(self) -> list[at.StreamEvent]:
        if self.open is None:
            return []
        self.open = None
        return [at.ContentBlockStop(index=len(self.blocks) - 1)]

    def stop_reason(self, finished: Finished) -> str:
        if finished.finish_reason == "length":
            return "max_tokens"
        if finished.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if any(b.kind == "tool_use" for b in self.blocks) else "end_turn"

    def response(self) -> at.Message:
        finished = self.finished
        assert finished is not None, "response() after the Finished event"
        return at.Message(
            id=self.id,
            model=self.model,
            content=[block.out() for block in self.blocks],
            stop_reason=self.stop_reason(finished),
            stop_sequence=finished.stop_sequence,
            usage=_usage(finished),
        )

    # -- the wire: `event: <type>` + `data: <json>`, ended by message_stop --------------

    def sse(self, chunk: Any) -> bytes:
        kind = str(type(chunk).__struct_config__.tag)
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(chunk) + b"\n\n"

    def sse_end(self) -> bytes:
        return self.sse(at.MessageStop())

    def sse_error(self, error: HttpError) -> bytes:
        return self.sse(anthropic_error(error)[0])

    def error_body(self, error: HttpError) -> tuple[Any, int]:
        return anthropic_error(error)


def _usage(finished: Finished) -> at.Usage:
    u = finished.usage
    return at.Usage(input_tokens=u.prompt_tokens - u.cached_tokens, output_tokens=u.completion_tokens, cache_read_input_tokens=u.cached_tokens)
