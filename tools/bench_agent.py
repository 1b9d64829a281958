"""`mlxrt bench-agent`: a long coding-agent session, turn by turn, against mlx-lm's server.

The scripted session of `tools.agent_session` (`turns` requests, each the whole history so far,
streamed, greedy, `max_tokens` new tokens, with the tools) is replayed over HTTP on:
- `mlxrt`: a fresh runtime and its `net.http` server in this process (as `mlxrt serve --http`);
- `mlx-lm`: a fresh `python -m mlx_lm.server` subprocess on the same weights (`tools.mlx_lm_server`);
- `disk`, `restart`: a runtime with the prefix cache's disk tier (`kv.disk_cache_dir`) runs the
  session (`disk`), then a fresh runtime on the same directory runs it again (`restart`).
Servers take turns, never two working at once; the order alternates per repeat. Each turn records
its TTFT (to the first chunk with text or a tool call), its prompt tokens and the tokens the
server prefilled (`prompt_tokens - prompt_tokens_details.cached_tokens`); medians per turn.
A turn after the first whose prefill exceeds its new tokens (those not in the turn before's
prompt) by more than `PREFILL_SLACK` is counted as re-prefilling.
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import h11
import msgspec

from runtime.config import RuntimeConfig
from runtime.progress import Progress
from tools.agent_session import TOOLS, agent_turns, turn_request

SERVERS = ("mlxrt", "mlx-lm", "disk", "restart")
# Tokens a turn may prefill beyond its new ones and still count as prefilling only those.
PREFILL_SLACK = 0


@dataclass(frozen=True)
class AgentBenchOptions:
    turns: int = 20
    repeats: int = 3
    max_tokens: int = 16
    seed: int = 0
    servers: tuple[str, ...] = SERVERS


class HttpStatusError(RuntimeError):
    """The server answered a turn with an error status."""

    def __init__(self, url: str, status: int, body: bytes):
        super().__init__(f"{url}: HTTP {status}: {body.decode(errors='replace')[:500]}")
        self.status = status
        try:
            self.param = json.loads(body)["error"].get("param")
        except (ValueError, KeyError, TypeError, AttributeError):
            self.param = None


@dataclass
class SessionShape:
    """Whether turns carry the tool schemas: a server refusing them for the model (its chat
    template has no tool-call format) turns them off for every server, so all see one prompt."""

    tools: bool = True


@dataclass(frozen=True)
class TurnResult:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens


async def post_events(url: str, path: str, payload: dict[str, Any], timeout_s: float = 600.0) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """POST `payload` on a fresh connection; yields (arrival time, data) per server-sent event.
    `Connection: close` and h11 make one client for an HTTP/1.1 server (mlxrt) and an HTTP/1.0
    one that ends its stream by closing (mlx_lm.server)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps(payload).encode()
    conn = h11.Connection(h11.CLIENT)
    headers = [("Host", parts.netloc), ("Content-Type", "application/json"), ("Content-Length", str(len(body))), ("Connection", "close")]
    with anyio.fail_after(timeout_s):
        async with await anyio.connect_tcp(host, port) as stream:
            request = conn.send(h11.Request(method="POST", target=path, headers=headers)) + conn.send(h11.Data(data=body))
            await stream.send(request + conn.send(h11.EndOfMessage()))
            status, buffer = 0, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        conn.receive_data(await stream.receive())
                    except anyio.EndOfStream:
                        conn.receive_data(b"")
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    buffer += bytes(event.data)
                    if status != 200:
                        continue
                    while b"\n\n" in buffer:
                        block, buffer = buffer.split(b"\n\n", 1)
                        for line in block.splitlines():
                            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                                yield time.perf_counter(), json.loads(line[6:])
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    if status != 200:
                        raise HttpStatusError(f"{url}{path}", status, buffer)
                    return


