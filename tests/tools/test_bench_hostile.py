"""`mlxrt bench-hostile` runs on a tiny workload and prints its table of ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.config import REPO


@pytest.mark.server
@pytest.mark.slow
def test_bench_hostile_prints_a_ratio_per_hostile(tmp_path):
    out = tmp_path / "hostile.json"
    args = [
        "bench-hostile",
        "--config",
        "configs/tiny.toml",
        "--stream-tokens",
        "16",
        "--rounds",
        "1",
        "--hostiles",
        "n,tokenize,detokenize,flood,none",
        "--json",
        str(out),
    ]
    result = subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["hostile"] for row in rows] == ["n", "tokenize", "detokenize", "flood", "none"]
    assert all(row["ratio"] > 0 and row["alone"] and row["beside"] for row in rows)
    # The hostile's own process reports each answer: the maximal ones served where they ended
    # within the (short) stream, the flood refused, many times over.
    statuses = {row["hostile"]: row["statuses"] for row in rows}
    assert all(set(statuses[name]) <= {200} for name in ("n", "tokenize", "detokenize"))
    flood, none = rows[-2:]
    assert flood["statuses"] == [400] and flood["answered"] > 1
    assert none["statuses"] == [] and none["answered"] == 0 and none["body_bytes"] == 2
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["hostile", "body"] and {line.split()[0] for line in lines[2:7]} == {"n", "tokenize", "detokenize", "flood", "none"}
    assert "(reference: see below)" in lines[5] and "(reference: see below)" in lines[6]
    unknown = subprocess.run([sys.executable, "-m", "tools.cli", "bench-hostile", "--hostiles", "nope"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "nope" in unknown.stderr
