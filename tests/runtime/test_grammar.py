"""GrammarCache: compiled grammars under a byte budget, pinned while in use, compiled within a deadline."""

from __future__ import annotations

import json
import threading

import pytest
from mlx_lm.utils import load_tokenizer

from protocols.model import GrammarSpec
from runtime.errors import InvalidRequestError, ServerBusyError
from runtime.grammar import GrammarCache
from tests.support.config import builtin_dir
from tests.support.waiting import wait_until_async


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(builtin_dir("tiny"))


def schema(i: int, width: int = 4) -> GrammarSpec:
    properties = {f"k{i}_{j}": {"type": "integer"} for j in range(width)}
    return GrammarSpec(kind="json_schema", source=json.dumps({"type": "object", "properties": properties, "required": list(properties)}))


def make(tokenizer, **options) -> GrammarCache:
    return GrammarCache(tokenizer, 1024, [0], **options)


def size_of(tokenizer, spec: GrammarSpec) -> int:
    return int(make(tokenizer).compile(spec).memory_size_bytes)


async def test_acquired_grammars_give_matchers_and_released_ones_stay_cached(tokenizer):
    cache = make(tokenizer)
    await cache.acquire(schema(0))
    matcher = cache.matcher(schema(0))
    assert matcher.accept_string('{"k0_0": 1') and not matcher.is_terminated()
    cache.release(schema(0))
    assert len(cache) == 1 and cache.num_bytes > 0


async def test_the_cache_is_bounded_by_bytes_evicting_unpinned_grammars(tokenizer):
    one = size_of(tokenizer, schema(0))
    cache = make(tokenizer, max_bytes=3 * one + one // 2)
    for i in range(10):
        await cache.acquire(schema(i))
        cache.release(schema(i))
        assert cache.num_bytes <= cache.max_bytes
    assert 1 <= len(cache) <= 3
    with pytest.raises(KeyError):
        cache.matcher(schema(0))  # evicted: the engine never compiles


async def test_pinned_grammars_are_never_evicted_and_a_full_cache_is_busy(tokenizer):
    one = size_of(tokenizer, schema(0))
    cache = make(tokenizer, max_bytes=2 * one + one // 2)
    await cache.acquire(schema(0))
    await cache.acquire(schema(1))
    with pytest.raises(ServerBusyError):
        await cache.acquire(schema(2))
    assert cache.matcher(schema(0)) and cache.matcher(schema(1))
    cache.release(schema(0))
    await cache.acquire(schema(2))  # room made by evicting the released one
    with pytest.raises(KeyError):
        cache.matcher(schema(0))


async def test_a_grammar_larger_than_the_whole_cache_is_refused(tokenizer):
    cache = make(tokenizer, max_bytes=16)
    with pytest.raises(InvalidRequestError) as info:
        await cache.acquire(schema(0))
    assert info.value.field == "response_format" and "grammar_cache_bytes" in str(info.value)
    assert len(cache) == 0


async def test_a_slow_compile_is_refused_at_its_deadline_and_kept_for_later(tokenizer, monkeypatch):
    cache = make(tokenizer, timeout_s=0.2)
    release = threading.Event()
    real_build = cache._build

    def slow_build(spec):
        release.wait(10)
        return real_build(spec)

    monkeypatch.setattr(cache, "_build", slow_build)
    with pytest.raises(InvalidRequestError, match="did not compile within") as info:
        await cache.acquire(schema(0))
    assert info.value.field == "response_format"
    release.set()
    # The compile that started finishes in the background; the next request finds it.
    await wait_until_async(lambda: len(cache) > 0)
    await cache.acquire(schema(0))


@pytest.mark.parametrize(
    "spec, words",
    [
        (GrammarSpec(kind="regex", source="(("), "parenthesis"),
        (GrammarSpec(kind="ebnf", source="root ::= nope"), "not defined"),
        (GrammarSpec(kind="json_schema", source='{"type": "object", "properties": {"a": {"$ref": "#/x"}}}'), "x"),
    ],
)
async def test_errors_name_the_field_without_library_paths(tokenizer, spec, words):
    cache = make(tokenizer)
    with pytest.raises(InvalidRequestError) as info:
        await cache.acquire(spec)
    message = str(info.value)
    assert info.value.field == "response_format" and words in message
    assert "/project/" not in message and ".cc:" not in message and "[" not in message.split(":")[0]


@pytest.mark.parametrize("choice", [None, "auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_tools_on_a_template_without_a_tool_call_format_are_refused_whatever_the_choice(choice):
    """Under `auto` too: the model could call them, but its calls could not be told from text."""
    from protocols.api import GenerateRequest
    from runtime.grammar import grammar_spec

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    request = GenerateRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice=choice)
    with pytest.raises(InvalidRequestError) as info:
        grammar_spec(request, None)
    assert info.value.field == "tools" and "tool-call format" in str(info.value)
    assert grammar_spec(GenerateRequest(messages=request.messages, tools=tools, tool_choice="none"), None) is None
    assert grammar_spec(request, ("<tool_call>", "</tool_call>")) is None or choice not in (None, "auto")
