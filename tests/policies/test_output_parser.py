"""Tests for policies.output_parser.OutputParser: content, a leading think block, and tool calls from streamed text."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.output_parser import OutputParser, Parsed

THINK = ("<think>", "</think>")
TOOLS = ("<tool_call>", "</tool_call>")


def run(parser: OutputParser, chunks: list[str]) -> Parsed:
    """Feed every chunk, then flush; the concatenation of everything reported."""
    total = Parsed()
    for part in [*(parser.feed(chunk) for chunk in chunks), parser.flush()]:
        total.content += part.content
        total.reasoning += part.reasoning
        total.calls += part.calls
    return total


def parser(**kwargs) -> OutputParser:
    return OutputParser(think=THINK, tool_markers=TOOLS, **kwargs)


# -- think blocks ------------------------------------------------------------------------


def test_a_leading_think_block_is_reasoning_and_the_rest_content():
    out = run(OutputParser(think=THINK), ["  <think>weighing options</think>The answer is 4."])
    assert (out.reasoning, out.content, out.calls) == ("weighing options", "The answer is 4.", [])


def test_without_a_think_block_everything_is_content():
    out = run(OutputParser(think=THINK), ["  The answer <think>is</think> 4."])
    assert (out.reasoning, out.content) == ("", "  The answer <think>is</think> 4.")


def test_a_parser_without_markers_passes_text_through():
    plain = OutputParser()
    assert plain.feed("a <think>b</think> <tool_call>c</tool_call>") == Parsed(content="a <think>b</think> <tool_call>c</tool_call>")
    assert plain.flush() == Parsed()


def test_a_partial_think_marker_is_held_until_decided():
    p = OutputParser(think=THINK)
    assert p.feed("<thi") == Parsed()
    assert p.feed("nk>hm") == Parsed(reasoning="hm")
    assert p.feed("</th") == Parsed()
    assert p.feed("ink>ok") == Parsed(content="ok")


def test_an_unfinished_think_block_is_flushed_as_reasoning():
    p = OutputParser(think=THINK)
    assert p.feed("<think>still going</thi") == Parsed(reasoning="still going")
    assert p.flush() == Parsed(reasoning="</thi")


# -- tool calls --------------------------------------------------------------------------


def test_a_call_between_tool_markers_is_parsed_as_json():
    body = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
    out = run(parser(), [f"Let me check.<tool_call>{body}</tool_call>done"])
    assert out.content == "Let me check.done"
    assert out.calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]


def test_string_arguments_are_kept_and_missing_arguments_become_an_empty_object():
    out = run(parser(), ['<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": 7}</tool_call>'])
    assert out.calls == [{"name": "a", "arguments": '{"x": 1}'}, {"name": "7", "arguments": "{}"}]


def test_an_injected_parse_call_reads_the_body():
    seen = []

    def parse_call(body: str) -> dict:
        seen.append(body)
        name, _, value = body.partition(":")
        return {"name": name, "arguments": {"value": int(value)}}

    out = run(parser(parse_call=parse_call), ["<tool_call>add:3</tool_call>"])
    assert seen == ["add:3"]
    assert out.calls == [{"name": "add", "arguments": '{"value": 3}'}]


def test_an_unparseable_call_is_reported_with_its_raw_body():
    out = run(parser(), ["<tool_call>{not json</tool_call>after"])
    assert out.content == "after"
    [call] = out.calls
    assert call["raw"] == "{not json"
    assert call["error"].startswith("unparseable tool call")


def test_a_parse_call_that_raises_value_error_is_reported_not_raised():
    def parse_call(body: str) -> dict:
        raise ValueError("bad body")

    [call] = run(parser(parse_call=parse_call), ["<tool_call>x</tool_call>"]).calls
    assert call == {"error": "unparseable tool call: bad body", "raw": "x"}


def test_a_parse_call_failing_with_any_exception_is_reported_not_raised():
    """Regression: only ValueError/TypeError were caught; mlx-lm's longcat parser raises
    AttributeError on a malformed body, which escaped into the runtime's task group."""

    def parse_call(body: str) -> dict:
        # What mlx_lm.tool_parsers.longcat does with a body lacking its markup.
        return {"name": re.search(r"<longcat_tool_call>(.*?)\n", body).group(1)}

    [call] = run(parser(parse_call=parse_call), ["<tool_call>garbage</tool_call>"]).calls
    assert call["raw"] == "garbage" and "error" in call


def test_a_parser_returning_several_calls_reports_each():
    def parse_call(body: str) -> list[dict]:
        return [{"name": "a", "arguments": {"x": 1}}, {"name": "b"}]

    calls = run(parser(parse_call=parse_call), ["<tool_call>two</tool_call>"]).calls
    assert calls == [{"name": "a", "arguments": '{"x": 1}'}, {"name": "b", "arguments": "{}"}]


