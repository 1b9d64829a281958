"""What the KV code reads and writes of a request (`engine.sequence.Sequence` is one).

The block tables (`tables`) and the prefix entries (`prefixes`) depend on this much of a
request, not on the engine's request state, so they stay below it.
"""

from __future__ import annotations

from typing import Protocol

from protocols.model import AdmitRequest


class KvRequest(Protocol):
    """A request as the KV code sees it. `table`, `num_shared`, `saved_entry` and `cache` are
    written by the KV code (its blocks, its seeded prefix, its latest prefix entry, its caches);
    the rest is read only."""

    admit: AdmitRequest
    # Its caches while out of the decode batch, its paged blocks (the first `num_shared` a
    # prefix entry's too) and the latest prefix entry kept from it with its number of blocks.
    cache: list | None
    table: list[int]
    num_shared: int
    saved_entry: tuple[str, int] | None
    num_prefilled: int

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_len(self) -> int: ...

    def tokens_with_kv(self, length: int) -> list[int]:
        """The tokens whose KV the first `length` cache positions hold."""
        ...
