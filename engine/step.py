"""One forward's geometry over the decode batch's rows, shared by every layer's slots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

LEN_STEP = 256


def round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step


@dataclass
class Step:
    """Where one forward writes; set by `DecodeBatch.begin_step`, read by every slot.

    Every forwarded row takes `num_new` positions; a row's positions past its own count are
    padding, written past its length and never attended to.
    """

    num_rows: int
    rows: list[int] | None  # the forwarded rows (None: every row, in order)
    starts: list[int]  # each forwarded row's length before the step
    counts: list[int]  # tokens each forwarded row forwards
    num_new: int
    positions: mx.array
    row_index: mx.array | None
    uniform_start: int | None  # every row at one position: plain slice writes
    # Per forwarded row, what its rotary positions add to its cache positions (Qwen-VL's mRoPE
    # delta after an image); None when no row's is other than 0.
    shifts: mx.array | None = None
    # Arrays derived once per step and shared by the layers that need them (masks, indices).
    derived: dict[Any, Any] = field(default_factory=dict)

    @property
    def width(self) -> int:
        return max(self.starts) + self.num_new

    def derive(self, key, build):
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]

    def select(self, buffer: mx.array) -> mx.array:
        """The forwarded rows of a `[rows, ...]` buffer."""
        return buffer[: self.num_rows] if self.row_index is None else buffer[self.row_index]
