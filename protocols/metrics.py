"""The runtime's request metrics as plain data: what `Runtime.stats()` and the socket's
`Stats` carry, and what `/metrics` renders in Prometheus' text format.

Counters are totals since the runtime started; histograms are cumulative bucket counts
(Prometheus' convention: `counts[i]` observations were <= `bounds[i]`; `count` is the
+Inf bucket). Names follow vLLM's metrics without their `vllm:` prefix.
"""

from __future__ import annotations

import msgspec

from protocols.base import Record


class HistogramSnapshot(Record, frozen=True):
    bounds: list[float]
    counts: list[int]
    count: int
    sum: float


class MetricsSnapshot(Record, frozen=True):
    model_name: str
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Finished requests by reason (stop, length, cancelled, error).
    finished: dict[str, int] = msgspec.field(default_factory=dict)
    # Token fast-forwarding: spans that put tokens into outputs, tokens they injected by kind
    # (strict, echo), and echo tokens the model's verification accepted or rejected.
    fast_forward_events: int = 0
    fast_forward_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    fast_forward_verified_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # time_to_first_token_seconds, inter_token_latency_seconds, e2e_request_latency_seconds,
    # request_queue_time_seconds, request_prefill_time_seconds, request_decode_time_seconds,
    # request_prompt_tokens, request_generation_tokens.
    histograms: dict[str, HistogramSnapshot] = msgspec.field(default_factory=dict)
