"""OpenAI's HTTP API shapes as msgspec Structs: request bodies decoded, responses encoded.

Request bodies allow unknown fields (OpenAI adds fields often; clients send ones this
server ignores, e.g. `user`, `store`, `metadata`), and each value's range is stated on its
type, so a bad value is a 400 naming its field. mlxrt's own request options (`NativeExtras`)
are accepted as extra body fields (`extra_body=` in the `openai` SDK). Pure data.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from protocols.api import DenoisingOptions

Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]

# -- requests ----------------------------------------------------------------------


class NativeExtras(msgspec.Struct, kw_only=True):
    """mlxrt options without an OpenAI spelling (see `protocols.api.GenerateRequest`)."""

    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    penalty_context_size: PositiveInt | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    priority: int = 0
    fill: Literal["off", "strict", "echo"] | None = None
    jump_forward: bool | None = None
    checkpoint_every: Annotated[int, msgspec.Meta(ge=0)] | None = None
    snapshot_at: PositiveInt | None = None
    # Speculative decoding: on (a draft model, else prompt lookup) or off; its acceptance rule.
    speculative: bool | None = None
    acceptance: Literal["exact", "rejection"] | None = None
    # Your own id for the request (needed with checkpoint_every; must not be live).
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    # Each choice (and streamed chunk) carries the generated `token_ids` too.
    return_token_ids: bool = False
    # vLLM's structured outputs ({"json": schema} | {"regex": ...} | {"choice": [...]} |
    # {"grammar": ebnf}), and its older spellings; an alternative to `response_format`.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    truncate_prompt_tokens: PositiveInt | None = None
    # vLLM's: each prompt token's log-probability given those before it, with this many
    # alternatives, in the choice's `prompt_logprobs` (the first token's is null).
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    # vLLM's logits controls (`protocols.api.SamplingParams`; their ranges are checked there):
    # no end of sequence or stop token before this many tokens, only these ids, no such words.
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # A diffusion language model's denoising settings (`docs/denoising.md`).
    denoising: DenoisingOptions | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (the prompt's tokens, those generated yet).
    continuous_usage_stats: bool = False


class ImageUrl(msgspec.Struct, kw_only=True):
    # A data: URL (data:image/png;base64,...); remote URLs are refused.
    url: str
    detail: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    # A JSON object as text (OpenAI's shape); an object is taken as it is.
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(msgspec.Struct, kw_only=True):
    function: FunctionCallIn
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _Sampling(NativeExtras, kw_only=True):
    model: str
    max_tokens: PositiveInt | None = None
    # OpenAI's default temperature is 1 (mlxrt's native default is greedy).
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # Range checked by the runtime's validation (as every native request's).
    seed: int | None = None
    stop: str | list[str] | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's: {token id as a string: bias in [-100, 100]} (checked by the runtime).
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # Text, token ids, or a list of one of either (several prompts are refused).
    prompt: str | list[Any]
    # OpenAI's default for this endpoint; 0 with `echo`: the prompt's logprobs alone.
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = 16
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: PositiveInt | None = None


# -- responses ---------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionOut
    type: str = "function"
    # Streamed calls carry their position; a message's list does not.
    index: int | msgspec.UnsetType = msgspec.UNSET


class FunctionDeltaOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    arguments: str
    name: str | None = None


class ToolCallDeltaOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed call's part: the first has its id, type and name, the rest argument text."""

    index: int
    function: FunctionDeltaOut
    id: str | None = None
    type: str | None = None


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class LogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(msgspec.Struct):
    content: list[LogprobOut]


class AssistantMessage(msgspec.Struct, kw_only=True):
    content: str | None
    role: str = "assistant"
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str
    object: str = "chat.completion"


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut | ToolCallDeltaOut] | None = None


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: str
    object: str = "chat.completion.chunk"
    # With stream_options.include_usage: null on every chunk but the last, which has it.
    usage: UsageInfo | msgspec.UnsetType | None = msgspec.UNSET


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    # An echoed prompt's first token has none (null).
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprobOut(msgspec.Struct, kw_only=True):
    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    # vLLM's shape: per prompt token (the first null), its own and the top alternatives' scores by token id.
    prompt_logprobs: list[dict[str, PromptLogprobOut] | None] | msgspec.UnsetType = msgspec.UNSET


class Completion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str
    object: str = "text_completion"
    usage: UsageInfo | msgspec.UnsetType | None = msgspec.UNSET


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "mlxrt"
    # A LoRA adapter served under its own name (as vLLM lists them): the base model's name.
    parent: str | None = None


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's `/v1/load_lora_adapter` body."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's `/v1/unload_lora_adapter` body."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody
