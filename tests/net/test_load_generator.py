"""NVIDIA's AIPerf, a real load generator, against the HTTP server: a bounded streamed run of
`/v1/completions` (24 requests, 4 at a time, 32 prompt and 16 generated tokens) ends with no
errors, every request completed, and the token counts it reports equal to the server's own.

AIPerf lives in `.venv-loadgen` (its pins conflict with the project's; `make setup` builds it).
No network (HF_HUB_OFFLINE): its tokenizer, which synthesizes the prompts, is the tiny model's,
copied into a Hugging Face cache under tmp_path; it counts tokens from the server's `usage`
(`--use-server-token-count`, not by re-tokenizing the text it received), so its totals must equal
the server's own counters exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import anyio
import pytest

from tests.support.config import REPO, builtin_dir
from tests.support.http_serving import raw_request, serving, wait_runtime_idle

pytestmark = [pytest.mark.server, pytest.mark.slow]

AIPERF = REPO / ".venv-loadgen" / "bin" / "aiperf"
TOKENIZER, REVISION = "mlxrt/builtin-tiny", "0" * 40
REQUESTS, CONCURRENCY, INPUT_TOKENS, OUTPUT_TOKENS = 24, 4, 32, 16


def _tokenizer_cache(root: Path) -> Path:
    """A Hugging Face hub cache holding the tiny model's tokenizer as the repo `TOKENIZER`.

    AIPerf 0.13 loads a tokenizer given as a directory only when online: with HF_HUB_OFFLINE
    it resolves every name through `snapshot_download(local_files_only=True)`, which refuses a
    path. A cached snapshot is what it finds offline."""
    snapshot = root / f"models--{TOKENIZER.replace('/', '--')}" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(builtin_dir("tiny") / name, snapshot / name)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(REVISION)
    return root


def _aiperf_command(url: str, model: str, artifacts: str) -> list[str]:
    return [
        str(AIPERF), "profile",
        "--url", url, "--model", model, "--endpoint-type", "completions", "--streaming",
        "--tokenizer", TOKENIZER, "--use-server-token-count",
        "--request-count", str(REQUESTS), "--concurrency", str(CONCURRENCY),
        "--isl", str(INPUT_TOKENS), "--isl-stddev", "0", "--osl", str(OUTPUT_TOKENS), "--osl-stddev", "0",
        "--extra-inputs", json.dumps({"ignore_eos": True, "temperature": 0}),
        "--random-seed", "0", "--workers-max", "2", "--ui", "none", "--no-gpu-telemetry",
        "--artifact-dir", artifacts,
    ]  # fmt: skip


def _figure(summary: dict, tag: str) -> float:
    return summary[tag]["avg"]


async def _completions_answered(url: str) -> float:
    """`/metrics`' count of 200 answers on /v1/completions."""
    status, _, body = await raw_request(url, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith("mlxrt:http_responses_total{") and 'route="/v1/completions"' in line and 'status="200"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_aiperf_streams_a_bounded_load_without_errors_and_counts_the_servers_tokens(tmp_path):
    assert AIPERF.exists(), f"{AIPERF} is missing: run `make setup` (.ci/bootstrap.sh builds .venv-loadgen with AIPerf)"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(_tokenizer_cache(tmp_path / "hub")), "NO_COLOR": "1"}
    env.pop("VIRTUAL_ENV", None)
    artifacts = tmp_path / "artifacts"
    async with serving() as served:
        before = (await served.runtime.stats()).metrics
        answered_before = await _completions_answered(served.url)
        command = _aiperf_command(served.url, served.model, str(artifacts))
        run = await anyio.to_thread.run_sync(lambda: subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300))
        assert run.returncode == 0, f"aiperf exited {run.returncode}:\n{run.stdout[-6000:]}\n{run.stderr[-4000:]}"
        after = (await wait_runtime_idle(served.runtime)).metrics
        answered = await _completions_answered(served.url) - answered_before
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").read_text().splitlines()]
    generated, prompted = after.generation_tokens - before.generation_tokens, after.prompt_tokens - before.prompt_tokens
    print(f"aiperf: {_figure(summary, 'request_count'):.0f} requests, {_figure(summary, 'total_isl'):.0f} input and "
          f"{_figure(summary, 'total_output_tokens'):.0f} output tokens, {_figure(summary, 'request_throughput'):.1f} req/s, "
          f"{_figure(summary, 'output_token_throughput'):.1f} output tok/s, TTFT {_figure(summary, 'time_to_first_token'):.1f} ms; "
          f"server: {answered:.0f} answers, {prompted} prompt and {generated} generated tokens")  # fmt: skip

    # No errors, every request completed, as AIPerf saw it and as the server did.
    assert summary["error_summary"] == [] and not summary["was_cancelled"] and summary["is_complete"]
    assert summary.get("error_request_count", {"avg": 0})["avg"] == 0 and _figure(summary, "request_error_rate") == 0
    assert _figure(summary, "request_count") == _figure(summary, "completed_request_count") == REQUESTS
    assert len(records) == REQUESTS and all(r.get("error") is None for r in records)
    assert answered == REQUESTS
    # Its token counts (the server's `usage`, as received) equal the server's own counters;
    # ignore_eos makes every output exactly the requested length.
    assert _figure(summary, "total_output_tokens") == _figure(summary, "total_usage_completion_tokens") == generated == REQUESTS * OUTPUT_TOKENS
    assert _figure(summary, "total_isl") == _figure(summary, "total_usage_prompt_tokens") == prompted
    assert summary["output_sequence_length"]["min"] == summary["output_sequence_length"]["max"] == OUTPUT_TOKENS
    assert abs(prompted / REQUESTS - INPUT_TOKENS) <= 2, prompted  # its prompts are synthesized with the tiny tokenizer
    assert summary["time_to_first_token"]["count"] == REQUESTS
    for throughput in ("request_throughput", "output_token_throughput", "input_token_throughput", "total_token_throughput"):
        assert _figure(summary, throughput) > 0, throughput
