"""Inbox of the KV cache store actor: reservations, usage reports, statistics.

The store decides whether a request's KV fits and keeps the byte accounting;
the arrays themselves live on the MLX thread, addressed by request id.
"""

from __future__ import annotations

import msgspec

from protocols.api import GenerateRequest
from protocols.base import Message, Record, Reply
from protocols.model import CheckpointData, DeviceMemory, DiskPrefix, KvPool, SavedPrefix, VisionPrompt
from protocols.scheduler import CheckpointWritten, PrefixLoaded


class KvReservation(Record, frozen=True):
    request_id: str
    granted: bool
    # Why not, when not granted: "never_fits", "no_room", or "loading" (a longer prefix is being
    # read from the disk tier; the asker hears `PrefixLoaded` when it can ask again).
    reason: str | None = None
    # A saved prefix to start from (pinned until `UnpinPrefix`), and how many of its tokens.
    prefix_entry: str | None = None
    prefix_tokens: int = 0
    # Or KV read back from the disk tier.
    disk_prefix: DiskPrefix | None = None


class DiskStats(Record, frozen=True):
    """The prefix cache's disk tier (`kv.disk_cache_dir`)."""

    directory: str
    entries: int
    bytes: int
    capacity_bytes: int
    # Whether entries are written (false: a read-only directory, or writes paused after a
    # failure such as a full disk; `error` says which).
    writable: bool
    # Admitted requests seeded from disk, and the tokens they did not prefill; lookups that
    # found nothing longer on disk than in RAM; seconds spent reading (and checking) files.
    hits: int = 0
    tokens_loaded: int = 0
    misses: int = 0
    load_s: float = 0.0
    # Files written and their bytes, writes that failed, entries not written because the
    # write queue was full, files evicted (LRU), files found damaged or foreign and removed;
    # seconds the MLX thread spent copying entries out between steps (`export_s`) and seconds
    # the writer's worker threads spent hashing and writing files (`write_s`): what writing
    # through costs the steps, and the CPU it competes for.
    writes: int = 0
    bytes_written: int = 0
    write_failures: int = 0
    writes_skipped: int = 0
    evicted: int = 0
    removed_damaged: int = 0
    export_s: float = 0.0
    write_s: float = 0.0
    error: str | None = None


class KvStats(Record, frozen=True):
    live_requests: int
    live_tokens: int
    live_bytes: int
    reserved_tokens: int
    physical_bytes: int
    bytes_per_token: int
    budget_bytes: int | None
    prefix_entries: int = 0
    prefix_bytes: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    # Durable checkpoints: whether they can be written at all, and writes done and failed.
    checkpoints_available: bool = True
    checkpoints_written: int = 0
    checkpoints_failed: int = 0
    # The bytes the reservations stand for, by layer kind (windows bounded, states fixed).
    reserved_bytes: int = 0
    # Admitted requests that looked up a saved prefix, and the prompt tokens they looked up
    # (`prefix_tokens_reused` of which were found).
    prefix_queries: int = 0
    prefix_tokens_queried: int = 0
    # Resident LoRA adapters' stacks (counted against the budget).
    adapter_bytes: int = 0
    # The device's memory as MLX reports it after the latest step: in use (weights, KV, work
    # buffers), the peak since start, and freed buffers MLX keeps for reuse.
    device_active_bytes: int = 0
    device_peak_bytes: int = 0
    device_cache_bytes: int = 0
    # How KV is stored ("float", or e.g. "int8/g64/start0": `kv.bits`), and of physical_bytes
    # the quantized KV's (packed words, scales and biases; the rest is float).
    kv_format: str = "float"
    quantized_bytes: int = 0
    # Paged KV (`kv.block_size`): the block pool's figures; the most KV bytes held at once
    # (the engine's peak of `physical_bytes`).
    pool: KvPool | None = None
    peak_physical_bytes: int = 0
    # The disk tier, when `kv.disk_cache_dir` is set.
    disk: DiskStats | None = None


class ReserveKv(Message, frozen=True):
    """Reserve room for a request's prompt plus its whole generation, and look up
    the longest saved prefix of `prompt_ids` (at most `max_prefix_tokens`)."""

    request_id: str
    num_tokens: int
    reply: Reply[KvReservation]
    prompt_ids: list[int] = msgspec.field(default_factory=list)
    max_prefix_tokens: int = 0
    # The prefix cache's namespace of the request's LoRA adapter (`policies.adapters`): only
    # KV computed under it can seed the request.
    namespace: str | None = None
    # Told `PrefixLoaded` once a disk read this reservation started ends (it was "loading").
    notify: Reply[PrefixLoaded] | None = None


class UnpinPrefix(Message, frozen=True):
    """The request that looked this entry up has been admitted with it."""

    entry_id: str


class PrefixesSaved(Message, frozen=True):
    """The engine kept these requests' KV; index them (or have them dropped)."""

    entries: list[SavedPrefix]


class ReleaseKv(Message, frozen=True):
    """The request's caches are gone; forget its reservation and usage."""

    request_id: str
    # The request ended for good: its checkpoint (if any) is deleted.
    delete_checkpoint: bool = True


class SaveCheckpoint(Message, frozen=True):
    """Write a request's decode state durably (atomically replacing the previous one)."""

    request: GenerateRequest
    prompt_ids: list[int]
    seed: int
    max_tokens: int
    stop_token_ids: list[int]
    data: CheckpointData
    # An image prompt's digests and cache keys (recorded in the header; the images are not).
    vision: VisionPrompt | None = None
    # Told whether the write succeeded (a write superseded by a newer one is not reported).
    report: Reply[CheckpointWritten] | None = None


class ReportKvUsage(Message, frozen=True):
    """The engine's latest figures: KV tokens per live request, bytes overall."""

    live_tokens: dict[str, int]
    physical_bytes: int
    adapter_bytes: int = 0
    device: DeviceMemory | None = None
    quantized_bytes: int = 0
    pool: KvPool | None = None
    peak_physical_bytes: int = 0


class GetKvStats(Message, frozen=True):
    reply: Reply[KvStats]


class DrainFiles(Message, frozen=True):
    """Answer once every checkpoint write and delete asked for so far is done."""

    reply: Reply[bool]


KvInbox = ReserveKv | ReleaseKv | ReportKvUsage | GetKvStats | UnpinPrefix | PrefixesSaved | SaveCheckpoint | DrainFiles
