"""The Responses API's store under hostile clients: ids no one can guess (128 random bits), each
API key sees only its own responses (another key's id answers 404 exactly as an unknown one),
the store's bytes and count stay under their caps however it is flooded (its accounting covers
all an entry holds, shown on /metrics), and a `previous_response_id` chain too deep or too large
is refused typed before anything is rendered."""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections import Counter
from typing import Any

import msgspec
import openai
import pytest

from net.http import responses_api_types as ra
from net.http.app import Api, build_app
from net.http.errors import HttpError
from net.http.middleware import owner_fingerprint
from net.http.response_store import ResponseStore, StoredResponse, server_store
from net.http.responses_api import ResponsesOutput, new_id, responses_request
from protocols import Finished, TokenDelta
from protocols.api import ToolCall, Usage
from protocols.config import LimitsConfig, ServerConfig
from runtime.config import RuntimeConfig
from tests.support.config import make_config
from tests.support.http_serving import raw_request, serving

ID_HEX = 32  # 128 bits


def _random_part(item_id: str, prefix: str) -> str:
    assert item_id.startswith(prefix + "_"), item_id
    return item_id.removeprefix(prefix + "_")


def test_response_and_item_ids_are_128_random_bits_not_a_sequence():
    ids = [ResponsesOutput(msgspec.convert({"model": "m", "input": "x"}, ra.ResponsesRequest)).id for _ in range(256)]
    parts = [_random_part(i, "resp") for i in ids]
    assert len(set(ids)) == len(ids)
    assert all(len(p) == ID_HEX and set(p) <= set("0123456789abcdef") for p in parts)
    # Every hex digit varies (uuid4 fixes its version and variant digits: 122 bits, not 128).
    for position in range(ID_HEX):
        assert len(Counter(p[position] for p in parts)) >= 8, position
    # Not a counter: creation order is not the numeric order, and steps are not constant.
    numbers = [int(p, 16) for p in parts]
    assert numbers != sorted(numbers) and len({b - a for a, b in itertools.pairwise(numbers)}) > 200
    # Output items (message, function call, reasoning) the same.
    output = ResponsesOutput(msgspec.convert({"model": "m", "input": "x"}, ra.ResponsesRequest))
    output.on_event(TokenDelta(request_id="r", token_ids=[1], text="", reasoning="think"))
    output.on_event(TokenDelta(request_id="r", token_ids=[2], text="hi"))
    output.on_event(ToolCall(request_id="r", index=0, id="call_1", name="f", arguments="{}"))
    output.on_event(Finished(request_id="r", finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=3)))
    items = output.response().output
    assert [type(item) for item in items] == [ra.ReasoningOut, ra.MessageOut, ra.FunctionCallOut]
    for item, prefix in zip(items, ("rs", "msg", "fc")):
        assert len(_random_part(item.id, prefix)) == ID_HEX
    assert len({_random_part(new_id("msg"), "msg")[12] for _ in range(256)}) >= 8


# -- owners ------------------------------------------------------------------------


def test_the_store_answers_another_owners_response_exactly_as_an_unknown_one():
    store = ResponseStore(max_entries=4, max_bytes=1 << 20)
    alice, bob = owner_fingerprint(b"key-a"), owner_fingerprint(b"key-b")
    assert alice != bob and b"key-a" not in alice.encode() and len(alice) >= 32
    assert store.put("resp_1", b"{}", [{"role": "user", "content": "x"}], owner=alice)
    assert store.get("resp_1", owner=alice).response == b"{}"
    errors = []
    for call in (lambda: store.get("resp_1", "previous_response_id", owner=bob), lambda: store.get("resp_1", "previous_response_id")):
        with pytest.raises(HttpError) as info:
            call()
        errors.append((info.value.code, str(info.value), info.value.param))
    with pytest.raises(HttpError) as unknown:
        store.get("resp_2", "previous_response_id", owner=bob)
    expected = (unknown.value.code, str(unknown.value).replace("resp_2", "resp_1"), unknown.value.param)
    assert errors == [expected, expected] and expected[0] == "not_found"
    assert not store.delete("resp_1", owner=bob) and len(store) == 1
    assert store.delete("resp_1", owner=alice) and len(store) == 0


