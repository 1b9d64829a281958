"""Transcript tests of policies.tool_formats: each family's real output shapes, fed whole and split at
every character boundary (the streamed result equals the whole-text result, and the streamed
argument fragments add up to each finished call's arguments).

The transcripts follow the formats as the models write them: vLLM's tool-parser tests
(tests/tool_use/, tests/entrypoints/openai/tool_parsers/), mlx-lm's tool_parsers, the harmony
spec (openai/harmony) and the models' chat templates.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.output_parser import Parsed
from policies.tool_formats import MISTRAL_THINK, THINK, ToolFormat, make_parser
from policies.tool_stream import JsonScanner

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}},
    },
}
WRITE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}, "lines": {"type": "array"}}},
    },
}
TOOLS = [WEATHER, WRITE]


def stream(fmt: ToolFormat, chunks: list[str], *, in_reasoning: bool = False) -> tuple[Parsed, list[list[dict]]]:
    """Everything reported, and the deltas of each call (in the order the session numbers them)."""
    parser = make_parser(fmt, tools=TOOLS, in_reasoning=in_reasoning)
    total, per_call, current = Parsed(), [], []
    for part in [*(parser.feed(chunk) for chunk in chunks), parser.flush()]:
        total.content += part.content
        total.reasoning += part.reasoning
        current += part.deltas
        for call in part.calls:
            total.calls.append(call)
            per_call.append(current)
            current = []
    assert current == [], "deltas of a call that never finished"
    return total, per_call


def check_transcript(fmt: ToolFormat, text: str, *, in_reasoning: bool = False) -> Parsed:
    """The whole-text result, checked against every two-way split and one character at a time."""
    whole, _ = stream(fmt, [text], in_reasoning=in_reasoning)
    for at in range(len(text) + 1):
        split, deltas = stream(fmt, [text[:at], text[at:]], in_reasoning=in_reasoning)
        assert split == whole, at
        check_deltas(split.calls, deltas)
    chars, deltas = stream(fmt, list(text), in_reasoning=in_reasoning)
    assert chars == whole
    check_deltas(chars.calls, deltas)
    assert all(parts for call, parts in zip(chars.calls, deltas) if "error" not in call), "a call streamed nothing"
    return whole


def check_deltas(calls: list[dict], deltas: list[list[dict]]) -> None:
    for call, parts in zip(calls, deltas):
        if not parts or "error" in call:
            continue
        assert parts[0] == {"name": call["name"]}
        assert "".join(p["arguments"] for p in parts[1:]) == call["arguments"]


def args(call: dict) -> dict:
    return json.loads(call["arguments"])


# -- Hermes / Qwen2.5 / Qwen3 --------------------------------------------------------------------

HERMES = ToolFormat("hermes", THINK)


def test_hermes_reasoning_then_a_call():
    text = '<think>\nThe user wants Paris weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    out = check_transcript(HERMES, text)
    assert out.reasoning == "\nThe user wants Paris weather.\n"
    assert out.content == "\n\n"
    assert [(c["name"], args(c)) for c in out.calls] == [("get_weather", {"city": "Paris", "days": 2})]


def test_hermes_output_that_starts_inside_reasoning_opened_by_the_prompt():
    text = "Let me think.\n</think>\n\nIt is sunny."
    out = check_transcript(HERMES, text, in_reasoning=True)
    assert (out.reasoning, out.content) == ("Let me think.\n", "\n\nIt is sunny.")


# -- Qwen3-Coder ---------------------------------------------------------------------------------

QWEN3_CODER = ToolFormat("qwen3_coder", None)


def test_qwen3_coder_xml_calls_are_typed_by_the_schema():
    text = (
        "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=content>\n"
        'def f():\n    return "x"\n\n</parameter>\n<parameter=lines>\n[1, 2]\n</parameter>\n</function>\n</tool_call>'
    )
    out = check_transcript(QWEN3_CODER, text)
    assert out.content == "I'll check both.\n\n"
    assert [(c["name"], args(c)) for c in out.calls] == [
        ("get_weather", {"city": "San Francisco", "days": 3, "metric": True}),
        ("write_file", {"path": "/tmp/a.py", "content": 'def f():\n    return "x"\n', "lines": [1, 2]}),
    ]


def test_qwen3_coder_string_parameters_stream_as_they_are_written():
    text = "<tool_call>\n<function=write_file>\n<parameter=content>\nprint('hello world')\n</parameter>\n</function>\n</tool_call>"
    _, [deltas] = stream(QWEN3_CODER, list(text))
    fragments = [d["arguments"] for d in deltas[1:]]
    assert len(fragments) > 10
    assert "".join(fragments) == '{"content": "print(\'hello world\')"}'


def test_qwen3_coder_call_cut_off_by_max_tokens_is_truncated():
    out, _ = stream(QWEN3_CODER, ["<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a\n</parameter>\n<parameter=content>\nimport o"])
    assert out.calls == [{"name": "write_file", "arguments": '{"path": "/tmp/a", "content": "import o"}', "truncated": True}]
    assert out.content == ""


# -- Llama 3.x -----------------------------------------------------------------------------------

LLAMA3 = ToolFormat("llama3", None)


def test_llama3_python_tag_call():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 1}}'
    out = check_transcript(LLAMA3, text)
    assert (out.content, [(c["name"], args(c)) for c in out.calls]) == ("", [("get_weather", {"city": "Tokyo", "days": 1})])


def test_llama3_bare_json_calls_separated_by_semicolons():
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "write_file", "parameters": {"path": "/x", "content": "y"}}'
    out = check_transcript(LLAMA3, text)
    assert [(c["name"], args(c)) for c in out.calls] == [("get_weather", {"city": "Oslo"}), ("write_file", {"path": "/x", "content": "y"})]


def test_llama3_text_answer_and_json_that_is_not_a_call_stay_content():
    assert check_transcript(LLAMA3, "The weather in Oslo is {mild}.").content == "The weather in Oslo is {mild}."
    out = check_transcript(LLAMA3, '{"answer": 42}')
    assert out.calls == [{"error": "a tool call needs a name", "raw": '{"answer": 42}'}]


# -- Mistral -------------------------------------------------------------------------------------

MISTRAL = ToolFormat("mistral", MISTRAL_THINK)


def test_mistral_v3_json_array_of_calls():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Lyon", "days": 2}}]'
    out = check_transcript(MISTRAL, text)
    assert [args(c) for c in out.calls] == [{"city": "Paris"}, {"city": "Lyon", "days": 2}]
    assert out.content == ""


def test_mistral_v11_name_args_calls_with_thinking():
    text = '[THINK]Two cities.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]write_file[ARGS]{"path": "a", "content": "b"}'
    out = check_transcript(MISTRAL, text)
    assert (out.reasoning, out.content) == ("Two cities.", "Checking.")
    assert [(c["name"], args(c)) for c in out.calls] == [("get_weather", {"city": "Paris"}), ("write_file", {"path": "a", "content": "b"})]


def test_mistral_call_with_a_call_id():
    out = check_transcript(MISTRAL, '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}')
    assert out.calls == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]


# -- gpt-oss harmony -----------------------------------------------------------------------------

HARMONY = ToolFormat("harmony")


def test_harmony_analysis_then_final():
    text = "<|channel|>analysis<|message|>User asks: sum 1 to 100. That's 5050.<|end|><|start|>assistant<|channel|>final<|message|>The sum is 5050."
    out = check_transcript(HARMONY, text)
    assert (out.reasoning, out.content, out.calls) == ("User asks: sum 1 to 100. That's 5050.", "The sum is 5050.", [])


def test_harmony_call_on_the_commentary_channel():
    # `<|call|>` ends the output (an end-of-sequence token): the text stops after the arguments.
    text = '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Denver","days":2}'
    out = check_transcript(HARMONY, text)
    assert (out.reasoning, out.content) == ("Need weather.", "")
    assert out.calls == [{"name": "get_weather", "arguments": '{"city":"Denver","days":2}'}]


def test_harmony_recipient_before_the_channel_and_a_preamble():
    text = '<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    out = check_transcript(HARMONY, text)
    assert out.content == "Looking it up."
    assert out.calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]


def test_harmony_call_cut_off_is_truncated():
    out, _ = stream(HARMONY, ['<|channel|>commentary to=functions.write_file <|constrain|>json<|message|>{"path": "/tmp/x", "cont'])
    assert out.calls == [{"name": "write_file", "arguments": '{"path": "/tmp/x", "cont', "truncated": True}]


# -- DeepSeek ------------------------------------------------------------------------------------

DEEPSEEK = ToolFormat("deepseek", THINK)


def test_deepseek_v3_fenced_calls():
    text = (
        "<think>two lookups</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
        '{"city": "Osaka", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    out = check_transcript(DEEPSEEK, text)
    assert (out.reasoning, out.content) == ("two lookups", "Sure.")
    assert [(c["name"], args(c)) for c in out.calls] == [("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Osaka", "days": 3})]


def test_deepseek_v31_calls_and_r1_reasoning_opened_by_the_prompt():
    text = (
        '\nweighing\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Seoul"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    out = check_transcript(DEEPSEEK, text, in_reasoning=True)
    assert (out.reasoning, out.content) == ("\nweighing\n", "\n\n")
    assert out.calls == [{"name": "get_weather", "arguments": '{"city": "Seoul"}'}]


# -- GLM 4.5 / 4.7 -------------------------------------------------------------------------------

GLM = ToolFormat("glm", THINK)


def test_glm45_calls_with_newlines():
    text = (
        "<think>Beijing weather.</think>Let me search for that.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    )
    out = check_transcript(GLM, text)
    assert (out.reasoning, out.content) == ("Beijing weather.", "Let me search for that.\n")
    assert [(c["name"], args(c)) for c in out.calls] == [("get_weather", {"city": "Beijing", "days": 2})]


def test_glm47_calls_without_newlines_and_one_without_arguments():
    text = "<tool_call>write_file<arg_key>path</arg_key><arg_value>notes.md</arg_value><arg_key>lines</arg_key><arg_value>[3, 4]</arg_value></tool_call><tool_call>get_weather</tool_call>"
    out = check_transcript(GLM, text)
    assert [(c["name"], args(c)) for c in out.calls] == [("write_file", {"path": "notes.md", "lines": [3, 4]}), ("get_weather", {})]


# -- every family: markup never reaches content; a forced (JSON) body reads in tagged families ---


@pytest.mark.parametrize("fmt", [QWEN3_CODER, GLM])
def test_tagged_families_read_a_json_body(fmt):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    out = check_transcript(fmt, text)
    assert out.calls == [{"name": "get_weather", "arguments": '{"city": "Lima"}'}]


def test_a_region_that_is_not_a_call_comes_back_as_an_error_with_its_text():
    out, _ = stream(QWEN3_CODER, ["<tool_call>\nno function here\n</tool_call>after"])
    assert out.calls == [{"error": "not a tool call", "raw": "\nno function here\n"}] and out.content == "after"


def test_without_tools_markup_is_content_and_reasoning_still_splits():
    parser = make_parser(GLM, tools=None)
    out = parser.feed("<think>hm</think><tool_call>get_weather</tool_call>")
    assert (out.reasoning, out.content + parser.flush().content) == ("hm", "<tool_call>get_weather</tool_call>")


def test_a_call_that_starts_in_the_feed_that_finished_another_streams_from_the_next_feed():
    """The session numbers a `Parsed`'s deltas by the first call it finishes: the second call's
    name must not ride along with the first call's end."""
    parser = make_parser(MISTRAL, tools=TOOLS)
    first = parser.feed('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa')
    second = parser.feed('ris"}[TOOL_CALLS]write_file[ARGS]{"path"')
    third = parser.feed(': "a"}')
    assert first.deltas == [{"name": "get_weather"}, {"arguments": '{"city": "Pa'}]
    assert second.deltas == [{"arguments": 'ris"}'}] and second.calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert third.deltas == [{"name": "write_file"}, {"arguments": '{"path": "a"}'}]
    assert third.calls == [{"name": "write_file", "arguments": '{"path": "a"}'}]  # its JSON closed it
    assert parser.flush() == Parsed()


