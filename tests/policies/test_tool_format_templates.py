"""Real chat templates (tests/data/chat_templates/) against policies.tool_formats: each is detected as
its family, renders a conversation with tools, a call and its result through transformers'
`apply_chat_template`, and the assistant turn it renders for a call is read back as that call by
the family's parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from policies.tool_formats import THINK, detect_format, make_parser, prompt_opens_reasoning

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}}, "required": ["city"]},
    },
}
# (template, family, whether it takes a call's arguments as JSON text, what ends its assistant turn)
CASES = [
    ("hermes.jinja", "hermes", False, "<|im_end|>\n"),
    ("qwen3_coder.jinja", "qwen3_coder", False, "<|im_end|>\n"),
    ("llama32_json.jinja", "llama3", False, "<|eot_id|>"),
    ("mistral3.jinja", "mistral", False, "</s>"),
    ("gpt_oss.jinja", "harmony", False, "<|call|>"),
    ("deepseek_v31.jinja", "deepseek", True, "<｜end▁of▁sentence｜>"),
    ("glm45.jinja", "glm", False, ""),
]


def tokenizer_with(template: str) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=template)


def conversation(arguments_as_text: bool) -> list[dict]:
    arguments = {"city": "Paris"}
    call = {
        "id": "call00001abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(arguments) if arguments_as_text else arguments},
    }
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call00001abc", "name": "get_weather", "content": "sunny, 24 C"},
    ]


@pytest.mark.parametrize(("name", "family", "text_arguments", "turn_end"), CASES)
def test_a_real_template_is_detected_renders_tools_and_its_calls_read_back(name, family, text_arguments, turn_end):
    template = (TEMPLATES / name).read_text(encoding="utf-8")
    fmt = detect_format(template)
    assert fmt is not None and fmt.family == family
    tokenizer = tokenizer_with(template)
    messages = conversation(text_arguments)

    def render(messages: list[dict], *, prompt: bool) -> str:
        return str(tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=prompt))

    with_result = render(messages, prompt=True)
    assert "get_weather" in with_result and "sunny, 24 C" in with_result

    asked, answered = render(messages[:1], prompt=True), render(messages[:2], prompt=False)
    assert answered.startswith(asked), "the assistant turn extends the prompt"
    turn = answered[len(asked) :]
    turn = turn[: len(turn) - len(turn_end)] if turn_end and turn.endswith(turn_end) else turn
    parser = make_parser(fmt, tools=[WEATHER])
    out = [parser.feed(turn), parser.flush()]
    calls = [call for part in out for call in part.calls]
    assert [(call["name"], json.loads(call["arguments"])) for call in calls] == [("get_weather", {"city": "Paris"})]
    assert "get_weather" not in "".join(part.content for part in out), "markup leaked into the content"


def test_a_template_that_opens_reasoning_in_the_prompt_starts_the_output_inside_it():
    template = (TEMPLATES / "deepseek_v31.jinja").read_text(encoding="utf-8")
    tokenizer = tokenizer_with(template)
    messages = [{"role": "user", "content": "hi"}]
    thinking = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=True))
    plain = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert prompt_opens_reasoning(thinking[-32:], THINK) and not prompt_opens_reasoning(plain[-32:], THINK)


def test_special_tokens_name_a_family_when_the_template_does_not():
    assert detect_format(None, ["<|python_tag|>", "<|eot_id|>"]).family == "llama3"  # type: ignore[union-attr]
    assert detect_format("{{ messages }}", ["[TOOL_CALLS]", "[THINK]", "[/THINK]"]).think == ("[THINK]", "[/THINK]")  # type: ignore[union-attr]
    assert detect_format("{{ messages }}", ["<|im_start|>"]) is None