def test_a_call_without_a_name_is_an_error():
    out = run(parser(), ['<tool_call>{"arguments": {}}</tool_call><tool_call>[1, 2]</tool_call>'])
    assert out.calls == [
        {"error": "a tool call needs a name", "raw": '{"arguments": {}}'},
        {"error": "a tool call needs a name", "raw": "[1, 2]"},
    ]


def test_a_call_cut_off_after_its_name_is_a_truncated_call_and_never_markup():
    p = parser()
    assert p.feed('ok <tool_call>{"name": "f", "arguments": {"city": "Par').content == "ok "
    assert p.flush() == Parsed(calls=[{"name": "f", "arguments": '{"city": "Par', "truncated": True}])


def test_a_call_cut_off_after_its_arguments_is_a_whole_call():
    p = parser()
    p.feed('<tool_call>{"name": "f", "arguments": {"city": "Paris"}}\n</tool_')
    assert p.flush().calls == [{"name": "f", "arguments": '{"city": "Paris"}'}]


def test_a_call_cut_off_before_its_name_leaves_nothing():
    p = parser()
    assert p.feed('ok <tool_call>{"name": "f"') == Parsed(content="ok ")
    assert p.flush() == Parsed()


def deltas_of(chunks: list[str]) -> tuple[list[dict], list[dict]]:
    p = parser()
    parts = [*(p.feed(chunk) for chunk in chunks), p.flush()]
    return [d for part in parts for d in part.deltas], [c for part in parts for c in part.calls]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 120), max_size=12))
def test_streamed_argument_fragments_add_up_to_the_calls_arguments(cuts):
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",\n  "unit":"C", "days": [1, {"n": 2}]}}\n</tool_call> ok'
    points = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    deltas, calls = deltas_of(chunks)
    arguments = '{"city": "Paris",\n  "unit":"C", "days": [1, {"n": 2}]}'  # the model's own text
    assert calls == [{"name": "get_weather", "arguments": arguments}]
    assert deltas[0] == {"name": "get_weather"}
    assert "".join(d["arguments"] for d in deltas[1:]) == arguments


def test_arguments_stream_as_they_are_generated():
    text = '<tool_call>{"name": "f", "arguments": {"path": "/tmp/a", "lines": 40}}</tool_call>'
    deltas, _ = deltas_of(list(text))
    fragments = [d["arguments"] for d in deltas[1:]]
    assert len(fragments) > 20  # one per generated character, not one at the end
    assert "".join(fragments) == '{"path": "/tmp/a", "lines": 40}'


def test_arguments_that_are_not_an_object_arrive_whole():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    deltas, calls = deltas_of(list(text))
    assert deltas == [{"name": "f"}, {"arguments": '{"a": 1}'}] and calls == [{"name": "f", "arguments": '{"a": 1}'}]


def test_a_call_is_reported_by_the_feed_that_completes_it():
    p = parser()
    assert p.feed("<think>plan</think>x<tool_call>") == Parsed(reasoning="plan", content="x")
    assert p.feed('{"name": "f"}</tool') == Parsed()
    assert p.feed("_call>y") == Parsed(content="y", calls=[{"name": "f", "arguments": "{}"}])


# -- chunking never changes the result ---------------------------------------------------

SAMPLES = [
    '<think>a < b </thin </think>hi <tool_call>{"name": "f", "arguments": {"k": [1]}}</tool_call> bye <tool_call> {"name": "g"}</tool_call></tool_call',
    ' \n<think></think><tool_call>{"name": "f"}</tool_call><<tool_call>oops</tool_call><tool_cal',
    "<thinking>not a block</think> <tool_call>",
    "\n  <thi",
    "<think>unfinished </think",
]


@st.composite
def chunked(draw) -> tuple[str, list[str]]:
    pieces = ["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "f"}', "<", "/", ">", "t", " ", "\n", "x"]
    text = draw(st.sampled_from(SAMPLES)) if draw(st.booleans()) else "".join(draw(st.lists(st.sampled_from(pieces), max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    return text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=400, deadline=None)
@given(chunked())
def test_any_chunking_gives_the_same_content_reasoning_and_calls(case):
    text, chunks = case
    assert "".join(chunks) == text
    assert run(parser(), chunks) == run(parser(), [text])


def test_every_single_split_point_of_the_markers_gives_the_same_result():
    text = SAMPLES[0]
    whole = run(parser(), [text])
    assert whole.reasoning == "a < b </thin "
    assert [call.get("name") for call in whole.calls] == ["f", "g"]
    for at in range(len(text) + 1):
        assert run(parser(), [text[:at], text[at:]]) == whole, at
    assert run(parser(), list(text)) == whole
