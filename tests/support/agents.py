"""The coding-agent CLIs (Claude Code, the Codex CLI) for the tests: installed once from the npm
registry by `tools/agents_install.sh` into `.cache/agents/` (pinned versions), and run offline
against a served model: telemetry, error reports, update checks and analytics off, a temporary
home each run, no retries (a refusal is seen once).

`installed_agents()` installs (or reuses) them and returns their executables; it skips the test,
saying why, only where npm is absent. `claude_command` / `codex_command` give the argv and
environment of one run against a base URL.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.config import REPO

INSTALL_SCRIPT = REPO / "tools" / "agents_install.sh"
# The npm install of both (808 MB) takes minutes on a first run; a cached one answers at once.
INSTALL_TIMEOUT_S = 1800
# What every run inherits from this process: enough to find the system's libraries, nothing else.
INHERITED = ("PATH", "LANG", "LC_ALL", "TMPDIR", "SSL_CERT_FILE")


@dataclass(frozen=True)
class Agents:
    claude: Path
    codex: Path


def installed_agents() -> Agents:
    """Both CLIs' executables, installed first if need be; a skip where npm is absent."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the Claude Code and Codex CLI checks need it (tools/agents_install.sh)")
    done = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"tools/agents_install.sh failed ({done.returncode}): {done.stderr[-2000:]}")
    modules = Path(done.stdout.strip().splitlines()[-1]) / "node_modules"
    # The platform packages hold the native executables (the npm wrappers only find them).
    claude = modules / "@anthropic-ai" / "claude-code-linux-x64" / "claude"
    codex = next(modules.glob("@openai/codex-linux-x64/vendor/*/bin/codex"), None)
    if not claude.is_file() or codex is None:
        pytest.skip(f"no linux-x64 executables under {modules} (this platform is not the tests' own)")
    return Agents(claude=claude, codex=codex)


def _base_env(home: Path) -> dict[str, str]:
    env = {name: os.environ[name] for name in INHERITED if name in os.environ}
    return {**env, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "NO_COLOR": "1"}


def claude_command(agents: Agents, home: Path, base_url: str, args: list[str], headers: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """`claude` with `args`, pointed at `base_url`, offline, in a home of its own."""
    env = {
        **_base_env(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-mlxrt-test",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_RETRIES": "0",
    }
    if headers:
        env["ANTHROPIC_CUSTOM_HEADERS"] = "\n".join(f"{name}: {value}" for name, value in headers.items())
    return [str(agents.claude), *args], env


def codex_command(agents: Agents, home: Path, base_url: str, args: list[str], headers: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """`codex exec` with `args`, its model served by `base_url`'s Responses API (a custom
    provider in `CODEX_HOME/config.toml`), offline, sandboxed read-only, in a home of its own."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    provider = [
        'name = "mlxrt"',
        f"base_url = {json.dumps(base_url + '/v1')}",
        'wire_api = "responses"',
        'env_key = "MLXRT_API_KEY"',
        "request_max_retries = 0",
        "stream_max_retries = 0",
    ]
    if headers:
        provider.append("http_headers = { " + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in headers.items()) + " }")
    config = [
        'model_provider = "mlxrt"',
        "check_for_update_on_startup = false",
        "[analytics]",
        "enabled = false",
        "[model_providers.mlxrt]",
        *provider,
    ]
    (codex_home / "config.toml").write_text("\n".join(config) + "\n")
    env = {**_base_env(home), "CODEX_HOME": str(codex_home), "MLXRT_API_KEY": "sk-mlxrt-test"}
    return [str(agents.codex), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--ephemeral", "--color", "never", *args], env
