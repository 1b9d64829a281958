"""A later run of a request yields only what its caller does not have yet."""

from __future__ import annotations

import pytest

from protocols.api import TokenDelta
from runtime.errors import InternalError
from runtime.replay import Delivered, Replay


def _delta(ids: list[int], text: str) -> TokenDelta:
    return TokenDelta(request_id="r", token_ids=ids, text=text)


def test_a_replay_skips_what_was_delivered_and_splits_a_straddling_delta():
    delivered = Delivered()
    first = Replay(delivered)
    for ids, text in (([1, 2], "ab"), ([3], "c")):
        part = first.new(_delta(ids, text))
        assert part is not None
        first.record(part)
    assert (delivered.token_ids, delivered.text) == ([1, 2, 3], "abc")
    again = Replay(delivered)  # e.g. from a checkpoint after token 1: re-delivers 1, then goes on
    assert again.new(_delta([1], "a")) is None
    part = again.new(_delta([2, 3, 4, 5], "bcde"))
    assert part is not None and (part.token_ids, part.text) == ([4, 5], "de")
    again.record(part)
    flush = again.new(_delta([], "!"))  # a final text flush carries no token
    assert flush is not None and (flush.token_ids, flush.text) == ([], "!")


def test_a_replay_that_disagrees_is_an_error_not_a_wrong_stream():
    delivered = Delivered(token_ids=[1, 2], text="ab")
    with pytest.raises(InternalError):
        Replay(delivered).new(_delta([1, 2, 3], "xyz"))


def test_tool_calls_are_counted_not_repeated():
    delivered = Delivered(tool_calls=1)
    replay = Replay(delivered)
    assert replay.new_tool_call() is False
    assert replay.new_tool_call() is True and delivered.tool_calls == 2


def test_streamed_call_fragments_are_replayed_only_past_what_was_delivered():
    from protocols.api import ToolCallDelta

    def delta(**fields):
        return ToolCallDelta(request_id="r", index=0, id="call-r-0", **fields)

    delivered = Delivered()
    first = Replay(delivered)
    assert first.deliver(delta(name="f")) == [delta(name="f")]
    assert first.deliver(delta(arguments='{"ci')) == [delta(arguments='{"ci')]
    # The model is swapped out; the next run repeats the call from its start.
    again = Replay(delivered)
    assert again.deliver(delta(name="f")) == []
    assert again.deliver(delta(arguments='{"c')) == []
    assert again.deliver(delta(arguments='ity": ')) == [delta(arguments='ty": ')]
    assert delivered.call_arguments == {0: '{"city": '}
