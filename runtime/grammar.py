"""Structured output: requests' formats as xgrammar grammars, compiled once each.

`grammar_spec` turns a request's `response_format` (or its tools with a forcing
`tool_choice`) into a plain-data `GrammarSpec`, rejecting malformed ones with
`InvalidRequestError`. `GrammarCache` compiles specs with xgrammar on a small pool of
worker threads (never the event loop, never the MLX thread), each within a time limit,
and keeps compiled grammars under a byte budget: the grammars of live requests are
pinned (`acquire`/`release`), so the engine's `matcher` only ever finds them.
JSON grammars are compact (no free whitespace): a model cannot wander in
whitespace forever, and the output is still valid JSON.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import structlog
import xgrammar as xgr

from actors.mlx_thread import loop_caller
from policies.tool_formats import ToolFormat, forced_call_affixes, tokenizer_format
from policies.tools import tool_function
from protocols.api import GenerateRequest
from protocols.config import LimitsConfig
from protocols.model import GrammarSpec, ModelInfo
from runtime.errors import InvalidRequestError, ServerBusyError

log = structlog.get_logger(actor="grammar")

TOOL_CHOICES = ("auto", "none", "required")
# xgrammar prefixes its messages with "[hh:mm:ss] /its/source/file.cc:line: ".
_SOURCE_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\]\s*\S+:\d+:\s*")


def model_tool_markers(tokenizer: Any) -> tuple[str, str] | ToolFormat | None:
    """How a model's calls are marked, for `grammar_spec`: its family's format where a forced
    call is written in it, else mlx-lm's tool-call start and end, else None (no tool calls)."""
    fmt = tokenizer_format(tokenizer)
    if fmt is not None and forced_call_affixes(fmt, "f") is not None:
        return fmt
    if getattr(tokenizer, "has_tool_calling", False):
        return (tokenizer.tool_call_start, tokenizer.tool_call_end)
    return ("<tool_call>", "</tool_call>") if fmt is not None else None


def grammar_spec(request: GenerateRequest, tool_markers: tuple[str, str] | ToolFormat | None) -> GrammarSpec | None:
    """The grammar a request asks for, or None. `tool_markers`: the model's tool-call start and
    end, or its family's format (`model_tool_markers`)."""
    forced = _forced_tools(request)
    if forced is not None:
        if request.response_format is not None:
            raise InvalidRequestError("response_format and a forcing tool_choice cannot be combined", field="response_format")
        if tool_markers is None:
            raise InvalidRequestError("this model's chat template has no tool-call format", field="tools")
        if isinstance(tool_markers, ToolFormat):
            # The call in the family's own markup, around its JSON arguments.
            affixes = [forced_call_affixes(tool_markers, tool["name"]) for tool in forced]
            return GrammarSpec(kind="tool_call", source=json.dumps({"tools": forced, "affixes": affixes}, sort_keys=True))
        source = json.dumps({"tools": forced, "markers": list(tool_markers)}, sort_keys=True)
        return GrammarSpec(kind="tool_call", source=source)
    if request.tools and request.tool_choice in (None, "auto") and tool_markers is None:
        # The model may call them, but its calls could not be told from its text.
        raise InvalidRequestError("this model's chat template has no tool-call format", field="tools")
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
        return GrammarSpec(kind="json_schema", source=json.dumps(_strict_strings(schema, "response_format")))
    if kind == "regex" and isinstance(fmt.get("pattern"), str):
        return GrammarSpec(kind="regex", source=fmt["pattern"])
    if kind == "grammar" and isinstance(fmt.get("ebnf"), str):
        return GrammarSpec(kind="ebnf", source=fmt["ebnf"])
    raise InvalidRequestError(f"unsupported response_format {kind!r} (json_schema, json_object, regex, grammar, text)", field="response_format")


def _strict_strings(node: Any, field: str) -> Any:
    """Length-bounded strings as an equivalent pattern without control characters.

    xgrammar compiles `maxLength` strings to "any character but quote, backslash,
    CR, LF", which admits raw tabs and other control characters that strict JSON
    parsers reject; the pattern keeps the bounds and excludes them (and escapes).
    """
    if isinstance(node, list):
        return [_strict_strings(item, field) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _strict_strings(value, field) for key, value in node.items()}
    for key in ("minLength", "maxLength"):
        value = node.get(key)
        if key in node and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise InvalidRequestError(f"{key} must be a non-negative integer, got {value!r}", field=field)
    bounded = "minLength" in node or "maxLength" in node
    if node.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & node.keys():
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = rf'^[^\x00-\x1f"\\]{{{low},{high}}}$'
    return node


