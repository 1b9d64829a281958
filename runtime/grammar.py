"""Structured output: requests' formats as xgrammar grammars, compiled once each.

`grammar_spec` turns a request's `response_format` (or its tools with a forcing
`tool_choice`) into a plain-data `GrammarSpec`, rejecting malformed or oversize
ones with `InvalidRequestError`. `GrammarCache` compiles specs with xgrammar's
compiler (call `compile` from a worker thread: never the event loop, never the
MLX thread) and hands the engine a fresh `GrammarMatcher` per request.
JSON grammars are compact (no free whitespace): a model cannot wander in
whitespace forever, and the output is still valid JSON.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from protocols.api import GenerateRequest
from protocols.model import GrammarSpec
from runtime.errors import InvalidRequestError

MAX_GRAMMAR_BYTES = 64 * 1024
MAX_COMPILED = 256


def grammar_spec(request: GenerateRequest, tool_markers: tuple[str, str] | None) -> GrammarSpec | None:
    """The grammar a request asks for, or None. `tool_markers`: the model's tool-call start and end."""
    forced = _forced_tools(request)
    if forced is not None:
        if request.response_format is not None:
            raise InvalidRequestError("response_format and a forcing tool_choice cannot be combined", field="response_format")
        if tool_markers is None:
            raise InvalidRequestError("this model's chat template has no tool-call format", field="tools")
        source = json.dumps({"tools": forced, "markers": list(tool_markers)}, sort_keys=True)
        return _sized(GrammarSpec(kind="tool_call", source=source))
    fmt = request.response_format
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("response_format must be an object", field="response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(kind="json_object")
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError('json_schema needs {"json_schema": {"schema": {...}}}', field="response_format")
        # Key order is kept: it is the order the output follows.
        return _sized(GrammarSpec(kind="json_schema", source=json.dumps(_strict_strings(schema))))
    if kind == "regex" and isinstance(fmt.get("pattern"), str):
        return _sized(GrammarSpec(kind="regex", source=fmt["pattern"]))
    if kind == "grammar" and isinstance(fmt.get("ebnf"), str):
        return _sized(GrammarSpec(kind="ebnf", source=fmt["ebnf"]))
    raise InvalidRequestError(f"unsupported response_format {kind!r} (json_schema, json_object, regex, grammar, text)", field="response_format")


def _strict_strings(node: Any) -> Any:
    """Length-bounded strings as an equivalent pattern without control characters.

    xgrammar compiles `maxLength` strings to "any character but quote, backslash,
    CR, LF", which admits raw tabs and other control characters that strict JSON
    parsers reject; the pattern keeps the bounds and excludes them (and escapes).
    """
    if isinstance(node, list):
        return [_strict_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _strict_strings(value) for key, value in node.items()}
    bounded = "minLength" in node or "maxLength" in node
    if node.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & node.keys():
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = r'^[^\x00-\x1f"\\]{%d,%s}$' % (low, high)
    return node


def _forced_tools(request: GenerateRequest) -> list[dict] | None:
    """The tools a `tool_choice` forces a call of (None when the model may answer freely)."""
    tools, choice = request.tools, request.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    if not tools:
        raise InvalidRequestError("tool_choice needs tools", field="tool_choice")
    functions = [_function(tool) for tool in tools]
    if choice == "required":
        return functions
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise InvalidRequestError(f"tool_choice names no known tool: {choice!r}", field="tool_choice")
    return chosen


def _function(tool: Any) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError('tools must be [{"type": "function", "function": {"name": ..., "parameters": {...}}}]', field="tools")
    parameters = function.get("parameters") or {"type": "object"}
    return {"name": function["name"], "parameters": _strict_strings(parameters)}


def _sized(spec: GrammarSpec) -> GrammarSpec:
    if len(spec.source.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError(f"the grammar exceeds {MAX_GRAMMAR_BYTES} bytes", field="response_format")
    return spec


class GrammarCache:
    """Compiled grammars by spec, for one tokenizer. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info)
        self._compiled: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Compile (or find) a grammar; raises `InvalidRequestError` for one xgrammar rejects."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        try:
            compiled = self._build(spec)
        except (RuntimeError, ValueError, TypeError, json.JSONDecodeError) as exc:
            raise InvalidRequestError(f"invalid {spec.kind} grammar: {str(exc).strip().splitlines()[-1]}", field="response_format") from None
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(spec))

    def _build(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiler = self._compiler
        match spec.kind:
            case "json_schema":
                return compiler.compile_json_schema(spec.source, any_whitespace=False)
            case "json_object":
                return compiler.compile_grammar(xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False))
            case "regex":
                return compiler.compile_regex(spec.source)
            case "ebnf":
                return compiler.compile_grammar(spec.source)
            case "tool_call":
                return compiler.compile_grammar(_tool_call_grammar(json.loads(spec.source)))
        raise ValueError(f"unknown grammar kind {spec.kind!r}")


def _tool_call_grammar(source: dict) -> xgr.Grammar:
    """<start>{"name": <one tool>, "arguments": <its parameters>}<end>, in the model's own markup."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool["name"]}, "arguments": tool["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in source["tools"]
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    start, end = source["markers"]
    return xgr.Grammar.concat(
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(start + chr(10))}"),
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
        xgr.Grammar.from_ebnf(f"root ::= {json.dumps(chr(10) + end)}"),
    )
