"""The Responses API's store: responses kept (`store: true`) for `previous_response_id` and for
`GET`/`DELETE /v1/responses/{id}`, in memory, bounded by count and bytes (`server.responses_store_max`,
`server.responses_store_bytes`), the least recently used going first.

Each entry holds the response object's JSON as it was answered and the conversation it ended
(its chat messages, the instructions excluded, its own output included), so a follow-up turn
renders the whole conversation again. Both are kept as JSON bytes: what an entry costs is
what it holds, and nothing a later request does can change it. Lost on restart. Pure data.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from net.http.mapping import HttpError


@dataclass(frozen=True)
class StoredResponse:
    # The response object's JSON.
    response: bytes
    # The conversation up to and including this response's output, as chat messages (JSON).
    history: bytes

    @property
    def size(self) -> int:
        return len(self.response) + len(self.history)

    def messages(self) -> list[dict[str, Any]]:
        return msgspec.json.decode(self.history)


class ResponseStore:
    """At most `max_entries` responses of at most `max_bytes` in all; 0 entries keeps none."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, response_id: str, response: bytes, history: list[dict[str, Any]]) -> bool:
        """Keep a response (evicting the least recently used ones to make room); False when it
        alone exceeds the store's bytes (or the store keeps none): it is not kept."""
        entry = StoredResponse(response, msgspec.json.encode(history))
        self.delete(response_id)
        if self.max_entries == 0 or entry.size > self.max_bytes:
            return False
        while self._entries and (len(self._entries) >= self.max_entries or self._bytes + entry.size > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size
        self._entries[response_id] = entry
        self._bytes += entry.size
        return True

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """A stored response (now the most recently used); a 404 naming `param` otherwise."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise HttpError("not_found", f"no stored response has the id {response_id!r} (never stored, deleted, or evicted)", param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
