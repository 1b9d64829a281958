"""A request's cache outside the decode batch whose positions are `[0, offset)`.

The paged (`engine.kv.paged.PagedKV`) and quantized (`engine.kv.quantized.QuantizedKV`) kinds
answer mlx-lm's layers and `trim_prompt_cache` alike: the mask follows the offset, and a trim
only moves the offset back (the positions past it are overwritten by the next writes).
"""

from __future__ import annotations

from mlx_lm.models.cache import _BaseCache, create_attention_mask


class OffsetCache(_BaseCache):
    """Holds `offset` positions; subclasses store them."""

    offset: int

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last `n` positions (at most all of them); returns how many were."""
        n = min(self.offset, n)
        self.offset -= n
        return n
