"""Each model family's real chat template on a tiny random model, end to end: a grammar-forced call
(`tool_choice` "required" or a named function) is written in the family's markup, read back by the
family's parser and arrives as a `ToolCall`, its arguments valid, with no markup in the text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta, ToolCall
from protocols.api import ToolCallDelta
from runtime import Runtime
from tests.support.config import builtin_dir, make_config
from tests.support.tool_schemas import CLOCK as UNDESCRIBED_CLOCK
from tests.support.tool_schemas import WEATHER

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
# gpt-oss's template reads every tool's description.
CLOCK: dict = {"type": "function", "function": {**UNDESCRIBED_CLOCK["function"], "description": "The time in a zone"}}  # type: ignore[dict-item]
MARKUP = ("<tool_call>", "[TOOL_CALLS]", "<|channel|>", "<|message|>", "<｜tool", "<arg_key>", "<function=", '"name"')


def model_with_template(root: Path, template: str) -> Path:
    """The tiny built-in model with another chat template (its tokenizer and weights unchanged)."""
    model = root / "model"
    shutil.copytree(builtin_dir("tiny"), model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = (TEMPLATES / template).read_text(encoding="utf-8")
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return model


async def forced_call(model: Path, choice) -> tuple[str, list[ToolCall], list[ToolCallDelta], Finished]:
    request = GenerateRequest(
        messages=[{"role": "user", "content": "What time is it in Oslo?"}],
        tools=[WEATHER, CLOCK],
        tool_choice=choice,
        max_tokens=400,  # the tiny vocabulary spells DeepSeek's markers a byte at a time
        sampling=SamplingParams(temperature=0.0),
        stream_tool_calls=True,
    )
    text, calls, deltas, finished = "", [], [], None
    async with Runtime.open(make_config(str(model))) as rt:
        async for event in rt.generate(request):
            match event:
                case TokenDelta():
                    text += event.text
                case ToolCall():
                    calls.append(event)
                case ToolCallDelta():
                    deltas.append(event)
                case Finished():
                    finished = event
    assert finished is not None
    return text, calls, deltas, finished


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("template", "choice"),
    [
        ("gpt_oss.jinja", NAMED),
        ("mistral3.jinja", "required"),
        ("llama32_json.jinja", NAMED),
        ("deepseek_v31.jinja", "required"),
        ("qwen3_coder.jinja", NAMED),
        ("glm45.jinja", "required"),
    ],
)
async def test_a_forced_call_in_the_familys_markup_comes_back_parsed(tmp_path, template, choice):
    text, calls, deltas, finished = await forced_call(model_with_template(tmp_path, template), choice)
    assert finished.finish_reason == "stop", finished.error
    [call] = calls
    tool: dict = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]
    if choice == NAMED:
        assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])
    assert not any(marker in text for marker in MARKUP), text
    # Streamed: the name first, then fragments that add up to the call's arguments.
    assert deltas[0].name == call.name and "".join(d.arguments for d in deltas) == call.arguments
