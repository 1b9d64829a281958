"""API keys never shown: `mlxrt config show` prints each of `server.api_key` and `server.api_keys`
as "…" and at most its last 4 characters, whether the keys came from the file or the
environment, and a config printed or logged (its repr, a structlog JSON line) shows no key."""

from __future__ import annotations

import json

import msgspec
import structlog

from protocols.config import ServerConfig
from protocols.redaction import redact_key, redact_secrets
from runtime.config import RuntimeConfig
from tools.cli import main

FILE_KEY = "file-secret-key-AAAAAAAAAAAA1234"
ENV_KEYS = ["env-secret-key-BBBBBBBBBBBB5678", "tiny"]


def test_a_key_shows_its_last_four_characters_at_most():
    assert [redact_key(k) for k in ("", "short-key", "a" * 15 + "wxyz")] == ["", "…", "…wxyz"]
    tree = {"model": {"path": "p"}, "server": {"api_key": FILE_KEY, "api_keys": ENV_KEYS, "http": "8000"}}
    shown = redact_secrets(tree)
    assert shown["server"] == {"api_key": "…1234", "api_keys": ["…5678", "…"], "http": "8000"} and shown["model"] == {"path": "p"}
    assert tree["server"]["api_key"] == FILE_KEY  # (the tree given is left as it was)
    assert redact_secrets({"model": {"path": "p"}}) == {"model": {"path": "p"}}


def test_config_show_prints_no_api_key_from_the_file_or_the_environment(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.toml"
    path.write_text(f'[model]\npath = "builtin:tiny"\n[server]\napi_key = "{FILE_KEY}"\n')
    monkeypatch.setenv("MLXRT_SERVER_API_KEYS", json.dumps(ENV_KEYS))
    assert main(["config", "show", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "secret" not in out and "tiny" not in out.replace("builtin:tiny", "")
    shown = msgspec.toml.decode(out)["server"]
    assert (shown["api_key"], shown["api_keys"]) == ("…1234", ["…5678", "…"])
    # Without keys nothing changes: empty stays empty.
    monkeypatch.delenv("MLXRT_SERVER_API_KEYS")
    path.write_text('[model]\npath = "builtin:tiny"\n')
    assert main(["config", "show", "--config", str(path)]) == 0
    shown = msgspec.toml.decode(capsys.readouterr().out)["server"]
    assert (shown["api_key"], shown["api_keys"]) == ("", [])


def test_a_config_printed_or_logged_shows_no_key(capsys):
    config = RuntimeConfig.from_tree({"model": {"path": "builtin:tiny"}, "server": {"api_key": FILE_KEY, "api_keys": ENV_KEYS}}, source="t")
    for text in (repr(config), str(config), repr(config.server), f"{config.server}", repr([config.server])):
        assert "secret" not in text and "…1234" in text and "['…5678', '…']" in text
    assert config.server.api_key == FILE_KEY and config.server == msgspec.convert({"api_key": FILE_KEY, "api_keys": ENV_KEYS}, ServerConfig)
    logger = structlog.wrap_logger(structlog.PrintLogger(), processors=[structlog.processors.JSONRenderer()])
    logger.info("config_loaded", server=config.server, config=config)
    assert "secret" not in capsys.readouterr().out
