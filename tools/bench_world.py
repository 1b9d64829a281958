"""`mlxrt bench --distributed`: one process against 2-rank worlds on this machine, in one run.

Each setup is a real server: `mlxrt serve` (one process) and `mlxrt launch -n 2` in tensor
and pipeline mode, on the same model, answering the same requests over its socket: one
stream and `concurrency` streams of `new_tokens` after 128-token prompts, `repeats` times
(medians). Reported: decode tokens/s of one stream, overall tokens/s of the concurrent
streams, TTFT, and for the worlds rank 0's figures per step (its whole step, every rank's
work and collectives included, and the part spent broadcasting the plan).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
import msgspec

from net.client import Client
from protocols.api import Finished, GenerateRequest, TokenDelta
from runtime.progress import Progress
from tools.bench_common import median_summary, random_prompts

SETUPS = ("single", "tensor", "pipeline")
READY_S = 300.0


@dataclass(frozen=True)
class WorldBenchOptions:
    model: str = "builtin:bench-qwen2"
    setups: tuple[str, ...] = SETUPS
    concurrency: int = 8
    prompt_tokens: int = 128
    new_tokens: int = 64
    repeats: int = 3


class _Server:
    """A server subprocess on a private socket; ready once it prints "serving"."""

    def __init__(self, directory: Path, setup: str, model: str):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        tree: dict = {"model": {"path": model}, "logging": {"level": "warning"}, "scheduler": {"max_batch_size": 16}, "kv": {"prefix_cache_bytes": 0}}
        if setup != "single":
            tree["distributed"] = {"backend": "ring", "mode": setup}
        config = directory / f"{setup}.toml"
        config.write_bytes(msgspec.toml.encode(tree))
        self.socket = directory / f"{setup}.sock"
        command = ["serve", "--config", str(config)] if setup == "single" else ["launch", "-n", "2", "--config", str(config), "--"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", *command, "--socket", str(self.socket)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "serving" in line:
                return
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"the server did not start (exit {self.proc.poll()})")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


async def _run(client: Client, prompts: list[list[int]], new_tokens: int) -> dict:
    finished: list[Finished] = []
    started = time.perf_counter()

    async def one(prompt: list[int]) -> None:
        request = GenerateRequest(prompt_ids=prompt, max_tokens=new_tokens, ignore_eos=True)
        async for event in client.generate(request):
            if isinstance(event, Finished):
                finished.append(event)
            else:
                assert isinstance(event, TokenDelta)

    async with anyio.create_task_group() as tg:
        for prompt in prompts:
            tg.start_soon(one, prompt)
    wall = time.perf_counter() - started
    tokens = sum(f.usage.completion_tokens for f in finished)
    return {
        "decode_tok_s": statistics.median(f.timings.decode_tokens_per_s for f in finished),
        "throughput_tok_s": tokens / wall,
        "ttft_p50_s": statistics.median(f.timings.ttft_s for f in finished),
    }


def _vocab_size(model: str) -> int:
    from engine.builtin import builtin_name
    from engine.builtin.catalog import BUILTIN_MODELS

    name = builtin_name(model)
    if name is not None:
        return BUILTIN_MODELS[name].vocab_size
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


async def _measure(setup: str, options: WorldBenchOptions, directory: Path, progress: Progress) -> dict:
    progress.step(f"{setup}: starting the server")
    server = _Server(directory, setup, options.model)
    try:
        await anyio.to_thread.run_sync(server.wait_ready)
        async with Client.connect(server.socket) as client:
            vocab = _vocab_size(options.model)
            await _run(client, random_prompts(2, 16, vocab, 1), 4)  # warm up
            out: dict = {}
            for n, key in ((1, "c1"), (options.concurrency, f"c{options.concurrency}")):
                runs = []
                for rep in range(options.repeats):
                    progress.step(f"{setup}: {n} stream(s) of {options.new_tokens} tokens ({rep + 1}/{options.repeats})")
                    runs.append(await _run(client, random_prompts(n, options.prompt_tokens, vocab, 100 * rep + n), options.new_tokens))
                out[key] = median_summary(runs)
            world = (await client.stats()).world
            if world is not None and world.steps:
                out["world"] = {"steps": world.steps, "step_ms": 1000 * world.step_s / world.steps, "broadcast_ms": 1000 * world.broadcast_s / world.steps}
            return out
    finally:
        server.stop()


async def run_world_bench(options: WorldBenchOptions) -> dict:
    progress = Progress("bench --distributed")
    results: dict = {"options": asdict(options)}
    with tempfile.TemporaryDirectory(prefix="mlxrt-world-bench-") as tmp:
        for setup in options.setups:
            results[setup] = await _measure(setup, options, Path(tmp), progress)
    progress.done("distributed benchmark finished")
    return results


def format_world_table(r: dict) -> str:
    n = r["options"]["concurrency"]
    lines = [f"{'setup':<10}{'c1 decode tok/s':>16}{'c1 TTFT s':>11}{f'c{n} tok/s':>11}{f'c{n} TTFT s':>11}{'step ms':>9}{'plan ms':>9}"]
    single = r.get("single")
    for setup in r["options"]["setups"]:
        s = r[setup]
        world = s.get("world")
        extra = f"{world['step_ms']:9.1f}{world['broadcast_ms']:9.2f}" if world else f"{'':>18}"
        lines.append(
            f"{setup:<10}{s['c1']['decode_tok_s']:16.1f}{s['c1']['ttft_p50_s']:11.3f}{s[f'c{n}']['throughput_tok_s']:11.1f}{s[f'c{n}']['ttft_p50_s']:11.3f}{extra}"
        )
        if single and setup != "single":
            lines.append(
                f"  {setup} / single: c1 decode {s['c1']['decode_tok_s'] / single['c1']['decode_tok_s']:.2f}x, c{n} {s[f'c{n}']['throughput_tok_s'] / single[f'c{n}']['throughput_tok_s']:.2f}x"
            )
    return "\n".join(lines)
