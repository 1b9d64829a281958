"""Version-1 connections get only version 1's fields: a client written for version 1 that refuses
unknown fields (as `protocols.base.Message` does) decodes every message a newer server sends it,
however many fields were added since; version 2 gets them all (new fields are optional)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from protocols.api import AdapterInfo, Finished, TokenDelta, TokenLogprob, ToolCall, TopLogprob, Usage
from protocols.kv import DiskStats, KvStats
from protocols.metrics import MetricsSnapshot
from protocols.scheduler import SchedulerStats
from protocols.stats import Stats
from protocols.wire import ServerMessage, StatsV1, Welcome, for_version
from protocols.wire_v1 import V1_FIELDS

LOGPROB = TokenLogprob(token_id=1, logprob=-0.5, top=[TopLogprob(token_id=2, logprob=-1.0)], rank=3)
# Each message with the fields added since version 1 set.
ADDED = {
    "TokenDelta": TokenDelta(request_id="r", token_ids=[1], text="x", logprobs=[LOGPROB], prompt_logprobs=[LOGPROB]),
    "ToolCall": ToolCall(request_id="r", index=0, id="c", name="f", arguments="{", truncated=True),
    "Finished": Finished(request_id="r", finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=2), denoising_steps=7),
}


def _strict_v1(name: str) -> type[msgspec.Struct]:
    """A struct of version 1's `name` that refuses unknown fields (nested values taken as they come)."""
    tag = "Stats" if name == "StatsV1" else name
    fields: list[Any] = [(field, Any) for field in V1_FIELDS[name]]
    return msgspec.defstruct(name, fields, kw_only=True, forbid_unknown_fields=True, tag=tag)


def _keys_within_v1(value: Any, name: str, shown: Any) -> None:
    """Every map `shown` holds for a struct of `value` has only version 1's fields, at any depth."""
    if isinstance(value, msgspec.Struct):
        allowed = set(V1_FIELDS.get(type(value).__name__, ())) | {"type"}
        assert set(shown) <= allowed, (name, set(shown) - allowed)
        for field in msgspec.structs.fields(value):
            if field.encode_name in shown:
                _keys_within_v1(getattr(value, field.name), f"{name}.{field.name}", shown[field.encode_name])
    elif isinstance(value, list):
        for item, item_shown in zip(value, shown, strict=True):
            _keys_within_v1(item, name, item_shown)


@pytest.mark.parametrize("name", sorted(ADDED))
def test_a_strict_version_1_client_decodes_messages_with_fields_added_since(name):
    message = ADDED[name]
    encoded = msgspec.msgpack.encode(for_version(message, 1))
    with pytest.raises(msgspec.ValidationError, match="unknown field"):  # what the full shape does to it
        msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=_strict_v1(name))
    msgspec.msgpack.decode(encoded, type=_strict_v1(name))
    _keys_within_v1(message, name, msgspec.msgpack.decode(encoded))
    # Version 2 gets every field, and its decoder reads the message back whole.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(for_version(message, 2)), type=ServerMessage) == message


def test_version_1_stats_leave_out_what_stats_gained_at_any_depth():
    kv = KvStats(
        live_requests=0,
        live_tokens=0,
        live_bytes=0,
        reserved_tokens=0,
        physical_bytes=0,
        bytes_per_token=1,
        budget_bytes=None,
        disk=DiskStats(directory="/d", entries=1, bytes=2, capacity_bytes=3, writable=True),
    )
    scheduler = SchedulerStats(waiting=0, prefilling=0, decoding=0, steps=1, num_finished=0)
    metrics = MetricsSnapshot(model_name="m")
    stats = Stats(scheduler=scheduler, kv=kv, live_requests=0, connections=1, metrics=metrics, adapters=[AdapterInfo(name="a", path="/x")])
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(for_version(stats, 1)))
    assert plain["type"] == "Stats" and "adapters" not in plain and "disk" not in plain["kv"]
    _keys_within_v1(StatsV1(scheduler=stats.scheduler, kv=kv, live_requests=0, connections=1, metrics=stats.metrics), "StatsV1", plain)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(for_version(stats, 1)), type=StatsV1)
    assert decoded.kv.disk is None and decoded.connections == 1
    assert "disk" in msgspec.msgpack.decode(msgspec.msgpack.encode(for_version(stats, 2)))["kv"]


def test_every_version_1_field_is_still_sent_so_the_table_only_ever_removes_new_ones():
    """A field version 1 had must never go (its clients may require it): each struct of the table
    that still exists has all its version-1 fields, as encoded."""
    import protocols.api as api
    import protocols.kv as kv
    import protocols.metrics as metrics
    import protocols.model as model
    import protocols.scheduler as scheduler
    import protocols.wire as wire

    modules = (api, kv, metrics, model, scheduler, wire)
    found = {name: next((getattr(m, name) for m in modules if hasattr(m, name)), None) for name in V1_FIELDS}
    assert {name for name, cls in found.items() if cls is None} == set()
    for name, cls in found.items():
        encoded = {field.encode_name for field in msgspec.structs.fields(cls)}
        assert set(V1_FIELDS[name]) <= encoded, (name, set(V1_FIELDS[name]) - encoded)
    welcome_fields = {field.encode_name for field in msgspec.structs.fields(Welcome)}
    assert welcome_fields == set(V1_FIELDS["Welcome"])
