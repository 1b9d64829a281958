"""The socket protocol: what a client and `mlxrt serve` exchange.

Each frame is a 4-byte big-endian length followed by one msgpack-encoded
message of the unions below (tagged by `"type"` = the class name). Requests and
events are the embedding API's own types (`protocols.api`). See README.md here.
"""

from __future__ import annotations

from typing import Literal

from protocols.api import AdapterInfo, DenoiseProgress, Finished, GenerateRequest, PrefillProgress, TokenDelta, ToolCall, ToolCallDelta
from protocols.base import Message, Record
from protocols.errors import ErrorCode
from protocols.stats import Stats

# 2: `Stats` is the runtime's own struct (`protocols.stats`), with `adapters`.
PROTOCOL_VERSION = 2

# -- client -> server --------------------------------------------------------------


class Hello(Message, frozen=True):
    """The first frame of every connection."""

    protocol_version: int
    client: str = ""


class Generate(Message, frozen=True):
    """Start a request; `request.request_id` is required and names its events."""

    request: GenerateRequest


class Resume(Message, frozen=True):
    """Continue a checkpointed request; its events follow as for `Generate`."""

    request_id: str


class Cancel(Message, frozen=True):
    request_id: str


class GetStats(Message, frozen=True):
    pass


class AdapterCommand(Message, frozen=True):
    """Load (`name`, `path` on the server's machine, `pinned`), unload (`name`) or list the
    LoRA adapters; answered with `Adapters`."""

    op: Literal["load", "unload", "list"]
    name: str = ""
    path: str = ""
    pinned: bool = False


ClientMessage = Hello | Generate | Resume | Cancel | GetStats | AdapterCommand


# -- server -> client --------------------------------------------------------------


class ModelSummary(Record, frozen=True):
    path: str
    model_type: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]
    # Whether requests may send `messages` (the model has a chat template).
    has_chat_template: bool = False


class Limits(Record, frozen=True):
    max_frame_bytes: int
    max_batch_size: int
    max_queued_requests: int
    default_max_tokens: int


class Welcome(Message, frozen=True):
    protocol_version: int
    model: ModelSummary
    limits: Limits


class Error(Message, frozen=True):
    code: ErrorCode
    message: str
    request_id: str | None = None
    # For invalid requests: the offending field, e.g. "sampling.temperature".
    field: str | None = None


class Adapters(Message, frozen=True):
    """The answer to an `AdapterCommand`: the adapters known after it, or why it was refused
    (`code` and `message` as in `Error`)."""

    adapters: list[AdapterInfo]
    code: ErrorCode | None = None
    message: str = ""
    field: str | None = None


ServerMessage = Welcome | TokenDelta | ToolCall | ToolCallDelta | PrefillProgress | DenoiseProgress | Finished | Error | Stats | Adapters
