"""The KV store with a disk tier: reads answered "loading" then granted, write-through in order,
failures that pause writes, bounded exports. Files are faked in memory (`runtime.kv_files` has
its own tests); the model actor is a mailbox the test answers."""

from __future__ import annotations

import errno

import anyio
import numpy as np
import pytest

import runtime  # noqa: F401  (imported before actors.kv_store, as the runtime does)
from actors import disk_tier
from actors.disk_tier import DiskTier
from actors.kv_store import KvStoreActor
from actors.mailbox import Mailbox, ask
from policies.disk_index import DiskEntry, DiskIndex
from policies.ledger import KvLedger
from protocols.kv import DrainFiles, GetKvStats, PrefixesSaved, ReleaseKv, ReserveKv
from protocols.model import DropPrefixes, ExportPrefix, LayerLayout, PrefixExport, SavedPrefix
from protocols.scheduler import PrefixLoaded

C = 4
LAYERS = [LayerLayout(kind="full", heads=1, key_dim=2, value_dim=2, dtype="float32")]


@pytest.fixture
def model():
    """The model actor's inbox, as the KV store sees it."""
    with Mailbox(16) as inbox:
        yield inbox


class MemoryFiles:
    """DiskFiles in memory; reads wait for `release` when `hold` is set."""

    def __init__(self) -> None:
        self.directory = "memory"
        self.data: dict[str, tuple[list[int], dict]] = {}
        self.hold = False
        self.release = anyio.Event()
        self.fail_writes: OSError | None = None
        self.closed = False

    def read(self, entry: DiskEntry, tokens: list[int]) -> bytes:
        if self.hold:
            anyio.from_thread.run(self.release.wait)
        if entry.key not in self.data:
            raise FileNotFoundError(entry.key)
        stored, arrays = self.data[entry.key]
        if stored != tokens:
            raise ValueError("another entry")
        return arrays

    def write(self, entry: DiskEntry, tokens: list[int], arrays: dict) -> int:
        if self.fail_writes is not None:
            raise self.fail_writes
        self.data[entry.key] = (list(tokens), arrays)
        return 100

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self.data.pop(key, None)

    def touch(self, keys: list[str]) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _store(files: MemoryFiles, model: Mailbox) -> KvStoreActor:
    tier = DiskTier(files, DiskIndex(chunk=C, whole=False), LAYERS, capacity_bytes=10_000, min_tokens=C, writable=True)
    ledger = KvLedger(bytes_per_token=16, layers=LAYERS, prefix_cache_bytes=1 << 20, prefix_min_tokens=1)
    return KvStoreActor(ledger, model=model, disk=tier)


def _arrays(start: int, end: int) -> dict[str, np.ndarray]:
    """What the engine copies out of positions start:end of one layer (`LAYERS`): position i
    holds the value i."""
    positions = np.arange(start, end, dtype=np.float32)[None, None, :, None]
    return {name: np.broadcast_to(positions, (1, 1, end - start, 2)).copy() for name in ("0.keys", "0.values")}


async def _answer_exports(model: Mailbox, seen: list) -> None:
    """The model actor's part: copy out what is asked (fake arrays), record drops."""
    while True:
        message = await model.receive()
        seen.append(message)
        if isinstance(message, ExportPrefix):
            message.reply.send_nowait(PrefixExport(keys=message.keys, arrays=[_arrays(*span) for span in message.spans]))


async def _save(store: KvStoreActor, entry_id: str, tokens: list[int]) -> None:
    await store.inbox.send(PrefixesSaved(entries=[SavedPrefix(entry_id=entry_id, tokens=tokens, num_bytes=16 * len(tokens))]))
    await ask(store.inbox, DrainFiles)


