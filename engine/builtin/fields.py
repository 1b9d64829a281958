"""Config data frozen for hashable specs: JSON-like values as sorted nested tuples."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast


class FrozenMapping(tuple[tuple[str, Any], ...]):
    """A JSON object frozen into (key, value) pairs sorted by key, so that a spec
    holding one stays hashable and compares by content; `thaw` gives the dict back."""

    __slots__ = ()


ConfigFields = tuple[tuple[str, Any], ...]


def freeze(value: Any) -> Any:
    """JSON-like data (dicts, lists, scalars) -> hashable nested tuples."""
    if isinstance(value, FrozenMapping):
        return value
    if isinstance(value, Mapping):
        items = ((str(key), freeze(item)) for key, item in value.items())
        return FrozenMapping(sorted(items, key=lambda pair: pair[0]))
    if isinstance(value, list | tuple):
        return tuple(freeze(item) for item in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"not JSON-like config data: {value!r}")


def thaw(value: Any) -> Any:
    """Inverse of `freeze`: frozen mappings -> dicts, tuples -> lists."""
    if isinstance(value, FrozenMapping):
        return {key: thaw(item) for key, item in value}
    if isinstance(value, tuple):
        return [thaw(item) for item in value]
    return value


def config_fields(**fields: Any) -> ConfigFields:
    """``config_fields(sliding_window=32, text_config={...})``: a spec's `extra`."""
    return cast(ConfigFields, freeze(fields))
