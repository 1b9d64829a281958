"""Tool-call and reasoning formats per model family (pure): which one a model writes, and its parser.

`detect_format` reads a model's chat template (and the names of its special tokens) and
returns the `ToolFormat` of its family, or None when none is recognised (the caller keeps
mlx-lm's own tool parser then). `make_parser` builds the streaming parser of one request's
output; every family's parser has `OutputParser`'s interface: `feed(text)`, `flush()`, each
returning a `Parsed` (content without markup, reasoning, tool-call deltas and finished calls).
`forced_call_affixes` is what a grammar-forced call is written between, in the family's markup.

    family        tool calls                                                   reasoning
    hermes        <tool_call>{"name": .., "arguments": {..}}</tool_call>         <think>..</think>
    qwen3_coder   <tool_call><function=N><parameter=P>v</parameter></function>   <think>..</think>
    llama3        <|python_tag|>{"name": .., "parameters": {..}} or bare JSON    -
    mistral       [TOOL_CALLS][{..}] or [TOOL_CALLS]N[ARGS]{..}                  [THINK]..[/THINK]
    harmony       <|channel|>commentary to=functions.N<|message|>{..}<|call|>   analysis channel
    deepseek      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>..<｜tool▁calls▁end｜>  <think>..</think>
    glm           <tool_call>N<arg_key>P</arg_key><arg_value>v</arg_value>..     <think>..</think>
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from policies.harmony import HarmonyParser
from policies.output_parser import OutputParser, StreamParser
from policies.tool_formats_json import DEEPSEEK_CALLS, DeepSeekReader, Llama3Reader, MistralReader
from policies.tool_formats_xml import glm_reader, qwen3_coder_reader
from policies.tool_stream import Markup, MarkupParser

THINK = ("<think>", "</think>")
MISTRAL_THINK = ("[THINK]", "[/THINK]")


@dataclass(frozen=True)
class ToolFormat:
    """A family's output format. `think`: its reasoning markers (None: no reasoning block, or
    reasoning of its own kind, as harmony's channels)."""

    family: str
    think: tuple[str, str] | None = None


def detect_format(chat_template: str | None, special_tokens: Collection[str] = ()) -> ToolFormat | None:
    """The family whose markup the chat template (or, failing it, the special tokens) names.
    Most specific first: several families share `<tool_call>`."""
    template = chat_template or ""
    tokens = set(special_tokens)

    def names(*markers: str) -> bool:
        return any(marker in template or marker in tokens for marker in markers)

    think = THINK if names(*THINK) else None
    if names("<|channel|>") and "<|message|>" in template + "".join(tokens):
        return ToolFormat("harmony")
    if DEEPSEEK_CALLS[0] in template:
        return ToolFormat("deepseek", think)
    if "<arg_key>" in template:
        return ToolFormat("glm", think)
    if "<function=" in template and "<tool_call>" in template:
        return ToolFormat("qwen3_coder", think)
    if names("[TOOL_CALLS]"):
        return ToolFormat("mistral", MISTRAL_THINK if names(*MISTRAL_THINK) else None)
    if names("<|python_tag|>") or ("<|start_header_id|>" in template and "parameters" in template):
        return ToolFormat("llama3")
    if "<tool_call>" in template:
        return ToolFormat("hermes", think)
    return None


def tokenizer_format(tokenizer: Any) -> ToolFormat | None:
    """`detect_format` of a loaded tokenizer (mlx-lm's wrapper or a Hugging Face one), read
    through its `chat_template` (one, or several by name) and its added tokens."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    added = getattr(tokenizer, "added_tokens_encoder", None)
    return detect_format(template if isinstance(template, str) else None, added.keys() if isinstance(added, dict) else ())


def prompt_opens_reasoning(prompt_tail: str, think: tuple[str, str] | None) -> bool:
    """Whether the prompt's last text leaves a reasoning block open (a template that ends the
    generation prompt with `<think>`), so the output starts inside it."""
    if think is None:
        return False
    return prompt_tail.rfind(think[0]) > prompt_tail.rfind(think[1])


def make_parser(fmt: ToolFormat, *, tools: list[dict] | None, in_reasoning: bool = False) -> StreamParser:
    """The parser of one request's output. `tools`: the request's tools when it may call them
    (None: calls are not parsed, their markup stays content)."""
    if fmt.family == "harmony":
        return HarmonyParser()
    if tools is None or fmt.family == "hermes":
        markers = ("<tool_call>", "</tool_call>") if tools is not None else None
        return OutputParser(think=fmt.think, tool_markers=markers, in_think=in_reasoning)
    markup = _markup(fmt, tools)
    return MarkupParser(markup, in_reasoning=in_reasoning)


def _markup(fmt: ToolFormat, tools: list[dict]) -> Markup:
    match fmt.family:
        case "qwen3_coder":
            return Markup(qwen3_coder_reader(tools), "<tool_call>", "</tool_call>", think=fmt.think)
        case "glm":
            return Markup(glm_reader(tools), "<tool_call>", "</tool_call>", think=fmt.think)
        case "llama3":
            return Markup(Llama3Reader(), "<|python_tag|>", None, think=fmt.think, bare_json=True)
        case "mistral":
            return Markup(MistralReader(), "[TOOL_CALLS]", None, think=fmt.think)
        case "deepseek":
            return Markup(DeepSeekReader(), DEEPSEEK_CALLS[0], DEEPSEEK_CALLS[1], think=fmt.think)
    raise ValueError(f"no markup for the family {fmt.family!r}")


def forced_call_affixes(fmt: ToolFormat, name: str) -> tuple[str, str] | None:
    """What a grammar-forced call of `name` is written between, around its JSON arguments, in
    the family's markup (None: the family's `<tool_call>` JSON body, as Hermes). Tagged
    families (Qwen3-Coder, GLM) read a JSON body too, so they keep the Hermes form."""
    quoted = json.dumps(name)
    match fmt.family:
        case "llama3":
            return '{"name": ' + quoted + ', "parameters": ', "}"
        case "mistral":
            return f"[TOOL_CALLS]{name}[ARGS]", ""
        case "deepseek":
            return f"{DEEPSEEK_CALLS[0]}<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", f"<｜tool▁call▁end｜>{DEEPSEEK_CALLS[1]}"
        case "harmony":  # `<|call|>` is an end-of-sequence token: the output ends after the arguments
            return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", ""
    return None