async def test_entries_are_written_through_once_and_a_prompt_is_read_back_after_loading(model):
    files, seen = MemoryFiles(), []
    store = _store(files, model)
    notify_send, notify_receive = anyio.create_memory_object_stream[PrefixLoaded](4)
    async with anyio.create_task_group() as tg, notify_send, notify_receive:
        await tg.start(store.run)
        tg.start_soon(_answer_exports, model, seen)
        await _save(store, "a#1", list(range(10)))  # two whole chunks, and a tail that is not stored
        await _save(store, "b#1", [*range(8), 50, 51, 52, 53, 54])  # shares both chunks: one more
        exports = [m for m in seen if isinstance(m, ExportPrefix)]
        assert [(m.entry_id, m.spans) for m in exports] == [("a#1", [(0, 4), (4, 8)]), ("b#1", [(8, 12)])]
        # Copied out before anything could drop them.
        assert not any(isinstance(m, DropPrefixes) for m in seen)
        assert len(files.data) == 3
        # A new runtime's view: RAM holds nothing, the disk holds 12 positions of this prompt.
        store.ledger.prefixes = type(store.ledger.prefixes)()
        prompt = [*range(8), 50, 51, 52, 53, 99]
        ask_kw = {"request_id": "r", "num_tokens": 20, "prompt_ids": prompt, "max_prefix_tokens": len(prompt) - 1, "notify": notify_send}
        first = await ask(store.inbox, ReserveKv, **ask_kw)
        assert not first.granted and first.reason == "loading"
        assert await notify_receive.receive() == PrefixLoaded(request_id="r")
        granted = await ask(store.inbox, ReserveKv, **ask_kw)
        assert granted.granted and granted.prefix_entry is None
        prefix = granted.disk_prefix
        assert prefix.num_tokens == 12 and prefix.num_files == 3
        # The three chunks' positions, concatenated in order: a checkpoint's arrays.
        assert prefix.arrays["0.keys"].shape == (1, 1, 12, 2) and prefix.arrays["0.keys"][0, 0, :, 0].tolist() == list(range(12))
        stats = (await ask(store.inbox, GetKvStats)).disk
        assert stats.hits == 1 and stats.tokens_loaded == 12 and stats.writes == 3 and stats.entries == 3
        tg.cancel_scope.cancel()
    assert files.closed


async def test_a_read_whose_request_left_is_not_handed_to_a_later_one(model):
    files, seen = MemoryFiles(), []
    store = _store(files, model)
    notify_send, notify_receive = anyio.create_memory_object_stream[PrefixLoaded](4)
    async with anyio.create_task_group() as tg, notify_send, notify_receive:
        await tg.start(store.run)
        tg.start_soon(_answer_exports, model, seen)
        await _save(store, "a#1", list(range(9)))
        store.ledger.prefixes = type(store.ledger.prefixes)()
        files.hold = True
        prompt = list(range(9))
        ask_kw = {"request_id": "r", "num_tokens": 20, "prompt_ids": prompt, "max_prefix_tokens": 8, "notify": notify_send}
        assert (await ask(store.inbox, ReserveKv, **ask_kw)).reason == "loading"
        await store.inbox.send(ReleaseKv(request_id="r"))  # cancelled while its files are read
        # The same id again: a read of its own.
        assert (await ask(store.inbox, ReserveKv, **ask_kw)).reason == "loading"
        files.release.set()
        assert await notify_receive.receive() == PrefixLoaded(request_id="r")
        granted = await ask(store.inbox, ReserveKv, **ask_kw)
        assert granted.granted and granted.disk_prefix.num_tokens == 8
        tg.cancel_scope.cancel()


async def test_a_failed_write_pauses_writes_and_requests_go_on(model):
    files, seen = MemoryFiles(), []
    files.fail_writes = OSError(errno.ENOSPC, "No space left on device")
    store = _store(files, model)
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        tg.start_soon(_answer_exports, model, seen)
        await _save(store, "a#1", list(range(8)))
        stats = (await ask(store.inbox, GetKvStats)).disk
        assert stats.write_failures == 1 and not stats.writable and "No space" in stats.error
        await _save(store, "b#1", list(range(100, 108)))
        assert [m.entry_id for m in seen if isinstance(m, ExportPrefix)] == ["a#1"]  # paused: not copied out
        reservation = await ask(store.inbox, ReserveKv, request_id="r", num_tokens=20, prompt_ids=list(range(8)), max_prefix_tokens=7)
        assert reservation.granted and reservation.prefix_entry == "a#1"  # RAM still serves it
        tg.cancel_scope.cancel()


