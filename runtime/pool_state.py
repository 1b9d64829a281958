"""The state `ModelPool` keeps per model and per request (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from protocols.api import GenerateRequest
from runtime.config import RuntimeConfig
from runtime.replay import Delivered

if TYPE_CHECKING:
    from runtime.runtime import Runtime


@dataclass(eq=False)
class PoolEntry:
    """A model of the pool: its config, residence and the figures swapping reads."""

    name: str
    config: RuntimeConfig
    pinned: bool
    weight_bytes: int
    runtime: Runtime | None = None
    # Kept across swaps (plain Python: token texts for HTTP responses).
    tokenizer: Any = None
    loading: bool = False
    loaded_at: float = 0.0
    last_used: float = 0.0
    users: int = 0
    # Its requests still repeating what their callers have after a swap: it is not swapped out
    # again before they get past it (a request without a checkpoint would never progress).
    replaying: int = 0
    loads: int = 0
    preempted: int = 0
    # New tokens (or ends) its requests delivered since it was loaded: it is not swapped out
    # before its users made some, so every swap buys progress (no livelock at any residence).
    progress: int = 0
    # Bumped at each swap-out: a request whose stream ends under an older epoch was preempted.
    epoch: int = 0
    stop: anyio.Event = field(default_factory=anyio.Event)
    stopped: anyio.Event = field(default_factory=anyio.Event)

    @property
    def resident(self) -> bool:
        return self.runtime is not None


@dataclass(eq=False)
class PoolRequest:
    """A pool request across its runs (one per residence of its model)."""

    rid: str
    request: GenerateRequest
    # What the caller already has: a later run repeats it, and `Replay` skips it.
    delivered: Delivered = field(default_factory=Delivered)
    runs: int = 0
    finished: bool = False
    # Whether its checkpoint cadence is the pool's (`model_pool.checkpoint_every`), not its own.
    pool_cadence: bool = False
