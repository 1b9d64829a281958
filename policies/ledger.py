"""The KV budget's ledger: reservations and prefix entries against one byte budget.

Pure decisions (no anyio, no mlx), driven by the KV store actor: whether a request's
prompt plus generation fits, which saved prefix it starts from (pinned until it is
admitted), which prefix entries to evict for room, and the figures `KvStats` reports.

With paged KV (`kv.block_size`) the figures are the pool's blocks: a request reserves the
blocks its prompt plus generation fill, less the full blocks of the prefix entry it starts
from, which it shares (the entry counts them, and stays while the request runs); an entry
kept from a request that shares another's blocks counts only its own, and keeps that
parent while it is kept. So reserved plus prefix bytes are what the pool holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.layout import is_trimmable, kv_block_size, kv_format, paged_block_bytes, request_bytes
from policies.prefix_index import PrefixIndex
from protocols.kv import KvReservation, KvStats
from protocols.model import DeviceMemory, KvPool, LayerLayout, SavedPrefix


class KvLedger:
    """Reservations and prefix entries against one byte budget (0 = unlimited)."""

    def __init__(
        self,
        *,
        bytes_per_token: int,
        budget_bytes: int = 0,
        prefix_cache_bytes: int = 0,
        prefix_min_tokens: int = 1,
        layers: Sequence[LayerLayout] | None = None,
    ):
        self.bytes_per_token = bytes_per_token
        # The model's layers, when not all are full attention: windows are bounded, states fixed,
        # and a saved prefix seeds a request only whole (neither can be cut back).
        self.layers = list(layers) if layers is not None else None
        self.whole_entries = layers is not None and not is_trimmable(layers)
        self.budget_bytes = budget_bytes
        self.prefix_cache_bytes = prefix_cache_bytes
        self.prefix_min_tokens = prefix_min_tokens
        self.prefixes = PrefixIndex()
        self._reserved: dict[str, int] = {}
        # Paged KV: block size, one block's bytes over the paged layers, each request's shared
        # blocks and the entry they are held from, and each kept entry's parent.
        self.block_size = kv_block_size(self.layers) if self.layers is not None else 0
        self.block_bytes = paged_block_bytes(self.layers) if self.layers is not None else 0
        self._shared: dict[str, tuple[str, int]] = {}
        self._parents: dict[str, str] = {}
        self._pool: KvPool | None = None
        self._peak_physical = 0
        self._live_tokens: dict[str, int] = {}
        self._physical_bytes = 0
        self._quantized_bytes = 0
        # Resident LoRA adapters' stacks: device memory the budget covers too.
        self.adapter_bytes = 0
        self._device = DeviceMemory()
        self._hits = 0
        self._tokens_reused = 0
        self._queries = 0
        self._tokens_queried = 0

    def request_bytes(self, num_tokens: int) -> int:
        """The KV bytes a request of `num_tokens` tokens holds."""
        return request_bytes(self.layers, num_tokens) if self.layers is not None else num_tokens * self.bytes_per_token

    @property
    def reserved_bytes(self) -> int:
        shared = sum(blocks for _, blocks in self._shared.values()) * self.block_bytes
        return sum(self.request_bytes(n) for n in self._reserved.values()) - shared

    def match_length(self, prompt_ids: Sequence[int], max_prefix_tokens: int, namespace: str | None = None) -> int:
        """How many of the prompt's first tokens a saved prefix holds (nothing pinned)."""
        if max_prefix_tokens <= 0:
            return 0
        match = self.prefixes.lookup(prompt_ids, max_prefix_tokens, whole=self.whole_entries, namespace=namespace)
        return match.num_tokens if match is not None else 0

    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        prompt_ids: Sequence[int] = (),
        max_prefix_tokens: int = 0,
        namespace: str | None = None,
        *,
        use_prefixes: bool = True,
    ) -> tuple[KvReservation, list[str]]:
        """A reservation, and the prefix entries evicted to make room for it.

        The request's own prefix match (KV of its adapter) is pinned before anything is
        evicted, and entries are evicted only when that makes the request fit. Without
        `use_prefixes` (it starts from KV read from disk) no saved prefix is looked up.
        """
        need = self.request_bytes(num_tokens)
        if self.budget_bytes and need + self.adapter_bytes > self.budget_bytes:
            return KvReservation(request_id=request_id, granted=False, reason="never_fits"), []
        wanted = max_prefix_tokens > 0 and use_prefixes
        match = self.prefixes.lookup(prompt_ids, max_prefix_tokens, whole=self.whole_entries, namespace=namespace) if wanted else None
        if match is not None:
            self.prefixes.pin(match.entry_id)
        shared = match.num_tokens // self.block_size if match is not None and self.block_size else 0
        need -= shared * self.block_bytes
        evicted = []
        if self.budget_bytes:
            held = self.reserved_bytes + self.adapter_bytes
            over = held + self.prefixes.num_bytes + need - self.budget_bytes
            if over > 0 and held + need <= self.budget_bytes:
                evicted = self._evict(over)
            if held + self.prefixes.num_bytes + need > self.budget_bytes:
                if match is not None:
                    self.prefixes.unpin(match.entry_id)
                return KvReservation(request_id=request_id, granted=False, reason="no_room"), evicted
        self._reserved[request_id] = num_tokens
        if match is not None and shared:
            self.prefixes.pin(match.entry_id)  # the shared blocks stay while the request runs
            self._shared[request_id] = (match.entry_id, shared)
        if max_prefix_tokens > 0:
            # Counted once per admitted request (a request waiting for room asks again).
            self._queries += 1
            self._tokens_queried += len(prompt_ids)
        if match is None:
            return KvReservation(request_id=request_id, granted=True), evicted
        self._hits += 1
        self._tokens_reused += match.num_tokens
        return KvReservation(request_id=request_id, granted=True, prefix_entry=match.entry_id, prefix_tokens=match.num_tokens), evicted

    def release(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)
        self._live_tokens.pop(request_id, None)
        held = self._shared.pop(request_id, None)
        if held is not None:
            self.prefixes.unpin(held[0])

    def unpin(self, entry_id: str) -> None:
        self.prefixes.unpin(entry_id)

    def save_prefixes(self, entries: list[SavedPrefix]) -> list[str]:
        """Index what is worth keeping; returns the entry ids the engine should drop."""
        dropped = []
        for entry in entries:
            keep = self.prefix_cache_bytes > 0 and len(entry.tokens) >= self.prefix_min_tokens
            # Shared blocks whose parent is gone are this entry's to count.
            parent = entry.parent if entry.parent is not None and entry.parent in self.prefixes else None
            num_bytes = entry.num_bytes + (entry.shared_bytes if parent is None else 0)
            if not (keep and self.prefixes.insert(entry.entry_id, entry.tokens, num_bytes, whole=self.whole_entries, namespace=entry.adapter)):
                dropped.append(entry.entry_id)
            elif parent is not None:
                self.prefixes.pin(parent)
                self._parents[entry.entry_id] = parent
        over_cap = self.prefixes.num_bytes - self.prefix_cache_bytes
        if over_cap > 0:
            dropped += self._evict(over_cap)
        return dropped + self._make_room(0)

    def record_usage(
        self,
        live_tokens: dict[str, int],
        physical_bytes: int,
        adapter_bytes: int = 0,
        device: DeviceMemory | None = None,
        quantized_bytes: int = 0,
        pool: KvPool | None = None,
        peak_bytes: int = 0,
    ) -> list[str]:
        """The engine's figures after a step; returns prefix entries to drop when adapters
        loaded since take room the budget needs."""
        self._live_tokens = dict(live_tokens)
        self._pool = pool or self._pool
        self._peak_physical = max(self._peak_physical, peak_bytes, physical_bytes)
        self._physical_bytes = physical_bytes
        self._quantized_bytes = quantized_bytes
        self._device = device or self._device
        grew = adapter_bytes > self.adapter_bytes
        self.adapter_bytes = adapter_bytes
        return self._make_room(0) if grew else []

    def stats(self, **checkpoint_figures) -> KvStats:
        live = sum(self._live_tokens.values())
        return KvStats(
            live_requests=len(self._live_tokens),
            live_tokens=live,
            live_bytes=sum(self.request_bytes(n) for n in self._live_tokens.values()),
            reserved_tokens=sum(self._reserved.values()),
            reserved_bytes=self.reserved_bytes,
            physical_bytes=self._physical_bytes,
            kv_format=kv_format(self.layers) if self.layers is not None else "float",
            quantized_bytes=self._quantized_bytes,
            bytes_per_token=self.bytes_per_token,
            budget_bytes=self.budget_bytes or None,
            adapter_bytes=self.adapter_bytes,
            device_active_bytes=self._device.active,
            device_peak_bytes=self._device.peak,
            device_cache_bytes=self._device.cache,
            prefix_entries=len(self.prefixes),
            prefix_bytes=self.prefixes.num_bytes,
            prefix_hits=self._hits,
            prefix_tokens_reused=self._tokens_reused,
            prefix_queries=self._queries,
            prefix_tokens_queried=self._tokens_queried,
            pool=self._pool,
            peak_physical_bytes=self._peak_physical,
            **checkpoint_figures,
        )

    def _make_room(self, need: int) -> list[str]:
        if not self.budget_bytes:
            return []
        over = self.reserved_bytes + self.adapter_bytes + self.prefixes.num_bytes + need - self.budget_bytes
        return self._evict(over) if over > 0 else []

    def _evict(self, num_bytes: int) -> list[str]:
        """Least recently used entries totalling `num_bytes`; an evicted entry lets go of its
        parent, which may then go too."""
        evicted: list[str] = []
        while num_bytes > 0:
            before = self.prefixes.num_bytes
            chosen = self.prefixes.evict(num_bytes)
            if not chosen:
                break
            evicted += chosen
            num_bytes -= before - self.prefixes.num_bytes
            for entry_id in chosen:
                parent = self._parents.pop(entry_id, None)
                if parent is not None:
                    self.prefixes.unpin(parent)
        return evicted