async def test_exports_in_flight_are_bounded(monkeypatch, model):
    monkeypatch.setattr(disk_tier, "MAX_EXPORTS", 2)
    files = MemoryFiles()
    store = _store(files, model)
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        for i in range(4):  # nobody answers the exports: they stay in flight
            await store.inbox.send(PrefixesSaved(entries=[SavedPrefix(entry_id=f"e#{i}", tokens=list(range(10 * i, 10 * i + 8)), num_bytes=1)]))
        stats = (await ask(store.inbox, GetKvStats)).disk
        assert stats.writes_skipped == 2
        sent = []
        while True:
            try:
                sent.append(model.receive_nowait())
            except anyio.WouldBlock:
                break
        assert [m.entry_id for m in sent if isinstance(m, ExportPrefix)] == ["e#0", "e#1"]
        tg.cancel_scope.cancel()


async def test_a_request_waiting_for_room_is_looked_up_on_disk_once(model):
    files = MemoryFiles()
    tier = DiskTier(files, DiskIndex(chunk=C, whole=False), LAYERS, capacity_bytes=10_000, min_tokens=C, writable=True)
    ledger = KvLedger(bytes_per_token=16, budget_bytes=16 * 24, layers=LAYERS, prefix_cache_bytes=1 << 10, prefix_min_tokens=1)
    store = KvStoreActor(ledger, model=model, disk=tier)
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        assert (await ask(store.inbox, ReserveKv, request_id="big", num_tokens=20, prompt_ids=list(range(8)), max_prefix_tokens=7)).granted
        for _ in range(3):  # no room while "big" holds the budget: asked again and again
            waiting = await ask(store.inbox, ReserveKv, request_id="w", num_tokens=20, prompt_ids=list(range(100, 108)), max_prefix_tokens=7)
            assert not waiting.granted and waiting.reason == "no_room"
        assert (await ask(store.inbox, GetKvStats)).disk.misses == 2  # "big" once, "w" once
        await store.inbox.send(ReleaseKv(request_id="big"))
        assert (await ask(store.inbox, ReserveKv, request_id="w", num_tokens=20, prompt_ids=list(range(100, 108)), max_prefix_tokens=7)).granted
        assert (await ask(store.inbox, GetKvStats)).disk.misses == 2
        tg.cancel_scope.cancel()


async def test_the_mlx_threads_copying_and_the_writes_are_timed(model):
    files = MemoryFiles()
    store = _store(files, model)

    async def answer_timed() -> None:
        while True:
            message = await model.receive()
            if isinstance(message, ExportPrefix):
                arrays = [_arrays(*span) for span in message.spans]
                message.reply.send_nowait(PrefixExport(keys=message.keys, arrays=arrays, export_s=0.25))

    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        tg.start_soon(answer_timed)
        await _save(store, "a#1", list(range(8)))
        await _save(store, "b#1", list(range(100, 104)))
        stats = (await ask(store.inbox, GetKvStats)).disk
        assert stats.writes == 3 and stats.export_s == pytest.approx(0.5)
        assert 0 < stats.write_s < 5
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("whole", [False, True])
def test_plan_export_skips_short_entries(whole):
    tier = DiskTier(MemoryFiles(), DiskIndex(chunk=C, whole=whole), LAYERS, capacity_bytes=1, min_tokens=6, writable=True)
    tier.close()
    assert tier.plan_export(SavedPrefix(entry_id="s", tokens=[1, 2, 3, 4, 5], num_bytes=1)) is None
    planned = tier.plan_export(SavedPrefix(entry_id="l", tokens=list(range(9)), num_bytes=1))
    assert planned is not None and planned.whole == whole
    assert planned.spans == ([(0, 9)] if whole else [(0, 4), (4, 8)])
