"""A bounded soak: mixed valid, invalid, cancelled and abandoned requests from many connections.

Runs for `MLXRT_SOAK_S` seconds (default 12, thousands of requests; the issue's two-minute run is
`MLXRT_SOAK_S=120`).
At the end the server must still serve exactly, with no growth in live requests, KV bytes
or open file descriptors.
"""

from __future__ import annotations

import os
import random
import time

import anyio
import msgspec
import pytest

from net.client import Client
from protocols.api import Finished, GenerateRequest, SamplingParams, TokenDelta
from protocols.wire import Generate
from runtime.errors import InvalidRequestError, ServerBusyError
from tests.support.events import collect
from tests.support.mlx_reference import greedy_tokens, load_reference
from tests.support.serve import running_server, wait_idle
from tests.support.wire import RawConnection

pytestmark = [pytest.mark.server, pytest.mark.slow]

SOAK_S = float(os.environ.get("MLXRT_SOAK_S", "12"))
WORKERS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    options = {"client_stall_timeout_s": 2.0, "idle_timeout_s": 10.0, "max_connections": 64}
    with running_server(tmp_path_factory.mktemp("soak"), server=options) as process:
        yield process


def _request(rng: random.Random, kind: str) -> GenerateRequest:
    prompt = [rng.randrange(1000) for _ in range(rng.randrange(3, 60))]
    if kind == "invalid":
        return GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=-1))
    if kind == "schema":
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        return GenerateRequest(prompt_ids=prompt, max_tokens=16, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    if kind == "sampled":
        return GenerateRequest(prompt_ids=prompt, max_tokens=24, sampling=SamplingParams(temperature=0.8, top_p=0.9))
    return GenerateRequest(prompt_ids=prompt, max_tokens=rng.choice([4, 16, 64, 200]), ignore_eos=kind != "valid")


async def _one_round(socket, rng: random.Random, kind: str) -> None:
    if kind == "raw-abandon":  # a request, then the connection drops without a word
        with RawConnection(socket) as raw:
            raw.hello()
            raw.send(Generate(request=msgspec.structs.replace(_request(rng, "valid"), request_id=f"raw-{rng.random()}")))
        return
    async with Client.connect(socket) as client:
        for _ in range(rng.randrange(1, 4)):
            request = _request(rng, kind)
            if kind == "invalid":
                with pytest.raises(InvalidRequestError):
                    await collect(client.generate(request))
            elif kind in ("cancel", "abandon"):
                async for event in client.generate(request):
                    if isinstance(event, TokenDelta):
                        break  # leaving the stream cancels the request
                if kind == "abandon":
                    return  # and the connection closes with requests possibly in flight
            else:
                assert isinstance((await collect(client.generate(request))).last, Finished)


async def _worker(socket, worker: int, deadline: float, tally: dict) -> None:
    rng = random.Random(worker)
    while time.monotonic() < deadline:
        kind = rng.choice(["valid", "valid", "sampled", "invalid", "cancel", "abandon", "schema", "raw-abandon"])
        try:
            await _one_round(socket, rng, kind)
            tally[kind] += 1
        except ServerBusyError:
            tally["busy"] += 1


async def test_a_soak_of_mixed_traffic_leaves_nothing_behind(server):
    model, tokenizer = load_reference("builtin:tiny")
    prompt = [random.Random(41).randrange(1000) for _ in range(30)]
    expected = greedy_tokens(model, tokenizer, prompt, 12)
    async with Client.connect(server.socket) as client:
        await collect(client.generate(GenerateRequest(prompt_ids=prompt, max_tokens=12)))
        baseline = await wait_idle(client, connections=1)
    fds_before, rss_before = server.num_fds(), server.rss_kib()

    tally = dict.fromkeys(["valid", "sampled", "invalid", "cancel", "abandon", "schema", "raw-abandon", "busy"], 0)
    # Two halves: a leak grows with the traffic, in the second half as in the first; what the
    # allocator keeps after the first (arenas of threads it met, freed blocks) mostly does not.
    rss_half, prefix_half = rss_before, baseline.kv.prefix_bytes
    for half in range(2):
        deadline = time.monotonic() + SOAK_S / 2
        async with anyio.create_task_group() as tg:
            for worker in range(WORKERS):
                tg.start_soon(_worker, server.socket, worker + 100 * half, deadline, tally)
        assert server.alive, server.stderr()
        if half == 0:
            async with Client.connect(server.socket) as client:
                prefix_half = (await wait_idle(client, timeout=60, connections=1)).kv.prefix_bytes
            rss_half = server.rss_kib()
    assert min(tally[k] for k in ("valid", "invalid", "cancel", "abandon")) > 0, tally

    async with Client.connect(server.socket) as client:
        stats = await wait_idle(client, timeout=60, connections=1)
        assert (await collect(client.generate(GenerateRequest(prompt_ids=prompt, max_tokens=12)))).tokens == expected
        stats = await wait_idle(client, connections=1)
    assert stats.live_requests == 0 and stats.kv.live_tokens == 0 and stats.kv.reserved_tokens == 0
    # KV held beyond the baseline is the prefix cache only, within its budget.
    assert stats.kv.physical_bytes - stats.kv.prefix_bytes <= baseline.kv.physical_bytes
    assert server.num_fds() <= fds_before + 2, f"file descriptors {fds_before} -> {server.num_fds()}"
    # Memory grows by what the prefix cache keeps (bounded by kv.prefix_cache_bytes: a 2-minute soak
    # leaves ~300 MB in ~9,000 entries), what the allocator keeps, and not much more.
    # (Measured, 12 s: +150-170 MB alone, +240-285 MB beside a busy second core, where one run in
    # CI failed the former bound of 250 MB; the second half +83-100 MB beside busy cores.)
    rss_after = server.rss_kib()
    grown, second = rss_after - rss_before, rss_after - rss_half
    prefix_kib, second_prefix_kib = stats.kv.prefix_bytes // 1024, (stats.kv.prefix_bytes - prefix_half) // 1024
    assert grown < 400_000 + prefix_kib, f"RSS +{grown} KiB, prefix cache {stats.kv.prefix_bytes} bytes in {stats.kv.prefix_entries} entries"
    assert second < 200_000 + second_prefix_kib, f"RSS +{second} KiB in the second half (+{grown} KiB in all), prefix cache +{second_prefix_kib} KiB"