def test_several_api_keys_are_configured_as_a_list_in_a_file_or_the_environment():
    config = msgspec.convert({"api_key": "k0", "api_keys": ["k1", "k2"]}, ServerConfig)
    assert (config.api_key, config.api_keys) == ("k0", ["k1", "k2"]) and ServerConfig().api_keys == []
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"api_keys": [""]}, ServerConfig)
    loaded = RuntimeConfig.from_tree({"model": {"path": "builtin:tiny"}, "server": {"api_keys": ["a", "b"]}}, source="t")
    assert loaded.server.api_keys == ["a", "b"]
    from runtime.config import env_overrides

    assert env_overrides({"MLXRT_SERVER_API_KEYS": '["a", "b"]'}) == {"server.api_keys": ["a", "b"]}


async def _get(app, path: str, key: bytes | None) -> int:
    """The status `app` answers a GET of `path` with (bearer `key`), no server needed."""
    sent: list[dict] = []
    headers = [(b"host", b"localhost")] + ([(b"authorization", b"Bearer " + key)] if key is not None else [])
    scope: dict[str, Any] = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"", "headers": headers, "root_path": ""}
    scope |= {"scheme": "http", "server": ("localhost", 80), "client": ("127.0.0.1", 1), "http_version": "1.1", "asgi": {"version": "3.0"}}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"]


async def test_keys_given_only_as_api_keys_guard_the_api_and_own_what_they_store():
    api = Api(msgspec.convert({"api_keys": ["key-b", "key-c"]}, ServerConfig), "m")
    app = build_app(api)
    api.stored_responses.put("resp_1", b"{}", [], owner=owner_fingerprint(b"key-b"))
    statuses = [await _get(app, "/v1/responses/resp_1", key) for key in (None, b"key-a", b"key-b", b"key-c")]
    assert statuses == [401, 401, 200, 404]


