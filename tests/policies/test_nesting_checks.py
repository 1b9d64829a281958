"""Nesting bounds before any rendering: messages nested deeper than `MAX_MESSAGE_DEPTH` levels and
tools / response formats deeper than `limits.max_grammar_depth` are refused typed, however
wide the input, and without recursion (a 100,000-level list cannot overflow the stack)."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from policies.validation import MAX_MESSAGE_DEPTH, validate
from protocols.api import GenerateRequest
from protocols.config import LimitsConfig
from protocols.errors import InvalidRequestError
from tests.support.model_info import model_info

INFO = model_info()


def nested(levels: int, leaf: object = "x") -> object:
    """`levels` containers, alternating dict and list, around `leaf`."""
    value = leaf
    for i in range(levels):
        value = {"content": value} if i % 2 else [value]
    return value


def message_at_depth(levels: int) -> GenerateRequest:
    # The list of messages and the message itself are two levels.
    return GenerateRequest(messages=[{"role": "user", "content": nested(levels - 2)}])


def test_messages_at_the_bound_pass_and_one_deeper_is_refused():
    validate(message_at_depth(MAX_MESSAGE_DEPTH), INFO)
    with pytest.raises(InvalidRequestError) as raised:
        validate(message_at_depth(MAX_MESSAGE_DEPTH + 1), INFO)
    assert raised.value.field == "messages" and str(MAX_MESSAGE_DEPTH) in str(raised.value)


def test_a_dict_subclass_counts_as_a_level():
    deep = OrderedDict(content=nested(MAX_MESSAGE_DEPTH - 1))  # one level over
    with pytest.raises(InvalidRequestError):
        validate(GenerateRequest(messages=[deep]), INFO)


def test_a_very_deep_list_is_refused_without_recursion():
    with pytest.raises(InvalidRequestError):
        validate(GenerateRequest(messages=[{"role": "user", "content": nested(100_000)}]), INFO)


def test_wide_flat_messages_pass():
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(4096)]
    validate(GenerateRequest(messages=messages), INFO)


def test_tools_deeper_than_the_grammar_depth_are_refused():
    limits = LimitsConfig(max_grammar_depth=8)
    # The list, the tool, its function: three levels; the parameters' containers and the {} leaf the rest.
    shallow = [{"type": "function", "function": {"name": "f", "parameters": nested(4, {})}}]
    validate(GenerateRequest(prompt="x", tools=shallow), INFO, limits)
    deep = [{"type": "function", "function": {"name": "f", "parameters": nested(5, {})}}]
    with pytest.raises(InvalidRequestError) as raised:
        validate(GenerateRequest(prompt="x", tools=deep), INFO, limits)
    assert raised.value.field == "tools"