def _has_output(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning") or choice.get("finish_reason"):
            return True
    return False


async def run_turn(url: str, payload: dict[str, Any]) -> TurnResult:
    """One streamed turn: TTFT to the first chunk with output, and the usage chunk's counts."""
    start, ttft = time.perf_counter(), 0.0
    usage: dict[str, Any] = {}
    async for arrived, chunk in post_events(url, "/v1/chat/completions", payload):
        if not ttft and _has_output(chunk):
            ttft = arrived - start
        usage = chunk.get("usage") or usage
    if not usage:
        raise RuntimeError(f"{url}: the stream ended without a usage chunk")
    details = usage.get("prompt_tokens_details") or {}
    return TurnResult(ttft_s=ttft, prompt_tokens=int(usage["prompt_tokens"]), cached_tokens=int(details.get("cached_tokens") or 0))


async def run_session(url: str, model: str, options: AgentBenchOptions, shape: SessionShape, on_turn: Callable[[int], None] | None = None) -> list[TurnResult]:
    """The scripted session on the server at `url`, after one short unrelated warm-up request
    (which finds out, the first time, whether the server takes the tools for this model)."""
    warm = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0.0, "stream": True}
    warm |= {"stream_options": {"include_usage": True}}
    try:
        await run_turn(url, warm | {"tools": TOOLS} if shape.tools else warm)
    except HttpStatusError as exc:
        if not shape.tools or exc.status != 400 or exc.param != "tools":
            raise
        shape.tools = False
        await run_turn(url, warm)
    results = []
    for i, messages in enumerate(agent_turns(options.turns, options.seed)):
        if on_turn:
            on_turn(i)
        results.append(await run_turn(url, turn_request(messages, model, options.max_tokens, tools=shape.tools)))
    return results


def _with_disk(config: RuntimeConfig, directory: str) -> RuntimeConfig:
    return msgspec.structs.replace(config, kv=msgspec.structs.replace(config.kv, disk_cache_dir=directory))


@asynccontextmanager
async def serving_mlxrt(config: RuntimeConfig) -> AsyncIterator[str]:
    """A fresh runtime and its HTTP server on a free loopback port; yields the base URL."""
    from net.http.server import HttpServer
    from runtime.runtime import Runtime

    config = msgspec.structs.replace(config, server=msgspec.structs.replace(config.server, http="127.0.0.1:0", api_key=""))
    async with Runtime.open(config) as rt, anyio.create_task_group() as tg:
        http = HttpServer(config)
        url = await tg.start(http.serve)
        http.attach(rt)
        try:
            yield url
        finally:
            http.stop()


async def _mlxrt_session(config: RuntimeConfig, options: AgentBenchOptions, shape: SessionShape, on_turn: Callable[[int], None]) -> list[TurnResult]:
    async with serving_mlxrt(config) as url:
        return await run_session(url, config.model_name, options, shape, on_turn)


async def _mlx_lm_session(model_dir: Path, options: AgentBenchOptions, shape: SessionShape, on_turn: Callable[[int], None]) -> list[TurnResult]:
    from tools.mlx_lm_server import MlxLmServer

    with MlxLmServer.start(model_dir, extra_args=("--max-tokens", str(options.max_tokens))) as server:
        return await run_session(server.url, "default_model", options, shape, on_turn)


def _report_turn(progress: Progress, label: str, index: int) -> None:
    progress.step(f"{label}: turn {index + 1}")


async def _session(
    name: str, config: RuntimeConfig, directory: str, model_dir: Path | None, options: AgentBenchOptions, shape: SessionShape, on_turn: Callable[[int], None]
) -> list[TurnResult]:
    """One session on a fresh server of column `name` (`disk` and `restart` on `directory`)."""
    if name == "mlx-lm":
        assert model_dir is not None
        return await _mlx_lm_session(model_dir, options, shape, on_turn)
    return await _mlxrt_session(_with_disk(config, directory) if name in ("disk", "restart") else config, options, shape, on_turn)