def test_hermes_deltas_of_one_feed_never_belong_to_the_call_after_the_one_it_finished():
    """Regression: `OutputParser` reported the next call's name in the same `Parsed` as the call it
    finished, so the session numbered that name with the finished call's index."""
    parser = make_parser(HERMES, tools=TOOLS)
    parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}')
    finishing = parser.feed('}</tool_call><tool_call>{"name": "write_file", "arguments": {"path": "a"')
    assert [c["name"] for c in finishing.calls] == ["get_weather"]
    assert {"name": "write_file"} not in finishing.deltas
    rest = [parser.feed("}}</tool_call>"), parser.flush()]
    deltas = [d for part in rest for d in part.deltas]
    assert deltas[0] == {"name": "write_file"} and "".join(d["arguments"] for d in deltas[1:]) == '{"path": "a"}'


# -- any text, any chunking: never an exception, always the whole-text result ---------------------

PIECES = [
    *("<tool_call>", "</tool_call>", "<think>", "</think>", "<function=get_weather>", "<parameter=city>", "</parameter>", "</function>"),
    *("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]"),
    *("<|channel|>", "analysis", "final", "commentary to=functions.get_weather", "<|message|>", "<|end|>", "<|call|>", "<|start|>"),
    *("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "function", "```json\n"),
    *('{"name": "get_weather", ', '"arguments": ', '"parameters": ', '{"city": "Oslo"', "}", "]", "[", '"', "\\", "\n", " ", "get_weather", "x", "3", "<", "|"),
]
FAMILIES = [HERMES, QWEN3_CODER, LLAMA3, MISTRAL, HARMONY, DEEPSEEK, GLM]


@st.composite
def chunked_output(draw) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(st.sampled_from(PIECES), max_size=14)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    return text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(FAMILIES), chunked_output(), st.booleans())
def test_any_output_in_any_chunks_parses_as_the_whole_and_never_raises(fmt, case, in_reasoning):
    text, chunks = case
    whole, _ = stream(fmt, [text], in_reasoning=in_reasoning)
    split, deltas = stream(fmt, chunks, in_reasoning=in_reasoning)
    assert split == whole
    check_deltas(split.calls, deltas)
    for call in split.calls:
        if "error" not in call and not call.get("truncated"):
            json.loads(call["arguments"])  # a finished call's arguments are JSON


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\\n{}[]é ', max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k"\\{', max_size=3), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=3), json_values, max_size=3), st.lists(st.integers(1, 6), max_size=40))
def test_a_resumed_scan_finds_where_a_growing_json_value_ends(value, steps):
    text = "x" + json.dumps(value, ensure_ascii=False) + ' tail"}'
    end = len(text) - len(' tail"}')
    scan, at = JsonScanner(), 1
    for step in [*steps, len(text)]:
        at = min(at + step, len(text))
        found = scan.value_end(text[:at], 1)
        assert found == (end if at >= end else None), at
