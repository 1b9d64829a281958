"""Tests for actors.kv_store: the KV ledger and the store actor."""

from __future__ import annotations

import subprocess
import sys
from contextlib import closing
from pathlib import Path

import anyio

# Imported first on purpose: importing actors.kv_store before the runtime package
# fails with a circular import (see test_actor_module_imports_on_its_own).
import runtime  # noqa: F401
from actors.kv_store import KvStoreActor
from actors.mailbox import ask
from policies.ledger import KvLedger
from protocols.kv import GetKvStats, KvReservation, KvStats, ReleaseKv, ReportKvUsage, ReserveKv

# -- KvLedger ------------------------------------------------------------------------


def test_grant_within_budget():
    ledger = KvLedger(bytes_per_token=10, budget_bytes=1000)
    assert ledger.reserve("a", 60)[0] == KvReservation(request_id="a", granted=True)
    assert ledger.reserve("b", 40)[0] == KvReservation(request_id="b", granted=True)  # exactly the budget
    assert ledger.stats().reserved_tokens == 100


def test_never_fits_when_one_request_exceeds_the_budget():
    ledger = KvLedger(bytes_per_token=10, budget_bytes=1000)
    assert ledger.reserve("big", 101)[0] == KvReservation(request_id="big", granted=False, reason="never_fits")
    assert ledger.stats().reserved_tokens == 0
    # Even with the ledger empty, it does not fit: the reason is not "no_room".
    assert ledger.reserve("big", 101)[0].reason == "never_fits"


def test_no_room_then_granted_after_release():
    ledger = KvLedger(bytes_per_token=10, budget_bytes=1000)
    assert ledger.reserve("a", 70)[0].granted
    assert ledger.reserve("b", 31)[0] == KvReservation(request_id="b", granted=False, reason="no_room")
    assert ledger.stats().reserved_tokens == 70
    ledger.release("a")
    assert ledger.reserve("b", 31)[0] == KvReservation(request_id="b", granted=True)
    assert ledger.stats().reserved_tokens == 31


def test_zero_budget_is_unlimited():
    ledger = KvLedger(bytes_per_token=1 << 20, budget_bytes=0)
    for i in range(5):
        assert ledger.reserve(f"r{i}", 10**9)[0].granted
    stats = ledger.stats()
    assert stats.reserved_tokens == 5 * 10**9
    assert stats.budget_bytes is None


def test_record_usage_and_stats():
    ledger = KvLedger(bytes_per_token=64, budget_bytes=1 << 20)
    ledger.reserve("a", 100)[0]
    ledger.reserve("b", 50)[0]
    ledger.record_usage({"a": 30, "b": 12}, physical_bytes=9000)
    assert ledger.stats() == KvStats(
        live_requests=2,
        live_tokens=42,
        live_bytes=42 * 64,
        reserved_tokens=150,
        physical_bytes=9000,
        bytes_per_token=64,
        budget_bytes=1 << 20,
        reserved_bytes=150 * 64,
        peak_physical_bytes=9000,
    )
    # A report replaces the previous one rather than adding to it (the peak stays).
    ledger.record_usage({"a": 31}, physical_bytes=5000)
    stats = ledger.stats()
    assert (stats.live_requests, stats.live_tokens, stats.live_bytes, stats.physical_bytes) == (1, 31, 31 * 64, 5000)
    assert stats.peak_physical_bytes == 9000


def test_record_usage_copies_its_input():
    ledger = KvLedger(bytes_per_token=2)
    live = {"a": 5}
    ledger.record_usage(live, physical_bytes=10)
    live["b"] = 100
    assert ledger.stats().live_tokens == 5


def test_release_forgets_reservation_and_usage_and_is_idempotent():
    ledger = KvLedger(bytes_per_token=8, budget_bytes=800)
    ledger.reserve("a", 40)[0]
    ledger.reserve("b", 40)[0]
    ledger.record_usage({"a": 10, "b": 20}, physical_bytes=240)
    ledger.release("a")
    after_once = ledger.stats()
    assert (after_once.reserved_tokens, after_once.live_requests, after_once.live_tokens) == (40, 1, 20)
    ledger.release("a")
    ledger.release("never-seen")
    assert ledger.stats() == after_once


def test_empty_stats():
    assert KvLedger(bytes_per_token=4, budget_bytes=0).stats() == KvStats(
        live_requests=0,
        live_tokens=0,
        live_bytes=0,
        reserved_tokens=0,
        physical_bytes=0,
        bytes_per_token=4,
        budget_bytes=None,
    )


