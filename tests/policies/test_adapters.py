"""Adapter decisions: slots for distinct adapters, prefix namespaces, the budget's share."""

from __future__ import annotations

from policies.adapters import AdapterRegistry, AdapterSlots, adapter_digest, digest_of, prefix_namespace
from policies.ledger import KvLedger
from policies.prefix_index import PrefixIndex
from protocols.api import AdapterInfo
from protocols.model import SavedPrefix


def test_a_new_adapter_waits_for_a_slot_but_held_ones_and_base_rows_do_not():
    slots = AdapterSlots(max_resident=2)
    assert slots.allows(None, ["A", "B", "C"]), "base rows never wait for an adapter slot"
    assert slots.allows("A", ["A", "B", None])
    assert not slots.allows("C", ["A", "B", None, "A"])
    assert slots.allows("C", ["A", None, None])
    # A pinned adapter holds its slot even when no request uses it.
    registry = AdapterRegistry([AdapterInfo(name="P", path="/p", pinned=True), AdapterInfo(name="Q", path="/q")])
    pinned = AdapterSlots(max_resident=2, registry=registry)
    assert pinned.allows("A", []) and pinned.allows("P", ["A"])
    assert not pinned.allows("B", ["A"])


def test_prefixes_are_found_only_under_their_own_adapter():
    index = PrefixIndex()
    a, b = prefix_namespace("A", "d1"), prefix_namespace("A", "d2")
    assert prefix_namespace(None, "") is None and a != b
    assert index.insert("base", [1, 2, 3, 4], 10)
    assert index.insert("a", [1, 2, 3, 4], 10, namespace=a), "the same tokens under an adapter are other KV"
    assert index.lookup([1, 2, 3, 4, 5], 4).entry_id == "base"
    assert index.lookup([1, 2, 3, 4, 5], 4, namespace=a).entry_id == "a"
    assert index.lookup([1, 2, 3, 4, 5], 4, namespace=b) is None, "reloaded weights are another adapter"
    index.remove("a")
    assert index.lookup([1, 2, 3], 3, namespace=a) is None
    assert index.lookup([1, 2, 3], 3).entry_id == "base"


def test_adapter_bytes_count_against_the_kv_budget():
    ledger = KvLedger(bytes_per_token=10, budget_bytes=1000, prefix_cache_bytes=1000)
    assert ledger.save_prefixes([]) == []
    granted, _ = ledger.reserve("r1", 50)
    assert granted.granted
    ledger.release("r1")
    ledger.record_usage({}, 0, adapter_bytes=600)
    refused, _ = ledger.reserve("r2", 50)
    assert not refused.granted and refused.reason == "never_fits"
    assert ledger.stats().adapter_bytes == 600


def test_an_adapter_loaded_later_evicts_prefixes_for_room():
    ledger = KvLedger(bytes_per_token=10, budget_bytes=1000, prefix_cache_bytes=1000)
    assert ledger.save_prefixes([SavedPrefix(entry_id="p", tokens=[1, 2, 3], num_bytes=500)]) == []
    assert ledger.record_usage({}, 500, adapter_bytes=400) == []
    assert ledger.record_usage({}, 500, adapter_bytes=700) == ["p"]
    assert ledger.stats().prefix_entries == 0


def test_the_digest_follows_the_files(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapters.safetensors").write_bytes(b"x" * 10)
    first = adapter_digest(tmp_path)
    (tmp_path / "adapters.safetensors").write_bytes(b"y" * 10)
    assert adapter_digest(tmp_path) != first


def test_the_digest_of_bytes_read_is_the_files_digest(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapters.safetensors").write_bytes(b"x" * 10)
    assert digest_of(b"{}", b"x" * 10) == adapter_digest(tmp_path)
    assert digest_of(b"{}x", b"x" * 9) != adapter_digest(tmp_path)
