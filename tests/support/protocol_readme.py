"""`protocols/README.md` read as data: its stated version, its message lists, each type's field table
(name, type, default), its error codes and the versions it lists, so tests hold the prose to the wire.

`ProtocolReadme.load()` parses the file. `expected_fields(cls)` renders a `msgspec` struct's fields in
the README's notation (`int`, `str | null`, `[int]`, `{int: float}`, `"a" | "b"`, a record's name;
defaults `required`, `absent` (an unset field, not encoded), JSON values, `{}` for a record's own
defaults). `message()` builds a plain dict from documented fields only, and `conformance()` checks a
decoded plain dict against the README's tables, for clients that know nothing but the README.
"""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from protocols.api import FinishReason
from protocols.errors import ErrorCode
from tests.support.config import REPO

README = REPO / "protocols" / "README.md"
# Literal types the README names instead of spelling out (each has a table of its own values).
NAMED_LITERALS = {frozenset(typing.get_args(ErrorCode)): "ErrorCode", frozenset(typing.get_args(FinishReason)): "FinishReason"}
PRIMITIVES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (float,), "str": (str,), "bool": (bool,), "null": (type(None),), "any": (object,)}


@dataclass(frozen=True)
class FieldDoc:
    name: str
    type: str
    default: str


@dataclass
class Section:
    level: int
    title: str
    lines: list[str] = field(default_factory=list)

    def tables(self) -> list[list[list[str]]]:
        """Each markdown table of the section as rows of cells (header and rule dropped)."""
        tables, rows = [], []
        for line in [*self.lines, ""]:
            if line.startswith("|"):
                rows.append(cells(line))
            elif rows:
                tables.append([row for row in rows[2:]])
                rows = []
        return tables


def cells(line: str) -> list[str]:
    """A table row's cells: split on unescaped pipes, `\\|` unescaped, code spans unwrapped."""
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [part.strip().replace("\\|", "|").replace("`", "") for part in parts]


def sections(text: str) -> list[Section]:
    found = [Section(0, "")]
    for line in text.splitlines():
        if match := re.match(r"(#+) (.*)", line):
            found.append(Section(len(match.group(1)), match.group(2).strip()))
        else:
            found[-1].lines.append(line)
    return found


@dataclass
class ProtocolReadme:
    text: str
    version: int
    client_messages: list[str]
    server_messages: list[str]
    # (type name, protocol version the table is for; None: every supported version) -> fields.
    types: dict[tuple[str, int | None], list[FieldDoc]]
    error_codes: list[str]
    finish_reasons: list[str]
    versions: list[int]

    @classmethod
    def load(cls, path: Path = README) -> ProtocolReadme:
        text = path.read_text()
        title = re.match(r"# .*\(version (\d+)\)", text)
        assert title, "the README's title states the protocol version: '# ... (version N)'"
        found = sections(text)
        by_title = {s.title: s for s in found}
        types = {}
        for section in found:
            if match := re.fullmatch(r"`(\w+)`(?: \(version (\d+)\))?", section.title):
                if section.level != 3:
                    continue
                key = (match.group(1), int(match.group(2)) if match.group(2) else None)
                assert key not in types, f"two tables for {key}"
                tables = section.tables()
                no_fields = any("No fields." in line for line in section.lines)
                assert len(tables) == 1 or (no_fields and not tables), f"{key}: one field table (or 'No fields.')"
                types[key] = [FieldDoc(*row[:3]) for row in tables[0]] if tables else []
        return cls(
            text=text,
            version=int(title.group(1)),
            client_messages=first_column(by_title["Client → server"]),
            server_messages=first_column(by_title["Server → client"]),
            types=types,
            error_codes=first_column(by_title["Error codes"]),
            finish_reasons=first_column(by_title["Finish reasons"]),
            versions=[int(v) for v in first_column(by_title["Versions"])],
        )

    def fields(self, name: str, version: int | None = None) -> dict[str, FieldDoc]:
        """The documented fields of `name` as sent on a connection of `version`."""
        rows = self.types.get((name, version)) if version is not None else None
        if rows is None:
            rows = self.types[(name, None)]
        return {row.name: row for row in rows}

    def paths(self) -> set[str]:
        """The repository files the README names (code spans of the form `dir/name.ext`)."""
        return set(re.findall(r"`((?:[\w.-]+/)+[\w-]+\.\w+)`", self.text))

    def message(self, name: str, **values: Any) -> dict[str, Any]:
        """A message as a plain dict, refused unless the README documents each field and its type."""
        assert name in self.client_messages, f"{name} is not a documented client message"
        body = {"type": name, **values}
        problem = self.conformance(body)
        assert problem is None, problem
        return body

    def conformance(self, message: Any, version: int | None = None) -> str | None:
        """Why a decoded message does not match the README (None when it does)."""
        if not isinstance(message, dict) or message.get("type") not in [*self.client_messages, *self.server_messages]:
            return f"not a documented message: {message!r}"
        body = {k: v for k, v in message.items() if k != "type"}
        return self._record(message["type"], body, version, message["type"])

    def _record(self, name: str, value: Any, version: int | None, where: str) -> str | None:
        if not isinstance(value, dict):
            return f"{where}: expected a map ({name}), got {value!r}"
        documented = self.fields(name, version)
        if unknown := set(value) - set(documented):
            return f"{where}: fields the README does not document: {sorted(unknown)}"
        if missing := {n for n, f in documented.items() if f.default == "required"} - set(value):
            return f"{where}: required fields missing: {sorted(missing)}"
        for key, item in value.items():
            if problem := self.check(item, documented[key].type, version, f"{where}.{key}"):
                return problem
        return None

    def check(self, value: Any, type_text: str, version: int | None = None, where: str = "value") -> str | None:
        """Why `value` (decoded msgpack) is not of the README type `type_text` (None when it is)."""
        options = split_top(type_text, " | ")
        if len(options) > 1:
            problems = [self.check(value, option, version, where) for option in options]
            return None if None in problems else f"{where}: {value!r} is none of {type_text}"
        if type_text in PRIMITIVES:
            ok = isinstance(value, PRIMITIVES[type_text]) and not (type_text == "int" and isinstance(value, bool))
            return None if ok else f"{where}: expected {type_text}, got {value!r}"
        if type_text.startswith('"'):
            return None if value == json.loads(type_text) else f"{where}: expected {type_text}, got {value!r}"
        if type_text.startswith("["):
            if not isinstance(value, list):
                return f"{where}: expected {type_text}, got {value!r}"
            return next((p for i, v in enumerate(value) if (p := self.check(v, type_text[1:-1], version, f"{where}[{i}]"))), None)
        if type_text.startswith("{"):
            key_type, value_type = split_top(type_text[1:-1], ": ")
            if not isinstance(value, dict):
                return f"{where}: expected {type_text}, got {value!r}"
            for k, v in value.items():
                if problem := self.check(k, key_type, version, f"{where} key") or self.check(v, value_type, version, f"{where}[{k!r}]"):
                    return problem
            return None
        if type_text == "ErrorCode":
            return None if value in self.error_codes else f"{where}: {value!r} is not a documented error code"
        if type_text == "FinishReason":
            return None if value in self.finish_reasons else f"{where}: {value!r} is not a documented finish reason"
        if (type_text, None) in self.types:
            return self._record(type_text, value, version, where)
        return f"{where}: the README's type {type_text!r} is not defined"


