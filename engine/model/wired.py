"""Wired memory on Metal: a large model's buffers kept resident while it generates.

On Apple silicon the GPU's memory is the system's; macOS may page out a model's buffers between
uses, and a model near the device's recommended working set then decodes far slower. mlx-lm sets
the wired limit to the recommended working set around each generation (`wired_limit`), and the
seeds' `acquireModelWiredLimit` does so for a model whose weights exceed half of it. Here an
engine holds the limit while it has requests (from the step that admits the first to the step
that sees the last leave) when its weights exceed `WIRE_FRACTION` of the recommended working
set: nothing stays wired on an idle server. Holders nest (several models of a pool, process
wide): the outermost sets the limit, the last to leave restores the previous one, after
synchronizing (the limit must not change under an asynchronous evaluation).

Only where the device reports a recommended working set (Metal); the CPU and CUDA backends have
none, and nothing here changes them. Runs on the MLX thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import mlx.core as mx
from mlx.utils import tree_reduce

# Seeds (measured on a 24 GB machine reporting a ~25 GiB recommended set): 13-16 GiB models paged
# heavily unwired; 8-9 GiB ones did not need it.
WIRE_FRACTION = 0.5


def recommended_working_set() -> int | None:
    """The device's recommended working set in bytes; None off Metal."""
    if not mx.metal.is_available():
        return None
    size = mx.device_info().get("max_recommended_working_set_size")
    return int(size) if size else None


def model_bytes(model) -> int:
    return tree_reduce(lambda total, x: total + x.nbytes if isinstance(x, mx.array) else total, model.parameters(), 0)


def needs_wiring(weight_bytes: int, recommended: int | None, fraction: float = WIRE_FRACTION) -> bool:
    return recommended is not None and weight_bytes > fraction * recommended


class WiredLimits:
    """Nested holders of one process-wide wired limit."""

    def __init__(self, set_limit: Callable[[int], int] | None = None, synchronize: Callable[[], None] | None = None):
        # (Looked up when used, not bound here: MLX's own functions by default.)
        self._set_limit = set_limit or (lambda limit: mx.set_wired_limit(limit))
        self._synchronize = synchronize or (lambda: mx.synchronize())
        self._lock = threading.Lock()
        self._depth = 0
        self._previous = 0

    @property
    def depth(self) -> int:
        return self._depth

    def enter(self, limit: int) -> None:
        with self._lock:
            if self._depth == 0:
                self._previous = self._set_limit(limit)
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth == 0:
                self._synchronize()
                self._set_limit(self._previous)


LIMITS = WiredLimits()


class WiredScope:
    """One engine's hold on the limit: `hold` when it has requests, `release` when it has none."""

    def __init__(self, weight_bytes: int, recommended: int | None, limits: WiredLimits = LIMITS):
        self.wanted = needs_wiring(weight_bytes, recommended)
        self._limit = recommended or 0
        self._limits = limits
        self.held = False

    def hold(self) -> None:
        if self.wanted and not self.held:
            self._limits.enter(self._limit)
            self.held = True

    def release(self) -> None:
        if self.held:
            self._limits.exit()
            self.held = False
