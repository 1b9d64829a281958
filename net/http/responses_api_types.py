"""OpenAI's Responses API shapes (`POST /v1/responses`) as msgspec Structs: the request body
decoded, the response object, its output items and its stream events encoded.

The request allows unknown fields (`include`, `reasoning`, `service_tier`, `prompt_cache_key`,
...: accepted and ignored) and takes mlxrt's own options as the chat route does
(`NativeExtras`). `input` stays plain JSON here: its items are told apart by `type` (a message
may leave it out) and decoded one by one (`net.http.responses_api`), so a bad item is a 400
naming its place (`input[2].role`). Pure data.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from net.http.openai_types import NativeExtras

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]

# -- requests ----------------------------------------------------------------------


class FunctionTool(msgspec.Struct, tag="function", tag_field="type", kw_only=True, omit_defaults=True):
    """A function tool, flat (not nested under `function` as chat's are). Other tool types
    (`file_search`, `code_interpreter`, ...) are refused by their `type`."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(msgspec.Struct, tag="namespace", tag_field="type", kw_only=True, omit_defaults=True):
    """Function tools grouped under a name (the Codex CLI sends its sub-agent tools so): the
    model is offered its functions, by their own names."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    description: str | None = None
    tools: list[FunctionTool] = msgspec.field(default_factory=list)


class WebSearchTool(msgspec.Struct, tag="web_search", tag_field="type", kw_only=True, omit_defaults=True):
    """OpenAI's hosted search (the Codex CLI sends it by default): accepted, never offered to
    the model (nothing here searches the web), so it is never called."""

    external_web_access: bool | None = None


Tool = FunctionTool | NamespaceTool | WebSearchTool


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str


ToolChoice = Literal["auto", "none", "required"] | ToolChoiceFunction


class FormatText(msgspec.Struct, tag="text", tag_field="type", kw_only=True):
    pass


class FormatJsonObject(msgspec.Struct, tag="json_object", tag_field="type", kw_only=True):
    pass


class FormatJsonSchema(msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True, omit_defaults=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


TextFormat = FormatText | FormatJsonObject | FormatJsonSchema


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=FormatText)
    # Accepted, not used.
    verbosity: str | None = None


class ResponsesRequest(NativeExtras, kw_only=True):
    """`POST /v1/responses`."""

    model: str
    # A text (one user message) or a list of items (see `net.http.responses_api`).
    input: str | list[Any] = msgspec.field(default_factory=list)
    # A system message before the conversation (not carried over by `previous_response_id`).
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = "auto"
    text: TextConfig | None = None
    max_output_tokens: PositiveInt | None = None
    # OpenAI's default temperature is 1 (mlxrt's native default is greedy).
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    # An mlxrt extra, as on the chat route (range checked by the runtime).
    seed: int | None = None
    stream: bool = False
    # Keep the response (input and output) for `previous_response_id` and GET /v1/responses/{id}.
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted; a model calls as many tools as it writes.
    parallel_tool_calls: bool = True
    # Refused when true: nothing runs in the background here.
    background: bool = False


# -- input items (decoded one by one) -------------------------------------------------


class TextPart(msgspec.Struct, kw_only=True):
    """`input_text` or `output_text` content (an assistant's earlier output sent back)."""

    text: str


class RefusalPart(msgspec.Struct, kw_only=True):
    refusal: str


class MessageItem(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(msgspec.Struct, kw_only=True):
    call_id: str
    name: Annotated[str, msgspec.Meta(min_length=1)]
    # A JSON object as text.
    arguments: str


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    call_id: str
    output: str | list[dict[str, Any]]


# -- responses ---------------------------------------------------------------------


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", kw_only=True):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type", kw_only=True):
    text: str


class SummaryText(msgspec.Struct, tag="summary_text", tag_field="type", kw_only=True):
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageOut(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    status: ItemStatus
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallOut(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningOut(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True):
    """The model's reasoning (a leading `<think>` block) as `reasoning_text` content; a local
    model writes no separate summary, so `summary` is empty."""

    id: str
    summary: list[SummaryText]
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = ReasoningOut | MessageOut | FunctionCallOut


class InputTokensDetails(msgspec.Struct, kw_only=True):
    # Prompt tokens served from the prefix cache.
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class Reasoning(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class Response(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)
    store: bool
    temperature: float
    text: TextConfig
    tool_choice: ToolChoice
    tools: list[Tool]
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    background: bool = False


class DeletedResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


# -- stream events (each `event: <type>` + `data: <json>`, numbered by `sequence_number`) --


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int


class ResponseCreated(_Event, tag="response.created", kw_only=True):
    response: Response


class ResponseInProgress(_Event, tag="response.in_progress", kw_only=True):
    response: Response


class ResponseCompleted(_Event, tag="response.completed", kw_only=True):
    response: Response


class ResponseIncomplete(_Event, tag="response.incomplete", kw_only=True):
    response: Response


class ResponseFailed(_Event, tag="response.failed", kw_only=True):
    response: Response


class OutputItemAdded(_Event, tag="response.output_item.added", kw_only=True):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done", kw_only=True):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(_Event, tag="response.content_part.done", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(_Event, tag="response.output_text.delta", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(_Event, tag="response.output_text.done", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningTextDelta(_Event, tag="response.reasoning_text.delta", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(_Event, tag="response.reasoning_text.done", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta", kw_only=True):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done", kw_only=True):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event, tag="error", kw_only=True):
    """An error after the stream began (OpenAI's error fields, flat)."""

    code: str | None
    message: str
    param: str | None


StreamEvent = (
    ResponseCreated
    | ResponseInProgress
    | ResponseCompleted
    | ResponseIncomplete
    | ResponseFailed
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | ErrorEvent
)
