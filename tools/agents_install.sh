#!/usr/bin/env bash
# Installs the pinned coding-agent CLIs (Claude Code, the Codex CLI) from the npm registry into a
# test-only cache, once: installed aside, then renamed into place, so a half install is never reused.
# Prints the install directory (node_modules is under it). Used by tests/support/agents.py.
set -euo pipefail

CLAUDE_VERSION="2.1.332"
CODEX_VERSION="0.171.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${MLXRT_AGENTS_DIR:-$ROOT/.cache/agents}"
DEST="$CACHE/claude-$CLAUDE_VERSION-codex-$CODEX_VERSION"

if [ -f "$DEST/.installed" ]; then
    echo "$DEST"
    exit 0
fi
command -v npm >/dev/null || { echo "agents_install: npm is not on PATH" >&2; exit 3; }
mkdir -p "$CACHE"
# One installer at a time (pytest-xdist workers may ask together); the others wait, then reuse it.
exec 9>"$CACHE/.lock"
flock 9
if [ -f "$DEST/.installed" ]; then
    echo "$DEST"
    exit 0
fi
ASIDE="$(mktemp -d "$CACHE/.install-XXXXXX")"
trap 'rm -rf "$ASIDE"' EXIT
npm install --prefix "$ASIDE" --no-audit --no-fund --loglevel=error \
    "@anthropic-ai/claude-code@$CLAUDE_VERSION" "@openai/codex@$CODEX_VERSION" >&2
touch "$ASIDE/.installed"
rm -rf "$DEST"
mv -T "$ASIDE" "$DEST"
trap - EXIT
echo "$DEST"
