"""A runtime's figures: one struct for the embedding API (`Runtime.stats()`, `ModelPool.stats()`)
and the socket (`GetStats` is answered with it, `connections` filled in by the server)."""

from __future__ import annotations

import msgspec

from protocols.api import AdapterInfo, ModelStatus
from protocols.base import Message
from protocols.kv import KvStats
from protocols.metrics import MetricsSnapshot
from protocols.model import WorldStats
from protocols.scheduler import SchedulerStats


class Stats(Message, frozen=True):
    scheduler: SchedulerStats
    kv: KvStats
    live_requests: int
    # Request counters and latency histograms since the runtime started (`/metrics` over HTTP).
    metrics: MetricsSnapshot
    # The LoRA adapters known (as of the last load or unload; `adapters()` for live figures).
    adapters: list[AdapterInfo] = msgspec.field(default_factory=list)
    # With several models (`ModelPool`, `[[models]]`): each one's state; `scheduler`, `kv` and
    # `metrics` are then the default model's.
    models: list[ModelStatus] = msgspec.field(default_factory=list)
    # In a distributed world (`[distributed]`): its size, mode, whether it is available, and
    # the seconds its steps took and spent broadcasting plans.
    world: WorldStats | None = None
    # Clients connected to the socket server that answered (0 from an in-process runtime).
    connections: int = 0