async def run_agent_bench(config: RuntimeConfig, options: AgentBenchOptions, model_dir: Path | None = None) -> dict:
    """Every server's session `options.repeats` times, fresh servers each time; per-turn medians.
    `model_dir`: mlx-lm's model directory for the `mlx-lm` column (see `tools.mlx_lm_server`)."""
    if "mlx-lm" in options.servers and model_dir is None:
        raise ValueError("the mlx-lm column needs mlx-lm's model directory")
    progress, shape = Progress("bench-agent"), SessionShape()
    runs: dict[str, list[list[TurnResult]]] = {name: [] for name in options.servers}
    # The disk-tier pair always runs together (`restart` reads what `disk` wrote); mlxrt's columns
    # first, so `shape` is settled before mlx-lm's first session.
    groups = [g for g in (("mlxrt",), ("disk", "restart"), ("mlx-lm",)) if set(g) & set(options.servers)]
    for rep in range(options.repeats):
        for group in groups if rep % 2 == 0 else groups[::-1]:
            with tempfile.TemporaryDirectory(prefix="mlxrt-agent-bench-") as directory:
                for name in group:
                    on_turn = functools.partial(_report_turn, progress, f"repeat {rep + 1}/{options.repeats}, {name}")
                    turns = await _session(name, config, directory, model_dir, options, shape, on_turn)
                    if name in runs:
                        runs[name].append(turns)
    progress.done("agent session benchmark finished")
    return summarize(runs, options, config.model.path, tools=shape.tools)


def summarize(runs: dict[str, list[list[TurnResult]]], options: AgentBenchOptions, model: str, *, tools: bool = True) -> dict:
    """Per-turn medians per server, the re-prefilling turns, and every run as it was."""
    servers: dict[str, dict] = {}
    for name, repeats in runs.items():
        if not repeats:
            continue
        turns = []
        for i in range(len(repeats[0])):
            at = [r[i] for r in repeats]
            prompt = at[0].prompt_tokens
            new = prompt - repeats[0][i - 1].prompt_tokens if i else prompt
            prefilled = int(statistics.median(t.prefilled for t in at))
            turns.append({"turn": i + 1, "prompt_tokens": prompt, "new_tokens": new, "ttft_s": statistics.median(t.ttft_s for t in at), "prefilled": prefilled})
        reprefilled = [t["turn"] for t in turns[1:] if t["prefilled"] > t["new_tokens"] + PREFILL_SLACK]
        servers[name] = {
            "turns": turns,
            "total_ttft_s": sum(t["ttft_s"] for t in turns),
            "total_prefilled": sum(t["prefilled"] for t in turns),
            "reprefilled_turns": reprefilled,
            "runs": [[asdict(t) | {"prefilled": t.prefilled} for t in run] for run in repeats],
        }
    return {"model": model, "options": asdict(options), "tools_sent": tools, "servers": servers}


def format_agent_table(results: dict) -> str:
    """Per turn: context and new tokens, then each server's TTFT (ms) / prefilled tokens."""
    servers = results["servers"]
    names = [n for n in SERVERS if n in servers]
    if not names:
        return "no results"
    first = servers[names[0]]["turns"]
    head = f"{'turn':>4} {'context':>8} {'new':>6}" + "".join(f" {name + ' ms/prefill':>20}" for name in names)
    lines = [
        f"agent session: {results['options']['turns']} turns, {results['options']['repeats']} repeats (medians), {results['model']}",
        head,
        "-" * len(head),
    ]
    for i, turn in enumerate(first):
        cells = "".join(f" {_cell(servers[name]['turns'][i]):>20}" for name in names)
        lines.append(f"{turn['turn']:4d} {turn['prompt_tokens']:8,d} {turn['new_tokens']:6,d}{cells}")
    lines.append("-" * len(head))
    lines.append(
        f"{'sum':>4} {'':>8} {'':>6}"
        + "".join(f" {_cell({'ttft_s': s['total_ttft_s'], 'prefilled': s['total_prefilled']}):>20}" for s in (servers[n] for n in names))
    )
    for name in names:
        again = servers[name]["reprefilled_turns"]
        lines.append(
            f"{name}: {'every turn after the first prefilled only its new tokens' if not again else f'turns prefilling more than their new tokens: {again}'}"
        )
    lines.append("context: the turn's prompt tokens (first column's server); new: those not in the turn before's prompt")
    return "\n".join(lines)


def _cell(turn: dict) -> str:
    return f"{turn['ttft_s'] * 1000:,.0f} / {turn['prefilled']:,d}"


def dump_agent(results: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=2) + "\n")
