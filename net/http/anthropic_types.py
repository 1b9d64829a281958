"""Anthropic's Messages API shapes as msgspec Structs: request bodies decoded, responses and
stream events encoded.

Request bodies allow unknown fields (`cache_control`, `citations`, `service_tier`, ...: accepted
and ignored); content blocks are tagged by `type`, so a block of a type this server does not
know is a 400 naming its place (`messages[0].content[1].type`). Image and document blocks
decode, to be refused by name (`net.http.anthropic`). Pure data.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from protocols.api import DenoisingOptions

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]

# -- requests ----------------------------------------------------------------------


class TextBlock(msgspec.Struct, tag="text", tag_field="type", kw_only=True):
    text: str


class ImageSource(msgspec.Struct, kw_only=True):
    # "base64" (with media_type and data) or "url" (refused by admission: nothing is fetched).
    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(msgspec.Struct, tag="image", tag_field="type", kw_only=True):
    """An image in a user turn (vision-language models)."""

    source: ImageSource


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type", kw_only=True):
    """Refused: this server serves text models."""


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    # Accepted; the OpenAI equivalent (a `tool` message) has no such flag, so neither has the prompt.
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type", kw_only=True):
    data: str = ""


ContentBlock = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class MessageParam(msgspec.Struct, kw_only=True):
    # "system": an instruction at its place in the conversation (Claude Code sends its
    # environment so, after the first user turn); text blocks only.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    # Required for a client tool; Anthropic's server tools (a `type` such as "bash_20250124") are refused.
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoiceAuto(msgspec.Struct, tag="auto", tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(msgspec.Struct, tag="any", tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(msgspec.Struct, tag="tool", tag_field="type", kw_only=True):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(msgspec.Struct, tag="none", tag_field="type", kw_only=True):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(msgspec.Struct, tag="enabled", tag_field="type", kw_only=True):
    # Accepted, not enforced: a model reasons as its chat template and weights make it.
    budget_tokens: PositiveInt


class ThinkingDisabled(msgspec.Struct, tag="disabled", tag_field="type", kw_only=True):
    pass


class ThinkingAdaptive(msgspec.Struct, tag="adaptive", tag_field="type", kw_only=True):
    pass


class ThinkingBetweenTools(msgspec.Struct, tag="between_tools", tag_field="type", kw_only=True):
    pass


# All accepted; none changes what the model does (it reasons as its weights and template make it).
Thinking = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | ThinkingBetweenTools


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/messages/count_tokens`: what the prompt is rendered from."""

    model: str
    messages: Annotated[list[MessageParam], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """`POST /v1/messages`."""

    max_tokens: PositiveInt
    stop_sequences: list[str] | None = None
    # Anthropic's default temperature is 1 (mlxrt's native default is greedy).
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Accepted; `user_id` is not used.
    metadata: dict[str, Any] | None = None
    stream: bool = False
    # mlxrt's: a diffusion language model's denoising settings (`docs/denoising.md`).
    denoising: DenoisingOptions | None = None


# -- responses ---------------------------------------------------------------------


class TextOut(msgspec.Struct, tag="text", tag_field="type", kw_only=True):
    text: str


class ThinkingOut(msgspec.Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    # Anthropic signs its models' thinking; a local model's is not signed.
    signature: str = ""


class ToolUseOut(msgspec.Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


BlockOut = TextOut | ThinkingOut | ToolUseOut


class Usage(msgspec.Struct, kw_only=True):
    # Prompt tokens not read from the prefix cache; the cached ones are `cache_read_input_tokens`
    # (Anthropic's split: the prompt is their sum).
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[BlockOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(msgspec.Struct, kw_only=True):
    input_tokens: int


# -- stream events (each is `event: <type>` and `data: <json>`) ---------------------


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type", kw_only=True):
    message: Message


class ContentBlockStart(msgspec.Struct, tag="content_block_start", tag_field="type", kw_only=True):
    index: int
    content_block: BlockOut


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type", kw_only=True):
    text: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type", kw_only=True):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type", kw_only=True):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type", kw_only=True):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type", kw_only=True):
    index: int


class StopDelta(msgspec.Struct, kw_only=True):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type", kw_only=True):
    delta: StopDelta
    # Final totals (a message_delta's usage is cumulative): the prompt's split is known only now.
    usage: Usage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type", kw_only=True):
    pass


StreamEvent = MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop


# -- errors ------------------------------------------------------------------------


class ErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class ErrorResponse(msgspec.Struct, tag="error", tag_field="type", kw_only=True):
    """The error body of every refusal, and the `error` event of a stream that fails."""

    error: ErrorDetail
