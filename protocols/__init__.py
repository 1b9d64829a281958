"""Pure data: the messages the runtime's actors and clients exchange.

`protocols.api` is the public surface (requests and events); the other modules
are one inbox each (`model`, `kv`, `scheduler`, `session`).
"""

from protocols.api import (
    AdapterInfo,
    CheckpointReport,
    DenoiseProgress,
    DenoisingOptions,
    Event,
    FillStats,
    Finished,
    FinishReason,
    GenerateRequest,
    PrefillProgress,
    SamplingParams,
    SpecStats,
    Timings,
    TokenDelta,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)

__all__ = [
    "AdapterInfo",
    "CheckpointReport",
    "DenoiseProgress",
    "DenoisingOptions",
    "Event",
    "FillStats",
    "FinishReason",
    "Finished",
    "GenerateRequest",
    "PrefillProgress",
    "SamplingParams",
    "SpecStats",
    "Timings",
    "TokenDelta",
    "TokenLogprob",
    "ToolCall",
    "TopLogprob",
    "Usage",
]