def _forced_tools(request: GenerateRequest) -> list[dict] | None:
    """The tools a `tool_choice` forces a call of (None when the model may answer freely)."""
    tools, choice = request.tools, request.tool_choice
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise InvalidRequestError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function, got {choice!r}", field="tool_choice")
    if choice is None or choice in ("auto", "none"):
        return None
    if not tools:
        raise InvalidRequestError("tool_choice needs tools", field="tool_choice")
    functions = [_function(tool) for tool in tools]
    if choice == "required":
        return functions
    if not isinstance(choice, dict):
        raise InvalidRequestError('tool_choice must be {"type": "function", "function": {"name": ...}}', field="tool_choice")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise InvalidRequestError('tool_choice must be {"type": "function", "function": {"name": ...}}', field="tool_choice")
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise InvalidRequestError(f"tool_choice names no known tool: {choice!r}", field="tool_choice")
    return chosen


def _function(tool: Any) -> dict:
    function = tool_function(tool)
    return {"name": function["name"], "parameters": _strict_strings(function["parameters"], "tools")}


def spec_field(spec: GrammarSpec) -> str:
    """The request field a grammar comes from (for errors)."""
    return "tools" if spec.kind == "tool_call" else "response_format"


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its source paths and timestamps (last non-empty line)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = _SOURCE_PREFIX.sub("", lines[-1]) if lines else type(exc).__name__
    return text[:500]


@dataclass
class _Compiled:
    grammar: xgr.CompiledGrammar
    num_bytes: int
    pins: int = 0


