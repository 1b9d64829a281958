"""`mlxrt bench-http`: time to first token over HTTP next to the Unix socket and in-process.

One process serves one runtime on a Unix socket (`net.server`) and over HTTP (`net.http`),
as `mlxrt serve --http` does, and times the same sequential greedy requests through each
face: in-process `Runtime.generate`, `net.client.Client` on the socket, and a raw HTTP/1.1
client (h11, one kept-alive connection, `/v1/completions` with `stream` and token-id
prompts) that stops its clock at the first server-sent event. The prefix cache is off, so
every request prefills its whole prompt; the order of the three faces rotates per request.
Prints p50/p90 TTFT per face and the HTTP-minus-socket difference, and writes JSON.

Then `/metrics` latency, as a scraper sees it: one scraper GETs it back to back, on its own
connection, while `scrape_streams` greedy streams decode (`scrape_tokens` tokens each), and
again with nothing running; p50/p99 of each.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec

from net.http.client import HttpConnection
from protocols.api import GenerateRequest, SamplingParams, TokenDelta
from runtime.config import RuntimeConfig

FACES = ("in_process", "socket", "http")


@dataclass(frozen=True)
class HttpBenchOptions:
    requests: int = 50
    prompt_tokens: int = 128
    new_tokens: int = 4
    seed: int = 0
    scrape_streams: int = 16
    scrape_tokens: int = 64


async def _ttft_in_process(rt, prompt: list[int], options: HttpBenchOptions) -> float:
    start = time.perf_counter()
    first = None
    async for event in rt.generate(_request(prompt, options)):
        if first is None and isinstance(event, TokenDelta):
            first = time.perf_counter() - start
    assert first is not None
    return first


async def _ttft_socket(client, prompt: list[int], options: HttpBenchOptions) -> float:
    start = time.perf_counter()
    first = None
    async for event in client.generate(_request(prompt, options)):
        if first is None and isinstance(event, TokenDelta):
            first = time.perf_counter() - start
    assert first is not None
    return first


async def _ttft_http(connection: HttpConnection, model: str, prompt: list[int], options: HttpBenchOptions) -> float:
    body = msgspec.json.encode(
        {"model": model, "prompt": prompt, "max_tokens": options.new_tokens, "temperature": 0, "stream": True, "ignore_eos": True, "return_token_ids": True}
    )
    start = time.perf_counter()
    first = None
    async for data in connection.post("/v1/completions", body):
        if first is None and data.startswith(b"data: {"):
            first = time.perf_counter() - start
    assert first is not None
    return first


def _request(prompt: list[int], options: HttpBenchOptions) -> GenerateRequest:
    return GenerateRequest(prompt_ids=prompt, max_tokens=options.new_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0))


async def run_http_bench(config: RuntimeConfig, options: HttpBenchOptions) -> dict:
    from net.client import Client
    from net.http.server import HttpServer
    from net.server import Server
    from runtime.runtime import Runtime

    kv = msgspec.structs.replace(config.kv, prefix_cache_bytes=0)
    server_config = msgspec.structs.replace(config.server, http="127.0.0.1:0", api_key="")
    config = msgspec.structs.replace(config, kv=kv, server=server_config)
    times: dict[str, list[float]] = {face: [] for face in FACES}
    with tempfile.TemporaryDirectory() as directory:
        async with Runtime.open(config) as rt, anyio.create_task_group() as tg:
            socket = Server(rt, config.server, Path(directory) / "run" / "bench.sock")
            http = HttpServer(config)
            path = await tg.start(socket.serve)
            url = await tg.start(http.serve)
            http.attach(rt)
            rng = random.Random(options.seed)
            vocab = rt.model_info.vocab_size
            prompts = [[rng.randrange(100, vocab) for _ in range(options.prompt_tokens)] for _ in range(options.requests + 2)]
            async with Client.connect(path) as client, HttpConnection.connect(url) as connection:
                faces = {
                    "in_process": lambda p: _ttft_in_process(rt, p, options),
                    "socket": lambda p: _ttft_socket(client, p, options),
                    "http": lambda p: _ttft_http(connection, config.model_name, p, options),
                }
                for i, prompt in enumerate(prompts):
                    order = FACES[i % 3 :] + FACES[: i % 3]
                    for face in order:
                        ttft = await faces[face](prompt)
                        if i >= 2:  # the first two warm every path up
                            times[face].append(ttft)
            scrape_prompts = [[rng.randrange(100, vocab) for _ in range(options.prompt_tokens)] for _ in range(options.scrape_streams)]
            scrapes = await _scrape_latencies(rt, url, scrape_prompts, options)
            http.stop()
            socket.stop()
    return {**_summary(config, options, times), "metrics_scrape": scrapes}


async def _scrape_latencies(rt, url: str, prompts: list[list[int]], options: HttpBenchOptions) -> dict:
    """`/metrics` round trips while the streams decode, and idle."""

    async def scrape(until: anyio.Event, out: list[float], at_least: int = 1) -> None:
        async with HttpConnection.connect(url) as connection:
            while not until.is_set() or len(out) < at_least:
                start = time.perf_counter()
                page = await connection.get("/metrics")
                out.append(time.perf_counter() - start)
                assert b"num_requests_running" in page

    busy: list[float] = []
    idle: list[float] = []
    done = anyio.Event()
    request = GenerateRequest(max_tokens=options.scrape_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    async with anyio.create_task_group() as tg:
        tg.start_soon(scrape, done, busy)
        async with anyio.create_task_group() as streams:
            for prompt in prompts:
                streams.start_soon(_drain, rt, msgspec.structs.replace(request, prompt_ids=prompt))
        done.set()
    await scrape(done, idle, 50)
    return {"streams": options.scrape_streams, "busy": _percentiles(busy), "idle": _percentiles(idle)}


async def _drain(rt, request: GenerateRequest) -> None:
    async for _ in rt.generate(request):
        pass


def _percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "scrapes": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
    }


def _summary(config: RuntimeConfig, options: HttpBenchOptions, times: dict[str, list[float]]) -> dict:
    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    faces = {face: {"p50_ttft_ms": 1000 * statistics.median(v), "p90_ttft_ms": 1000 * pct(v, 90), "requests": len(v)} for face, v in times.items()}
    paired = [h - s for h, s in zip(times["http"], times["socket"])]
    return {
        "model": config.model.path,
        "prompt_tokens": options.prompt_tokens,
        "new_tokens": options.new_tokens,
        "faces": faces,
        "http_minus_socket_p50_ms": faces["http"]["p50_ttft_ms"] - faces["socket"]["p50_ttft_ms"],
        "http_minus_socket_paired_median_ms": 1000 * statistics.median(paired),
    }


def format_http_table(results: dict) -> str:
    rows = [f"{'face':<12}{'p50 TTFT ms':>14}{'p90 TTFT ms':>14}", "-" * 40]
    for face, r in results["faces"].items():
        rows.append(f"{face:<12}{r['p50_ttft_ms']:14.2f}{r['p90_ttft_ms']:14.2f}")
    rows.append(f"HTTP - socket: p50 {results['http_minus_socket_p50_ms']:+.2f} ms, paired median {results['http_minus_socket_paired_median_ms']:+.2f} ms")
    scrape = results.get("metrics_scrape")
    if scrape:
        busy, idle = scrape["busy"], scrape["idle"]
        rows.append(
            f"/metrics while {scrape['streams']} streams decode: p50 {busy['p50_ms']:.1f} ms, p99 {busy['p99_ms']:.1f} ms ({busy['scrapes']} scrapes);"
            f" idle: p50 {idle['p50_ms']:.1f} ms, p99 {idle['p99_ms']:.1f} ms"
        )
    return "\n".join(rows)