# -- KvStoreActor ------------------------------------------------------------------


async def test_kv_store_actor_through_its_inbox():
    actor = KvStoreActor(KvLedger(bytes_per_token=16, budget_bytes=16 * 100), capacity=8)
    with closing(actor.inbox), anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)

            granted = await ask(actor.inbox, ReserveKv, request_id="a", num_tokens=60)
            assert granted == KvReservation(request_id="a", granted=True)
            refused = await ask(actor.inbox, ReserveKv, request_id="b", num_tokens=60)
            assert refused == KvReservation(request_id="b", granted=False, reason="no_room")
            too_big = await ask(actor.inbox, ReserveKv, request_id="c", num_tokens=101)
            assert too_big.reason == "never_fits"

            await actor.inbox.send(ReportKvUsage(live_tokens={"a": 25}, physical_bytes=1234))
            stats = await ask(actor.inbox, GetKvStats)
            assert (stats.reserved_tokens, stats.live_tokens, stats.live_bytes) == (60, 25, 25 * 16)
            assert (stats.physical_bytes, stats.budget_bytes) == (1234, 1600)

            await actor.inbox.send(ReleaseKv(request_id="a"))
            stats = await ask(actor.inbox, GetKvStats)
            assert (stats.reserved_tokens, stats.live_requests, stats.live_tokens) == (0, 0, 0)
            granted = await ask(actor.inbox, ReserveKv, request_id="b", num_tokens=60)
            assert granted.granted

            tg.cancel_scope.cancel()


# -- import hygiene -----------------------------------------------------------------


def test_actor_module_imports_on_its_own():
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", "import actors.kv_store"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_prefixes_are_not_evicted_when_that_cannot_make_room():
    from protocols.model import SavedPrefix

    ledger = KvLedger(bytes_per_token=1, budget_bytes=100, prefix_cache_bytes=100, prefix_min_tokens=1)
    assert ledger.save_prefixes([SavedPrefix(entry_id="p", tokens=[1, 2, 3], num_bytes=30)]) == []
    assert ledger.reserve("a", 60)[0].granted
    # 60 reserved + 50 needed > 100 even with an empty prefix cache: nothing is evicted.
    reservation, evicted = ledger.reserve("b", 50)
    assert reservation.reason == "no_room" and evicted == [] and len(ledger.prefixes) == 1
    # 60 + 30 + 10 fits exactly; 60 + 30 + 20 fits only without the prefix, which then goes.
    reservation, evicted = ledger.reserve("c", 20)
    assert reservation.granted and evicted == ["p"]


def test_a_request_never_evicts_the_prefix_it_starts_from():
    from protocols.model import SavedPrefix

    ledger = KvLedger(bytes_per_token=1, budget_bytes=100, prefix_cache_bytes=100, prefix_min_tokens=1)
    ledger.save_prefixes([SavedPrefix(entry_id="p", tokens=[1, 2, 3, 4], num_bytes=40)])
    reservation, evicted = ledger.reserve("a", 70, prompt_ids=[1, 2, 3, 4, 5], max_prefix_tokens=4)
    # Evicting "p" would make room, but "a" needs it: it waits instead.
    assert reservation.reason == "no_room" and evicted == [] and "p" in ledger.prefixes
    ledger.unpin("p")


async def test_ending_deletes_a_checkpoint_written_by_an_earlier_process(tmp_path):
    """A resumed request may end before writing a checkpoint of its own; its old file goes too."""
    import anyio

    from actors.kv_store import KvStoreActor
    from actors.mailbox import ask
    from protocols.kv import DrainFiles, ReleaseKv
    from runtime import checkpoints

    checkpoints.write_atomic(tmp_path, "old", b"bytes from a previous run")
    store = checkpoints.CheckpointStore(tmp_path, model_id="m", tokenizer_id="t")
    actor = KvStoreActor(KvLedger(bytes_per_token=1), checkpoints=store, max_age_s=3600)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        await actor.inbox.send(ReleaseKv(request_id="kept", delete_checkpoint=False))
        await actor.inbox.send(ReleaseKv(request_id="old", delete_checkpoint=True))
        assert await ask(actor.inbox, DrainFiles)
        assert not checkpoints.path_for(tmp_path, "old").exists()
        tg.cancel_scope.cancel()
