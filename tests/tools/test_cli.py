"""The `mlxrt` command line, run as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.config import REPO


def _mlxrt(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, MLXRT_HOME=os.environ["MLXRT_HOME"])
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def test_config_check_and_show():
    assert _mlxrt("config", "check", "configs/tiny.toml").returncode == 0
    shown = _mlxrt("config", "show", "--config", "configs/tiny.toml")
    assert shown.returncode == 0 and 'path = "builtin:tiny"' in shown.stdout and "max_queued_requests = 256" in shown.stdout


def test_bad_config_exits_2_naming_file_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\npath = "builtin:tiny"\n[scheduler]\nmax_batch_size = "many"\n')
    result = _mlxrt("config", "check", str(bad))
    assert result.returncode == 2
    assert "bad.toml" in result.stderr and "max_batch_size" in result.stderr


@pytest.mark.slow
def test_generate_json_events():
    result = _mlxrt("generate", "--config", "configs/tiny.toml", "--prompt-ids", "5,6,7,8", "--max-tokens", "6", "--json")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[-1]["type"] == "Finished" and events[-1]["usage"]["prompt_tokens"] == 4
    deltas = [e for e in events if e["type"] == "TokenDelta"]
    assert sum(len(e["token_ids"]) for e in deltas) == events[-1]["usage"]["completion_tokens"] - (events[-1]["finish_reason"] == "stop")


@pytest.mark.slow
def test_invalid_request_exits_3():
    result = _mlxrt("generate", "--config", "configs/tiny.toml", "--prompt-ids", "5,6", "--temperature", "-1")
    assert result.returncode == 3 and "temperature" in result.stderr


@pytest.mark.slow
def test_bench_runs_and_reports_ratios(tmp_path):
    out = tmp_path / "bench.json"
    result = _mlxrt(
        "bench",
        "--config",
        "configs/tiny.toml",
        "--concurrency",
        "1,2",
        "--prompt-tokens",
        "8",
        "--new-tokens",
        "4",
        "--long-prompt-tokens",
        "80",
        "--prefix-tokens",
        "40",
        "--repeats",
        "1",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    assert results["mlxrt"]["prefix_reuse"]["warm_cached_tokens"] >= 40
    for key in ("c1_throughput", "c2_throughput", "short_ttft_over_long_prefill", "prefix_warm_over_cold_ttft", "constrained_over_unconstrained_throughput"):
        assert results["ratios"][key] > 0
    assert results["mlxrt"]["c2"]["tokens"] == 8 and results["mlx_lm"]["c2"]["tokens"] == 8
    assert "throughput_tok_s" in result.stdout
    # c1 against the bandwidth roofline, measured before and after the runs.
    roofline = results["roofline"]
    assert roofline["measured_tok_s"] == results["mlxrt"]["c1"]["decode_tok_s_per_stream"]
    assert len(roofline["fraction"]) == 2 and all(f > 0 for f in roofline["fraction"])
    assert "roofline: c1 decode" in result.stdout


def test_bench_refuses_prompts_the_models_context_cannot_hold_before_running_anything():
    result = _mlxrt("bench", "--config", "configs/tiny.toml", "--workloads", "concurrency", "--prompt-tokens", "1000000", "--repeats", "1")
    assert result.returncode == 2, result.stderr
    assert "--prompt-tokens + --new-tokens = 1000064 tokens: more than the model's context" in result.stderr
    assert "mlx-lm" not in result.stderr  # (the progress lines of mlx-lm's side: nothing ran)


@pytest.mark.server
@pytest.mark.slow
def test_bench_http_times_every_face(tmp_path):
    out = tmp_path / "bench-http.json"
    result = _mlxrt("bench-http", "--config", "configs/tiny.toml", "--requests", "3", "--prompt-tokens", "20", "--json", str(out))
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    assert set(results["faces"]) == {"in_process", "socket", "http"}
    assert all(face["requests"] == 3 and face["p50_ttft_ms"] > 0 for face in results["faces"].values())
    assert "HTTP - socket" in result.stdout


@pytest.mark.slow
def test_a_request_for_another_model_or_an_unknown_adapter_exits_3():
    for flag, value in (("--model", "other"), ("--adapter", "missing")):
        result = _mlxrt("generate", "--config", "configs/tiny.toml", "--prompt-ids", "5,6", flag, value)
        assert result.returncode == 3 and ("other" in result.stderr or "missing" in result.stderr), result.stderr