def first_column(section: Section) -> list[str]:
    tables = section.tables()
    assert tables, f"section {section.title!r} has a table"
    return [row[0] for row in tables[0]]


def split_top(text: str, separator: str) -> list[str]:
    """`text` split on `separator` outside brackets and braces."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        if text[i] in "[{":
            depth += 1
        elif text[i] in "]}":
            depth -= 1
        elif depth == 0 and text.startswith(separator, i):
            parts.append(text[start:i])
            start = i = i + len(separator)
            continue
        i += 1
    return [*parts, text[start:]]


# -- the wire types in the README's notation -------------------------------------------------


def render_type(t: mi.Type) -> str:
    match t:
        case mi.IntType():
            return "int"
        case mi.FloatType():
            return "float"
        case mi.StrType():
            return "str"
        case mi.BoolType():
            return "bool"
        case mi.NoneType():
            return "null"
        case mi.AnyType():
            return "any"
        case mi.ListType(item_type=item):
            return f"[{render_type(item)}]"
        case mi.DictType(key_type=key, value_type=value):
            return f"{{{render_type(key)}: {render_type(value)}}}"
        case mi.LiteralType(values=values):
            # msgspec folds `Literal[...] | None` into one literal holding None.
            named = NAMED_LITERALS.get(frozenset(v for v in values if v is not None))
            if named is None:
                return " | ".join(json.dumps(v) for v in values)
            return f"{named} | null" if None in values else named
        case mi.UnionType(types=types):
            return " | ".join(render_type(option) for option in types)
        case mi.StructType(cls=cls):
            return cls.__name__
    raise AssertionError(f"no README notation for {t!r}")


def render_default(f: mi.Field) -> str:
    if f.required:
        return "required"
    if f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT:
        return "absent"  # an UNSET field: not encoded at all
    value = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
    if isinstance(value, msgspec.Struct):
        assert not msgspec.structs.asdict(value) or value == type(value)(), value
        return "{}"
    return json.dumps(value)


def expected_fields(cls: type) -> list[FieldDoc]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return [FieldDoc(f.encode_name, render_type(f.type), render_default(f)) for f in info.fields]


def referenced_records(t: mi.Type) -> list[type]:
    """The struct classes `t` mentions (one level: a record's own fields are walked by the caller)."""
    match t:
        case mi.StructType(cls=cls):
            return [cls]
        case mi.ListType(item_type=item):
            return referenced_records(item)
        case mi.DictType(key_type=key, value_type=value):
            return referenced_records(key) + referenced_records(value)
        case mi.UnionType(types=types):
            return [cls for option in types for cls in referenced_records(option)]
    return []


def reachable_types(*roots: Any) -> list[type]:
    """Every struct class reachable from the union types `roots`, each once, roots first."""
    seen: list[type] = []
    todo: list[type] = [cls for root in roots for cls in referenced_records(mi.type_info(root))]
    while todo:
        cls = todo.pop(0)
        if cls in seen:
            continue
        seen.append(cls)
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        todo += [ref for f in info.fields for ref in referenced_records(f.type)]
    return seen
