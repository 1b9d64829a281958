"""Secrets in the configuration, as it may be shown: `mlxrt config show`, a log line or a
traceback that prints a config never carries an API key. Pure data.

A key shows as "…" and its last 4 characters (keys of 16 or more characters; a shorter one shows
as "…" alone), enough to tell which of one's keys is set, never enough to use one.
"""

from __future__ import annotations

from typing import Any

# (section, key) of each secret setting in the config tree.
SECRET_SETTINGS = (("server", "api_key"), ("server", "api_keys"))
# Keys shorter than this show no characters at all.
MIN_SHOWN_KEY_CHARS = 16


def redact_key(key: str) -> str:
    """What may be shown of an API key ("" stays "": it says no key is set)."""
    if not key:
        return ""
    return "…" + key[-4:] if len(key) >= MIN_SHOWN_KEY_CHARS else "…"


def redact_secrets(tree: dict[str, Any]) -> dict[str, Any]:
    """A config tree (`msgspec.to_builtins` of a `RuntimeConfig`) with each secret setting's
    keys redacted; the tree given is not changed."""
    out = dict(tree)
    for section, key in SECRET_SETTINGS:
        table = out.get(section)
        if not isinstance(table, dict) or key not in table:
            continue
        value = table[key]
        shown = [redact_key(k) for k in value] if isinstance(value, list) else redact_key(value)
        out[section] = {**table, key: shown}
    return out
