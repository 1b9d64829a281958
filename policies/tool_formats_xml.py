"""Region readers of the families whose calls carry tagged parameters (pure): Qwen3-Coder and GLM 4.5+.

    Qwen3-Coder: <tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>
    GLM 4.5/4.7: <tool_call>NAME<arg_key>P</arg_key><arg_value>value</arg_value>...</tool_call>

Values are text; each becomes JSON by its parameter's schema type (a string stays a string,
others are read as JSON, as mlx-lm's and vLLM's parsers do). The arguments' JSON text is built
one parameter at a time (`{"a": 1, "b": "x"}`): a parameter whose type is string streams as its
value arrives, others when their value is closed, so the fragments always add up to the whole.
A region that is a JSON call body (what a grammar-forced call writes) is read as one.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from policies.output_parser import partial_suffix
from policies.tool_stream import CallText, JsonScanner, read_json_call

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


def parameter_schemas(tools: list[dict] | None, name: str) -> dict[str, dict]:
    """The `properties` of the tool `name` among a request's tools ({} if unknown)."""
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def _type_of(schema: dict | None) -> str | None:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["string", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), None)
    return str(kind).strip().lower() if kind is not None else None


def is_string_parameter(schema: dict | None) -> bool:
    return _type_of(schema) in _STRING_TYPES


def convert_value(value: str, schema: dict | None, *, untyped_is_string: bool) -> Any:
    """A parameter's text as the JSON value its schema asks for (the text itself when it
    cannot be read as that type)."""
    kind = _type_of(schema)
    if kind in _STRING_TYPES or (kind is None and untyped_is_string and schema is None):
        return value
    if value.lower() == "null":
        return None
    try:
        if kind is not None and kind.startswith(("int", "uint", "long", "short")):
            number = float(value)
            return int(number) if number.is_integer() else number
        if kind is not None and kind.startswith(("num", "float", "double")):
            number = float(value)
            return int(number) if number.is_integer() else number
        if kind in ("boolean", "bool"):
            return value.strip().lower() == "true"
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


class _Arguments:
    """The arguments' JSON text, one parameter at a time."""

    def __init__(self) -> None:
        self.text = "{"

    def add(self, key: str, value: Any) -> None:
        self.text += ("" if self.text == "{" else ", ") + f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"

    def partial_string(self, key: str, value: str, encoding: _Encoding) -> str:
        """The text so far with a string parameter still arriving (without its closing quote)."""
        if not value or (len(value) <= 4 and "null".startswith(value.lower())):
            return self.text  # too early to tell it from null
        return self.text + ("" if self.text == "{" else ", ") + f"{json.dumps(key, ensure_ascii=False)}: {encoding.open_string(value)}"


class _Encoding:
    """A growing string value as JSON without its closing quote, encoding only what is new (JSON
    escapes each character on its own), so a long value streams in time linear in its length."""

    def __init__(self) -> None:
        self._value, self._text = "", '"'

    def open_string(self, value: str) -> str:
        if not value.startswith(self._value):
            self._value, self._text = "", '"'
        self._text += json.dumps(value[len(self._value) :], ensure_ascii=False)[1:-1]
        self._value = value
        return self._text


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")


def qwen3_coder_reader(tools: list[dict] | None):
    scan, encoding = JsonScanner(), _Encoding()

    def read(text: str, closed: bool) -> list[CallText]:
        if text.lstrip().startswith("{"):
            return [read_json_call(text, 0, closed, scan)]
        function = _FUNCTION.match(text)
        if function is None:
            return [CallText(error="not a tool call", raw=text) if closed else CallText(raw=text)]
        name, pos = function[1].strip(), function.end()
        schemas, arguments = parameter_schemas(tools, name), _Arguments()
        while (parameter := _PARAMETER.match(text, pos)) is not None:
            key, start = parameter[1].strip(), parameter.end()
            end = text.find("</parameter>", start)
            if end < 0:
                if closed:  # cut off inside a value
                    arguments.add(key, convert_value(_trim_newlines(text[start:], partial=False), schemas.get(key), untyped_is_string=True))
                    return [CallText(name=name, arguments=arguments.text + "}", raw=text)]
                value = text[start:]
                value = _trim_newlines(value[: len(value) - partial_suffix(value, "</parameter>")], partial=True)
                partial = arguments.partial_string(key, value, encoding) if is_string_parameter(schemas.get(key)) else arguments.text
                return [CallText(name=name, arguments=partial, raw=text)]
            arguments.add(key, convert_value(_trim_newlines(text[start:end], partial=False), schemas.get(key), untyped_is_string=True))
            pos = end + len("</parameter>")
        done = closed or text.find("</function>", pos) >= 0
        return [CallText(name=name, arguments=arguments.text + ("}" if done else ""), complete=done, raw=text)]

    return read


def _trim_newlines(value: str, *, partial: bool) -> str:
    """A Qwen3-Coder value without the newline after its opening tag and before its closing one."""
    value = value[1:] if value.startswith("\n") else value
    if partial:
        return value.rstrip("\n") if value.endswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


_ARG_KEY = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>", re.DOTALL)


def glm_reader(tools: list[dict] | None):
    scan, encoding = JsonScanner(), _Encoding()

    def read(text: str, closed: bool) -> list[CallText]:
        if text.lstrip().startswith("{"):
            return [read_json_call(text, 0, closed, scan)]
        key_at = text.find("<arg_key>")
        head = text[:key_at] if key_at >= 0 else text
        named = key_at >= 0 or closed or "\n" in head.lstrip()
        name = head.strip()
        if not named:
            return [CallText(raw=text)]
        if not name or any(c.isspace() for c in name) or "<" in name:
            return [CallText(error="not a tool call", raw=text) if closed else CallText(raw=text)]
        schemas, arguments = parameter_schemas(tools, name), _Arguments()
        pos = key_at if key_at >= 0 else len(text)
        while (pair := _ARG_KEY.match(text, pos)) is not None:
            key, start = pair[1].strip(), pair.end()
            end = text.find("</arg_value>", start)
            schema = schemas.get(key)
            if end < 0:
                value = text[start:].strip()
                if closed:
                    arguments.add(key, value if is_string_parameter(schema) else convert_value(value, schema, untyped_is_string=False))
                    return [CallText(name=name, arguments=arguments.text + "}", raw=text)]
                value = text[start:].lstrip()
                value = value[: len(value) - partial_suffix(value, "</arg_value>")].rstrip()
                partial = arguments.partial_string(key, value, encoding) if is_string_parameter(schema) else arguments.text
                return [CallText(name=name, arguments=partial, raw=text)]
            value = text[start:end].strip()
            arguments.add(key, value if is_string_parameter(schema) else convert_value(value, schema, untyped_is_string=False))
            pos = end + len("</arg_value>")
        return [CallText(name=name, arguments=arguments.text + ("}" if closed else ""), complete=closed, raw=text)]

    return read