@pytest.mark.server
async def test_with_two_api_keys_each_sees_only_its_own_stored_responses():
    async with serving(api_key="key-a", api_keys=["key-b"]) as served:
        alice, bob = served.client("key-a"), served.client("key-b")
        mine = await alice.responses.create(model=served.model, input="hello", max_output_tokens=2, temperature=0)
        theirs = await bob.responses.create(model=served.model, input="hello", max_output_tokens=2, temperature=0)
        errors: list[dict] = []
        for call in (
            lambda: bob.responses.retrieve(mine.id),
            lambda: bob.responses.retrieve("resp_" + "0" * ID_HEX),
            lambda: bob.responses.delete(mine.id),
            lambda: bob.responses.delete("resp_" + "0" * ID_HEX),
            lambda: bob.responses.create(model=served.model, previous_response_id=mine.id, input="more", max_output_tokens=2),
            lambda: bob.responses.create(model=served.model, previous_response_id="resp_" + "0" * ID_HEX, input="more", max_output_tokens=2),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                await call()
            assert isinstance(info.value.body, dict)
            errors.append(info.value.body)
        # The owner still has it (the other key's DELETE removed nothing) and continues it.
        retrieved = await alice.responses.retrieve(mine.id)
        follow_up = await alice.responses.create(model=served.model, previous_response_id=mine.id, input="more", max_output_tokens=2)
        assert (await bob.responses.retrieve(theirs.id)).id == theirs.id
        stranger = served.client("key-c")
        with pytest.raises(openai.AuthenticationError):
            await stranger.responses.retrieve(mine.id)
        owners = {entry.owner for entry in served.http.api.stored_responses._entries.values()}
        for client in (alice, bob, stranger):
            await client.close()
    for foreign, unknown in zip(errors[::2], errors[1::2]):
        assert foreign == {**unknown, "message": unknown["message"].replace("resp_" + "0" * ID_HEX, mine.id)}
    assert errors[-1]["param"] == "previous_response_id" and errors[0]["code"] == "not_found"
    assert retrieved.id == mine.id and follow_up.previous_response_id == mine.id
    assert len(owners) == 2 and not any("key-" in owner for owner in owners)


# -- bytes -------------------------------------------------------------------------


def test_a_flood_keeps_the_stores_bytes_and_count_under_their_caps_counting_all_an_entry_holds():
    store = ResponseStore(max_entries=16, max_bytes=20_000)
    history = [{"role": "user", "content": "x"}]
    for i in range(2000):
        response = b"r" * (i * 37 % 3000) if i % 97 else b"h" * 25_000  # some alone over the cap
        kept = store.put(f"resp_{i:032x}", response, history * (i % 5), owner=owner_fingerprint(b"k%d" % (i % 3)))
        assert kept == (i % 97 != 0)
        assert len(store) <= 16 and store.num_bytes <= 20_000
    assert store.num_bytes == sum(entry.size for entry in store._entries.values())
    # What an entry really holds (its id, owner, JSON and Python objects) is counted, at least.
    for response_id, entry in store._entries.items():
        held = sys.getsizeof(response_id) + sys.getsizeof(entry.response) + sys.getsizeof(entry.history) + sys.getsizeof(entry.owner)
        assert entry.size >= held + sys.getsizeof(entry)
    # Entries of ids alone fill the bytes too: an empty response is not free.
    tiny = ResponseStore(max_entries=1000, max_bytes=10_000)
    for i in range(1000):
        tiny.put(f"resp_{i:0100d}", b"", [])
    assert len(tiny) < 1000 and tiny.num_bytes <= 10_000


@pytest.mark.server
async def test_a_flood_of_stored_responses_stays_under_a_small_cap_shown_on_metrics():
    cap = 6_000
    async with serving(responses_store_max=5, responses_store_bytes=cap) as served:
        client = served.client()
        # Metadata is kept in the response, not rendered: large entries (and one alone over the cap).
        for pairs in [0] * 8 + [6, 6, 16, 0]:
            metadata = {f"m{k}": "x" * 512 for k in range(pairs)}
            await client.responses.create(model=served.model, input="hi", metadata=metadata, max_output_tokens=2, temperature=0)
            store = served.http.api.stored_responses
            assert len(store) <= 5 and store.num_bytes <= cap
        entries, num_bytes = len(store), store.num_bytes
        _, _, page = await raw_request(served.url, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
        await client.close()
    assert 0 < entries <= 5 and 0 < num_bytes <= cap
    lines = page.decode().splitlines()
    assert f'mlxrt:responses_store_entries{{model_name="{served.model}"}} {float(entries)}' in lines
    assert f'mlxrt:responses_store_bytes{{model_name="{served.model}"}} {float(num_bytes)}' in lines


# -- chains ------------------------------------------------------------------------


def _continue(store: ResponseStore, previous: str, limits: LimitsConfig, max_history_bytes: int = 1 << 20):
    body = msgspec.convert({"model": "m", "input": "next", "previous_response_id": previous}, ra.ResponsesRequest)
    return responses_request(body, store, limits=msgspec.structs.replace(limits, max_response_history_bytes=max_history_bytes))


def test_a_chain_past_max_response_chain_or_a_history_past_its_bytes_is_refused_naming_previous_response_id():
    store = ResponseStore(max_entries=16, max_bytes=1 << 20)
    limits = LimitsConfig(max_response_chain=3)
    assert (LimitsConfig().max_response_chain, LimitsConfig().max_response_history_bytes) == (1024, 16 << 20)
    store.put("resp_1", b"{}", [{"role": "user", "content": "a"}])
    turn = _continue(store, "resp_1", limits)
    assert turn.depth == 2 and [m["content"] for m in turn.history] == ["a", "next"]
    store.put("resp_2", b"{}", turn.history, depth=turn.depth)
    turn = _continue(store, "resp_2", limits)
    assert turn.depth == 3
    store.put("resp_3", b"{}", turn.history, depth=turn.depth)
    with pytest.raises(HttpError) as deep:
        _continue(store, "resp_3", limits)
    assert deep.value.code == "too_large" and deep.value.param == "previous_response_id" and "limits.max_response_chain" in str(deep.value)
    store.put("resp_big", b"{}", [{"role": "user", "content": "y" * 5000}])
    with pytest.raises(HttpError) as large:
        _continue(store, "resp_big", limits, max_history_bytes=4000)
    assert large.value.code == "too_large" and large.value.param == "previous_response_id" and "bytes" in str(large.value)
    assert _continue(store, "resp_big", limits, max_history_bytes=6000).depth == 2
    for bad in ({"max_response_chain": 0}, {"max_response_history_bytes": 0}, {"max_response_chain": "deep"}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, LimitsConfig)


@pytest.mark.server
async def test_the_server_refuses_a_chain_one_turn_past_the_limit_as_a_typed_400():
    config = make_config()
    config = msgspec.structs.replace(config, limits=msgspec.structs.replace(config.limits, max_response_chain=2))
    async with serving(config) as served:
        client = served.client()
        first = await client.responses.create(model=served.model, input="one", max_output_tokens=2, temperature=0)
        second = await client.responses.create(model=served.model, previous_response_id=first.id, input="two", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model=served.model, previous_response_id=second.id, input="three", max_output_tokens=2)
        stored = served.http.api.stored_responses.get(second.id)
        await client.close()
    body = info.value.body
    assert stored.depth == 2 and isinstance(body, dict)
    assert body["param"] == "previous_response_id" and body["code"] == "too_large" and "limits.max_response_chain" in body["message"]


# -- owners' shares ----------------------------------------------------------------


def _check_accounting(store: ResponseStore) -> None:
    entries = list(store._entries.values())
    assert store.num_bytes == sum(e.size for e in entries) <= store.max_bytes and len(entries) <= store.max_entries
    for owner in {e.owner for e in entries}:
        mine = [e.size for e in entries if e.owner == owner]
        assert store.owner_bytes(owner) == sum(mine) <= store.max_owner_bytes and len(mine) <= store.max_owner_entries


def test_one_key_flooding_the_store_evicts_only_its_own_responses():
    store = ResponseStore(max_entries=16, max_bytes=20_000, owner_share=0.5)
    alice, bob = owner_fingerprint(b"key-a"), owner_fingerprint(b"key-b")
    for i in range(3):
        assert store.put(f"resp_b{i}", b"b" * 1000, [], owner=bob)
    for i in range(500):
        assert store.put(f"resp_a{i}", b"a" * (i * 53 % 2000), [{"role": "user", "content": "x"}], owner=alice)
        _check_accounting(store)
    assert all(store.get(f"resp_b{i}", owner=bob) for i in range(3))
    assert store.owner_bytes(alice) <= 10_000 and store.get("resp_a499", owner=alice)
    # By count as well: many tiny entries of one key leave the others' alone.
    for i in range(500):
        store.put(f"resp_t{i}", b"", [], owner=alice)
    assert sum(e.owner == alice for e in store._entries.values()) == 8 and len(store) == 11
    assert all(store.get(f"resp_b{i}", owner=bob) for i in range(3))


def test_past_the_owners_shares_the_least_recently_used_of_any_owner_goes_first():
    store = ResponseStore(max_entries=100, max_bytes=10_000, owner_share=0.5)
    owners = [owner_fingerprint(b"k%d" % k) for k in range(3)]
    size = StoredResponse("resp_a0", b"x" * 1000, b"[]", owners[0]).size
    for name, owner in zip("abc", owners):
        for i in range(4):
            assert store.put(f"resp_{name}{i}", b"x" * 1000, [], owner=owner)
            _check_accounting(store)
    # Each owner keeps 3 (its share, 5,000 bytes), its own oldest going first; 9 do not fit
    # 10,000 bytes: then the store's oldest went, whoever held them (a1, a2).
    assert (size * 3 <= 5000 < size * 4, 10_000 // size) == (True, 7)
    assert list(store._entries) == ["resp_a3", "resp_b1", "resp_b2", "resp_b3", "resp_c1", "resp_c2", "resp_c3"]
    # A response larger than its owner's share is not kept (it would take the others' room).
    assert not store.put("resp_big", b"x" * 6000, [], owner=owners[0]) and "resp_big" not in store._entries
    # Each owner's order follows use: a read makes an entry the newest of its owner too.
    store.get("resp_c1", owner=owners[2])
    assert store.put("resp_c9", b"x" * 3000, [], owner=owners[2])
    assert [i for i in store._entries if i.startswith("resp_c")] == ["resp_c1", "resp_c9"]
    _check_accounting(store)


def test_a_random_mix_of_owners_puts_gets_and_deletes_keeps_every_count_exact():
    import random

    rng = random.Random(7)
    store = ResponseStore(max_entries=12, max_bytes=12_000, owner_share=0.4)
    owners = ["", owner_fingerprint(b"a"), owner_fingerprint(b"b"), owner_fingerprint(b"c")]
    for _ in range(3000):
        owner, response_id = rng.choice(owners), f"resp_{rng.randrange(40)}"
        action = rng.random()
        if action < 0.6:
            store.put(response_id, b"r" * rng.randrange(3000), [], owner=owner)
        elif action < 0.8:
            with contextlib.suppress(HttpError):
                store.get(response_id, owner=owner)
        else:
            store.delete(response_id, owner=owner)
        _check_accounting(store)
    for response_id in list(store._entries):
        store.delete(response_id, owner=store._entries[response_id].owner)
    assert (len(store), store.num_bytes, store._owned, store._owner_bytes) == (0, 0, {}, {})


def test_the_share_applies_only_where_several_api_keys_store():
    assert (LimitsConfig().max_response_store_share, msgspec.convert({"max_response_store_share": 1.0}, LimitsConfig).max_response_store_share) == (0.5, 1.0)
    for bad in (0, 0.0, 1.5, -0.5, "half"):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"max_response_store_share": bad}, LimitsConfig)
    with pytest.raises(ValueError):
        ResponseStore(4, 1000, owner_share=0)
    cases = {(): 1000, ("k0",): 1000, ("k0", "k0"): 1000, ("k0", "k1"): 250}
    for keys, owner_bytes in cases.items():
        server = msgspec.convert({"api_key": keys[0] if keys else "", "api_keys": list(keys[1:]), "responses_store_bytes": 1000}, ServerConfig)
        assert server_store(server, 0.25).max_owner_bytes == owner_bytes, keys
        assert Api(server, "m", store_share=0.25).stored_responses.max_owner_bytes == owner_bytes
    assert Api(msgspec.convert({"api_keys": ["a", "b"], "responses_store_bytes": 1000}, ServerConfig), "m").stored_responses.max_owner_bytes == 500


@pytest.mark.server
async def test_over_http_a_key_flooding_store_true_leaves_another_keys_responses():
    config = msgspec.structs.replace(make_config(), limits=LimitsConfig(max_response_store_share=0.5))
    async with serving(config, api_keys=["key-a", "key-b"], responses_store_max=6) as served:
        alice, bob = served.client("key-a"), served.client("key-b")
        kept = [await bob.responses.create(model=served.model, input="hello", max_output_tokens=2, temperature=0) for _ in range(2)]
        for _ in range(8):
            await alice.responses.create(model=served.model, input="flood", max_output_tokens=2, temperature=0)
        retrieved = [(await bob.responses.retrieve(r.id)).id for r in kept]
        store = served.http.api.stored_responses
        counts = Counter(entry.owner for entry in store._entries.values())
        for client in (alice, bob):
            await client.close()
    assert retrieved == [r.id for r in kept]
    assert counts[owner_fingerprint(b"key-a")] == 3 and counts[owner_fingerprint(b"key-b")] == 2
