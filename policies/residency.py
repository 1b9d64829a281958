"""Which models of a pool stay resident under `model_pool.memory_bytes` (pure).

A model that must load makes room by swapping others out: idle ones first, then the least
recently used; never a pinned one, one whose requests are still repeating what their callers
have (they would never progress), one whose users made no progress since it loaded (unless that
was `PROGRESS_GRACE_S` ago: a stuck caller cannot hold it for good), or one resident for less than
`model_pool.min_resident_s` (no thrashing between two busy models: then the load waits).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

# A model whose requests made no progress since it was loaded (a long prefill, a paused caller)
# may be swapped out after this long all the same, so a stuck caller cannot hold it for good.
PROGRESS_GRACE_S = 30.0


class PoolModel(Protocol):
    """What residency reads of a pool's model."""

    name: str
    pinned: bool
    weight_bytes: int
    loaded_at: float
    last_used: float
    users: int
    replaying: int
    progress: int

    @property
    def resident(self) -> bool: ...


@dataclass(frozen=True)
class Swap:
    """Swap `victim` out, or (victim None) wait `wait_s` before trying again."""

    victim: PoolModel | None
    wait_s: float = 0.0


def next_swap(models: Iterable[PoolModel], wanted: PoolModel, now: float, min_resident_s: float) -> Swap:
    """What to do next for `wanted` to fit, once the resident models are over the cap."""
    candidates = [m for m in models if m.resident and not m.pinned and m is not wanted]
    candidates = [m for m in candidates if not m.replaying and (m.users == 0 or m.progress > 0 or now - m.loaded_at >= PROGRESS_GRACE_S)]
    ready = [m for m in candidates if now - m.loaded_at >= min_resident_s]
    if not ready:
        # Too fresh: wait out its residence; waiting for progress: the pool is woken by progress.
        return Swap(None, max(0.01, min((min_resident_s - (now - m.loaded_at) for m in candidates), default=max(min_resident_s, 0.05))))
    # Idle models first, then the least recently used.
    return Swap(min(ready, key=lambda m: (m.users > 0, m.last_used)))


def pinned_overflow(models: Iterable[PoolModel], cap: int) -> str | None:
    """Why the pinned models and the largest other cannot all fit `cap` (None when they can)."""
    models = list(models)
    pinned = sum(m.weight_bytes for m in models if m.pinned)
    largest = max((m.weight_bytes for m in models if not m.pinned), default=0)
    if cap and pinned + largest > cap:
        return f"model_pool.memory_bytes = {cap} cannot hold the pinned models ({pinned} bytes) and the largest other ({largest})"
    return None


def never_fits(models: Iterable[PoolModel], model: PoolModel, cap: int) -> str | None:
    """Why `model` can never fit `cap` beside the pinned models, however many are swapped out."""
    pinned = sum(m.weight_bytes for m in models if m.pinned and m is not model)
    if cap and model.weight_bytes + pinned > cap:
        return f"model {model.name!r} needs {model.weight_bytes} bytes of weights: with the pinned models, over model_pool.memory_bytes = {cap}"
    return None