class GrammarCache:
    """Compiled grammars by spec, for one tokenizer, within `max_bytes`. Thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        max_bytes: int = 512 * 1024 * 1024,
        timeout_s: float = 10.0,
        workers: int = 2,
    ):
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        # Our own cache is the one that counts: xgrammar's would keep a second copy.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=workers, cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._compiled: OrderedDict[GrammarSpec, _Compiled] = OrderedDict()
        self._compiling: dict[GrammarSpec, concurrent.futures.Future] = {}
        self._waiters: dict[GrammarSpec, int] = {}
        # Reentrant: a compile that is already done runs its callbacks in the submitting thread.
        self._lock = threading.RLock()

    @classmethod
    def for_model(cls, tokenizer: Any, info: ModelInfo, limits: LimitsConfig) -> GrammarCache:
        """The cache for a loaded model's tokenizer, within the configured limits."""
        return cls(tokenizer, info.vocab_size, info.eos_token_ids, max_bytes=limits.grammar_cache_bytes, timeout_s=limits.grammar_compile_timeout_s)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(c.num_bytes for c in self._compiled.values())

    def __len__(self) -> int:
        return len(self._compiled)

    async def acquire(self, spec: GrammarSpec) -> None:
        """Compile (or find) a grammar and pin it until `release`.

        Raises `InvalidRequestError` for a grammar xgrammar rejects, one that is not compiled
        within `timeout_s` (waiting for a worker included) or is larger than the whole cache
        compiled; `ServerBusyError` when live requests' grammars fill the cache.
        """
        future = self._pinned_or_future(spec)
        if future is None:
            return
        done = anyio.Event()
        call_soon = loop_caller(anyio.lowlevel.current_token())
        future.add_done_callback(lambda _: _wake(call_soon, done.set))
        try:
            with anyio.move_on_after(self.timeout_s):
                await done.wait()
        finally:
            with self._lock:
                self._waiters[spec] -= 1
                if self._waiters[spec] == 0:
                    del self._waiters[spec]
                    future.cancel()  # nobody waits any more: drop it unless it already runs
        if future.cancelled() or not future.done():
            raise InvalidRequestError(f"the grammar did not compile within {self.timeout_s:g} s (limits.grammar_compile_timeout_s)", field=spec_field(spec))
        with self._lock:
            self._insert(spec, future.result(), pin=True)

    def release(self, spec: GrammarSpec) -> None:
        with self._lock:
            entry = self._compiled.get(spec)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
            self._evict(0)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Compile (or find) a grammar now, blocking; not pinned (tests and tools)."""
        with self._lock:
            entry = self._compiled.get(spec)
        if entry is not None:
            return entry.grammar
        compiled = self._build_checked(spec)
        with self._lock:
            self._insert(spec, compiled, pin=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> xgr.GrammarMatcher:
        """A fresh matcher for a pinned grammar (the engine's call: it never compiles)."""
        with self._lock:
            entry = self._compiled.get(spec)
        if entry is None:
            raise KeyError(f"grammar {spec.kind} is not compiled (it must be acquired first)")
        return xgr.GrammarMatcher(entry.grammar)

    def _pinned_or_future(self, spec: GrammarSpec) -> concurrent.futures.Future | None:
        """Pin a compiled grammar (None), or the compile to wait for (counted as a waiter).

        Queued compiles are bounded by the requests being admitted (`Admission`)."""
        with self._lock:
            entry = self._compiled.get(spec)
            if entry is not None:
                entry.pins += 1
                self._compiled.move_to_end(spec)
                return None
            future = self._compiling.get(spec)
            if future is None or future.cancelled():
                future = self._pool.submit(self._build_checked, spec)
                self._compiling[spec] = future
                future.add_done_callback(lambda f: self._compiled_in_background(spec, f))
            self._waiters[spec] = self._waiters.get(spec, 0) + 1
            return future

    def _compiled_in_background(self, spec: GrammarSpec, future: concurrent.futures.Future) -> None:
        """Keep a finished compile even if nobody waits for it any more (a timed-out request)."""
        with self._lock:
            if self._compiling.get(spec) is future:
                del self._compiling[spec]
            if not future.cancelled() and future.exception() is None and spec not in self._compiled:
                try:
                    self._insert(spec, future.result(), pin=False)
                except (InvalidRequestError, ServerBusyError):
                    pass

    def _insert(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar, *, pin: bool) -> None:
        """Add (or pin) an entry, evicting unpinned ones as needed. Call with the lock held."""
        entry = self._compiled.get(spec)
        if entry is None:
            size = int(compiled.memory_size_bytes)
            if size > self.max_bytes:
                raise InvalidRequestError(
                    f"the compiled grammar needs {size} bytes, more than limits.grammar_cache_bytes ({self.max_bytes})",
                    field=spec_field(spec),
                )
            if not self._evict(size):
                raise ServerBusyError("compiled grammars of running requests fill limits.grammar_cache_bytes; retry later")
            entry = self._compiled[spec] = _Compiled(compiled, size)
        entry.pins += pin
        self._compiled.move_to_end(spec)

    def _evict(self, room: int) -> bool:
        """Drop least recently used unpinned grammars until `room` more bytes fit."""
        total = sum(c.num_bytes for c in self._compiled.values())
        for spec in [s for s, c in self._compiled.items() if c.pins == 0]:
            if total + room <= self.max_bytes:
                break
            total -= self._compiled.pop(spec).num_bytes
        return total + room <= self.max_bytes

    def _build_checked(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            compiled = self._build(spec)
        except InvalidRequestError:
            raise
        except Exception as exc:  # xgrammar reports bad grammars with several exception types
            raise InvalidRequestError(f"invalid {spec.kind} grammar: {_clean(exc)}", field=spec_field(spec)) from None
        if not _admits_a_first_token(compiled, self.vocab_size):  # e.g. `root ::= root`
            raise InvalidRequestError(f"the {spec.kind} grammar admits no text at all", field=spec_field(spec))
        return compiled

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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _admits_a_first_token(compiled: xgr.CompiledGrammar, vocab_size: int) -> bool:
    """Whether a fresh matcher allows any token (the end of sequence included)."""
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any().item())


def _wake(call_soon, callback) -> None:
    try:
        call_soon(callback)
    except RuntimeError:  # the event loop is gone; nobody waits
        pass


def _tool_call_grammar(source: dict) -> xgr.Grammar:
    """<start>{"name": <one tool>, "arguments": <its parameters>}<end>, in the model's own markup
    (or, for a family's format, <prefix of one tool><its parameters><suffix>)."""
    if "affixes" in source:
        return _affixed_call_grammar(source)
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


def _affixed_call_grammar(source: dict) -> xgr.Grammar:
    """One call of one of the tools: its family's prefix, JSON arguments per its schema, suffix."""

    def literal(text: str) -> xgr.Grammar:
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")

    calls = []
    for tool, (prefix, suffix) in zip(source["tools"], source["affixes"]):
        parts = [literal(prefix), xgr.Grammar.from_json_schema(json.dumps(tool["parameters"]), any_whitespace=False)]
        calls.append(xgr.Grammar.concat(*parts, *([literal(suffix)] if suffix else [])))
    return calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
