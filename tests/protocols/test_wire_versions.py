"""`protocols.wire`'s version table: what each supported version's client decodes."""

from __future__ import annotations

import msgspec

from protocols.api import AdapterInfo, TokenDelta
from protocols.kv import KvStats
from protocols.metrics import MetricsSnapshot
from protocols.scheduler import SchedulerStats
from protocols.stats import Stats
from protocols.wire import PROTOCOL_VERSION, SUPPORTED_PROTOCOL_VERSIONS, Error, ServerMessage, StatsV1, for_version

STATS = Stats(
    scheduler=SchedulerStats(waiting=0, prefilling=0, decoding=0, steps=3, num_finished=1),
    kv=KvStats(live_requests=0, live_tokens=0, live_bytes=0, reserved_tokens=0, physical_bytes=0, bytes_per_token=1, budget_bytes=None),
    live_requests=0,
    metrics=MetricsSnapshot(model_name="m"),
    adapters=[AdapterInfo(name="a", path="/x")],
    connections=2,
)


def test_the_newest_version_is_the_last_supported_one():
    assert PROTOCOL_VERSION == SUPPORTED_PROTOCOL_VERSIONS[-1] == 2
    assert list(SUPPORTED_PROTOCOL_VERSIONS) == sorted(set(SUPPORTED_PROTOCOL_VERSIONS))


def test_version_1_gets_stats_without_adapters_under_the_same_tag():
    encoded = msgspec.msgpack.encode(for_version(STATS, 1))
    plain = msgspec.msgpack.decode(encoded)
    assert plain["type"] == "Stats" and "adapters" not in plain and plain["connections"] == 2
    assert msgspec.msgpack.decode(encoded, type=StatsV1).scheduler.steps == 3  # what a version-1 client decodes


def test_the_newest_version_gets_messages_unchanged_and_version_1_the_same_bytes_where_nothing_was_added():
    assert for_version(STATS, PROTOCOL_VERSION) is STATS
    delta = TokenDelta(request_id="r", token_ids=[1], text="x")
    assert for_version(delta, PROTOCOL_VERSION) is delta
    without_new = {k: v for k, v in msgspec.to_builtins(delta).items() if k != "prompt_logprobs"}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(for_version(delta, 1))) == without_new


def test_an_error_without_supported_versions_keeps_its_old_shape():
    """Older clients decode Error strictly: the new field is on the wire only when set."""
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(Error(code="busy", message="m")))
    assert set(plain) == {"type", "code", "message", "request_id", "field"}
    refusal = Error(code="protocol_error", message="m", supported_versions=[1, 2])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(refusal), type=ServerMessage)
    assert isinstance(decoded, Error) and decoded.supported_versions == [1, 2]
