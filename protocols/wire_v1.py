"""Version 1 of the socket protocol as it was when version 2 came: every struct a server sends, with
the fields it had then. A version-1 connection gets each message with those fields only
(`v1_shape`), so a client written for version 1 that refuses unknown fields decodes whatever a newer
server sends it: fields added since (`Finished.denoising_steps`, `ToolCall.truncated`,
`TokenDelta.prompt_logprobs`, `TokenLogprob.rank`, `KvStats.disk`, ...) are left out, and fields
added later will be too. Messages that came after version 1 (`ToolCallDelta`, `DenoiseProgress`,
sent only when a request asks for them) go unchanged. Pure data.
"""

from __future__ import annotations

import datetime
from typing import Any

import msgspec

# Struct name -> the fields (as encoded) version 1 sent; `StatsV1` is version 1's `Stats`.
V1_FIELDS: dict[str, tuple[str, ...]] = {
    "AdapterInfo": ("name", "path", "pinned", "resident", "rank", "scale", "modules", "num_bytes", "digest", "users"),
    "Adapters": ("adapters", "code", "message", "field"),
    "CheckpointReport": ("written", "failed", "error"),
    "Error": ("code", "message", "request_id", "field"),
    "FillStats": (
        "mode",
        "refused",
        "echo_refused",
        "events",
        "injected",
        "strict",
        "echo",
        "span_lens",
        "truncated",
        "decode_steps",
        "verify_events",
        "verify_accepted",
        "verify_rejected",
    ),
    "Finished": ("request_id", "finish_reason", "usage", "timings", "stop_sequence", "error", "fill", "checkpoint", "spec", "error_code"),
    "HistogramSnapshot": ("bounds", "counts", "count", "sum"),
    "KvPool": ("block_size", "capacity", "used", "free", "shared", "unused_positions", "block_bytes"),
    "KvStats": (
        "live_requests",
        "live_tokens",
        "live_bytes",
        "reserved_tokens",
        "physical_bytes",
        "bytes_per_token",
        "budget_bytes",
        "prefix_entries",
        "prefix_bytes",
        "prefix_hits",
        "prefix_tokens_reused",
        "checkpoints_available",
        "checkpoints_written",
        "checkpoints_failed",
        "reserved_bytes",
        "prefix_queries",
        "prefix_tokens_queried",
        "adapter_bytes",
        "device_active_bytes",
        "device_peak_bytes",
        "device_cache_bytes",
        "kv_format",
        "quantized_bytes",
        "pool",
        "peak_physical_bytes",
    ),
    "Limits": ("max_frame_bytes", "max_batch_size", "max_queued_requests", "default_max_tokens"),
    "MetricsSnapshot": (
        "model_name",
        "prompt_tokens",
        "generation_tokens",
        "finished",
        "fast_forward_events",
        "fast_forward_tokens",
        "fast_forward_verified_tokens",
        "histograms",
    ),
    "ModelStatus": ("name", "path", "pinned", "state", "weight_bytes", "live_requests", "loads", "preempted"),
    "ModelSummary": ("path", "model_type", "vocab_size", "max_context", "eos_token_ids", "has_chat_template"),
    "PrefillProgress": ("request_id", "processed_tokens", "total_tokens"),
    "SchedulerStats": ("waiting", "prefilling", "decoding", "steps", "num_finished", "paused", "spec"),
    "SpecStats": ("method", "acceptance", "refused", "rounds", "drafted", "accepted", "rejected", "accepted_by_position", "generated", "target_forwards"),
    "SpecTotals": ("requests", "rounds", "drafted", "accepted", "generated", "target_forwards"),
    "StatsV1": ("scheduler", "kv", "live_requests", "connections", "metrics", "models", "world"),
    "Timings": ("queue_s", "ttft_s", "total_s", "prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s"),
    "TokenDelta": ("request_id", "token_ids", "text", "logprobs", "reasoning"),
    "TokenLogprob": ("token_id", "logprob", "top"),
    "ToolCall": ("request_id", "index", "id", "name", "arguments"),
    "TopLogprob": ("token_id", "logprob"),
    "Usage": ("prompt_tokens", "completion_tokens", "cached_tokens"),
    "Welcome": ("protocol_version", "model", "limits"),
    "WorldStats": ("size", "backend", "mode", "available", "error", "steps", "step_s", "broadcast_s"),
}
# Kept as they are by `msgspec.to_builtins`: msgpack encodes them natively.
_NATIVE = (bytes, bytearray, memoryview, datetime.datetime)


def v1_shape(message: msgspec.Struct) -> dict[str, Any]:
    """`message` as version 1 encodes it: its builtins form (what msgpack encodes the same as the
    struct: tag, omitted defaults and unset fields alike) without the fields version 1 lacks."""
    return _strip(message, msgspec.to_builtins(message, builtin_types=_NATIVE))


def _strip(value: Any, built: Any) -> Any:
    """`built` (the builtins form of `value`) without, at any depth, the fields version 1 lacks."""
    if isinstance(value, msgspec.Struct):
        allowed = V1_FIELDS.get(type(value).__name__)
        for field in msgspec.structs.fields(value):
            if field.encode_name not in built:
                continue  # (omitted: unset, or a default left out)
            if allowed is not None and field.encode_name not in allowed:
                del built[field.encode_name]
            else:
                built[field.encode_name] = _strip(getattr(value, field.name), built[field.encode_name])
        return built
    if isinstance(value, (list, tuple)):
        return [_strip(item, shown) for item, shown in zip(value, built, strict=True)]
    if isinstance(value, dict):
        return {key: _strip(item, shown) for item, (key, shown) in zip(value.values(), built.items(), strict=True)}
    return built
