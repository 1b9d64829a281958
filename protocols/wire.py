"""The socket protocol: what a client and `mlxrt serve` exchange.

Each frame is a 4-byte big-endian length followed by one msgpack-encoded
message of the unions below (tagged by `"type"` = the class name). Requests and
events are the embedding API's own types (`protocols.api`). See README.md here.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from protocols.api import AdapterInfo, DenoiseProgress, Finished, GenerateRequest, ModelStatus, PrefillProgress, TokenDelta, ToolCall, ToolCallDelta
from protocols.base import Message, Record
from protocols.errors import ErrorCode
from protocols.kv import KvStats
from protocols.metrics import MetricsSnapshot
from protocols.model import WorldStats
from protocols.scheduler import SchedulerStats
from protocols.stats import Stats
from protocols.wire_v1 import v1_shape

# The versions this server speaks, oldest first: a connection's `Hello` picks one, and every
# server message on it takes that version's shape (`for_version`). README.md "Versions".
# `Hello` and `Error` keep one shape in every version, and the client messages are the same in both
# (`AdapterCommand` came in version 1).
# 1: the first version.
# 2: `Stats` is the runtime's own struct (`protocols.stats`), with `adapters`. Fields added
# since are optional and sent to version 2 (clients ignore fields they do not know), never to 1.
SUPPORTED_PROTOCOL_VERSIONS: tuple[int, ...] = (1, 2)
# The newest, which `net.client` speaks.
PROTOCOL_VERSION = SUPPORTED_PROTOCOL_VERSIONS[-1]

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
    # Only in a handshake's refusal (a first frame that is not a Hello of a version the server
    # speaks): the versions it does. Unset (not encoded) otherwise: other Errors keep their shape.
    supported_versions: list[int] | msgspec.UnsetType = msgspec.UNSET


class Adapters(Message, frozen=True):
    """The answer to an `AdapterCommand`: the adapters known after it, or why it was refused
    (`code` and `message` as in `Error`)."""

    adapters: list[AdapterInfo]
    code: ErrorCode | None = None
    message: str = ""
    field: str | None = None


ServerMessage = Welcome | TokenDelta | ToolCall | ToolCallDelta | PrefillProgress | DenoiseProgress | Finished | Error | Stats | Adapters


# -- older versions --------------------------------------------------------------


class StatsV1(Message, frozen=True, tag="Stats"):
    """`Stats` as version 1 sends it: the socket's own struct, without `adapters`."""

    scheduler: SchedulerStats
    kv: KvStats
    live_requests: int
    connections: int
    metrics: MetricsSnapshot | None = None
    models: list[ModelStatus] = msgspec.field(default_factory=list)
    world: WorldStats | None = None


def for_version(message: msgspec.Struct, version: int) -> msgspec.Struct | dict[str, Any]:
    """`message` in the shape a client of protocol `version` decodes (the newest: unchanged;
    version 1: its own `Stats`, and only the fields each struct had then, `wire_v1`)."""
    if version >= 2:
        return message
    if isinstance(message, Stats):
        message = StatsV1(
            scheduler=message.scheduler,
            kv=message.kv,
            live_requests=message.live_requests,
            connections=message.connections,
            metrics=message.metrics,
            models=message.models,
            world=message.world,
        )
    return v1_shape(message)
