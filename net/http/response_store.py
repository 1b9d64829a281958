"""The Responses API's store: responses kept (`store: true`) for `previous_response_id` and for
`GET`/`DELETE /v1/responses/{id}`, in memory, bounded by count and bytes (`server.responses_store_max`,
`server.responses_store_bytes`), the least recently used going first. With several API keys, each
owner may hold at most a share of both bounds (`limits.max_response_store_share`): an owner over
its share loses its own oldest entries first, so one key's flood cannot evict another's responses.

Each entry holds the response object's JSON as it was answered and the conversation it ended
(its chat messages, the instructions excluded, its own output included), so a follow-up turn
renders the whole conversation again. Both are kept as JSON bytes: what an entry costs is
what it holds, and nothing a later request does can change it. An entry belongs to the API key
that made it (`owner`, a fingerprint of the key, never the key): to any other caller it does not
exist. Lost on restart. Pure data.
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from net.http.errors import HttpError
from protocols.config import LimitsConfig, ServerConfig

# Bytes an entry costs beyond its strings' contents: the entry object, its OrderedDict node and
# table slot, and the str/bytes object headers (about 230 measured with tracemalloc on CPython 3.11).
ENTRY_OVERHEAD = 256


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_id: str
    # The response object's JSON.
    response: bytes
    # The conversation up to and including this response's output, as chat messages (JSON).
    history: bytes
    # The fingerprint of the API key that made it ("" when the server has no keys).
    owner: str = ""
    # Responses in its `previous_response_id` chain, itself included (1: it continued none).
    depth: int = 1

    @property
    def size(self) -> int:
        """What keeping it costs: every byte it holds, and the objects holding them."""
        return ENTRY_OVERHEAD + len(self.response_id.encode()) + len(self.owner.encode()) + len(self.response) + len(self.history)

    def messages(self) -> list[dict[str, Any]]:
        return msgspec.json.decode(self.history)


class ResponseStore:
    """At most `max_entries` responses of at most `max_bytes` in all (`StoredResponse.size`);
    0 entries keeps none. Each owner holds at most `owner_share` of each bound (at least one
    entry). Never over any bound, whatever is put."""

    def __init__(self, max_entries: int, max_bytes: int, *, owner_share: float = 1.0):
        if not 0 < owner_share <= 1:
            raise ValueError(f"owner_share must be in (0, 1], not {owner_share}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_owner_entries = max(1, int(max_entries * owner_share))
        self.max_owner_bytes = int(max_bytes * owner_share)
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        # Each owner's entry ids, least recently used first, and their bytes.
        self._owned: dict[str, OrderedDict[str, None]] = {}
        self._owner_bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def owner_bytes(self, owner: str) -> int:
        """Bytes `owner`'s entries hold."""
        return self._owner_bytes.get(owner, 0)

    def put(self, response_id: str, response: bytes, history: list[dict[str, Any]], *, owner: str = "", depth: int = 1) -> bool:
        """Keep a response, evicting first the owner's own least recently used ones while it is
        over its share, then the store's; False when it alone exceeds the owner's share of the
        bytes (or the store keeps none): it is not kept."""
        entry = StoredResponse(response_id, response, msgspec.json.encode(history), owner, depth)
        self._pop(response_id)
        if self.max_entries == 0 or entry.size > self.max_bytes or entry.size > self.max_owner_bytes:
            return False
        owned = self._owned.get(owner)
        while owned and (len(owned) >= self.max_owner_entries or self._owner_bytes[owner] + entry.size > self.max_owner_bytes):
            self._pop(next(iter(owned)))
        while self._entries and (len(self._entries) >= self.max_entries or self._bytes + entry.size > self.max_bytes):
            self._pop(next(iter(self._entries)))
        self._entries[response_id] = entry
        self._bytes += entry.size
        self._owned.setdefault(owner, OrderedDict())[response_id] = None
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + entry.size
        return True

    def get(self, response_id: str, param: str | None = None, *, owner: str = "") -> StoredResponse:
        """`owner`'s stored response (now the most recently used); a 404 naming `param` otherwise,
        the same whether the id is unknown or another owner's (no existence oracle)."""
        entry = self._entries.get(response_id)
        if entry is None or not hmac.compare_digest(entry.owner, owner):
            raise HttpError("not_found", f"no stored response has the id {response_id!r} (never stored, deleted, or evicted)", param)
        self._entries.move_to_end(response_id)
        self._owned[entry.owner].move_to_end(response_id)
        return entry

    def delete(self, response_id: str, *, owner: str = "") -> bool:
        """Forget `owner`'s response; False when it has none of that id."""
        entry = self._entries.get(response_id)
        if entry is None or not hmac.compare_digest(entry.owner, owner):
            return False
        return self._pop(response_id)

    def _pop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        owned = self._owned[entry.owner]
        del owned[response_id]
        self._owner_bytes[entry.owner] -= entry.size
        if not owned:  # (owners come and go with their entries)
            del self._owned[entry.owner], self._owner_bytes[entry.owner]
        return True


def server_store(server: ServerConfig, owner_share: float = LimitsConfig().max_response_store_share) -> ResponseStore:
    """The server's store; owners share it out only where several API keys store (one owner,
    or none, may use all of it)."""
    num_keys = len({key for key in (server.api_key, *server.api_keys) if key})
    share = owner_share if num_keys > 1 else 1.0
    return ResponseStore(server.responses_store_max, server.responses_store_bytes, owner_share=share)
