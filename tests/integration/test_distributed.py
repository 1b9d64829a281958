"""One model over a 2-rank mlx.distributed world on this machine (ring backend), issue 16.

Each world is `mlxrt launch -n 2` (mlx.launch, two `mlxrt serve` ranks): rank 0 serves the
socket, rank 1 follows its plans on its shard. Streams are compared with mlx-lm's own greedy
generation on the unsharded model (tensor mode: `builtin:tiny`, a llama; pipeline mode:
`builtin:tiny-qwen2`, one layer per rank).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from net.client import Client
from protocols.api import GenerateRequest, SamplingParams, TokenDelta
from protocols.errors import ForeignCheckpointError, UnavailableError
from runtime.config import RuntimeConfig
from runtime.runtime import Runtime
from tests.support.config import CHUNK, builtin_dir, make_config
from tests.support.events import collect
from tests.support.gguf_files import write_gguf
from tests.support.mlx_reference import greedy_tokens, load_reference
from tests.support.serve import ServerProcess, wait_idle, write_config
from tests.support.waiting import wait_until
from tools.launch import free_ports

pytestmark = [pytest.mark.distributed, pytest.mark.server]

WORLD_READY_S = 120.0
MAX_TOKENS = 24
STEP_TIMEOUT_S = 4.0
MODELS = {"tensor": "builtin:tiny", "pipeline": "builtin:tiny-qwen2"}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randrange(4, 2 * CHUNK + 5))] for _ in range(n)]


@contextlib.contextmanager
def world(
    directory: Path, mode: str, environ: dict[str, str] | None = None, model: str | None = None, step_timeout_s: float = STEP_TIMEOUT_S, **sections
) -> Iterator[ServerProcess]:
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    config = write_config(
        directory,
        model={"path": model or MODELS[mode]},
        distributed={"backend": "ring", "mode": mode, "step_timeout_s": step_timeout_s},
        logging={"level": "info", "format": "json"},
        **sections,
    )
    process = ServerProcess(config, directory / "run" / "s.sock", directory, command=["launch", "-n", "2", "--config", str(config), "--"], environ=environ)
    try:
        process.wait_ready(WORLD_READY_S)
        yield process
    finally:
        process.stop()
        if process.alive:
            process.kill_group()


def rank_pid(world_process: ServerProcess, rank: int) -> int:
    """The pid of one rank's `mlxrt serve` (a descendant of the launcher, with MLX_RANK set)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
            if b"serve" in cmdline and f"MLX_RANK={rank}".encode() in environ and os.getpgid(int(entry.name)) == world_process.proc.pid:
                return int(entry.name)
        except (OSError, ProcessLookupError):
            continue
    raise AssertionError(f"no rank {rank} process in the world's group")


@pytest.fixture(scope="module")
def references():
    out = {}
    for mode, name in MODELS.items():
        model, tokenizer = load_reference(name)
        out[mode] = {tuple(p): greedy_tokens(model, tokenizer, p, MAX_TOKENS) for p in prompts(8, 16)}
    return out


@pytest.mark.parametrize(
    ("mode", "road"),
    [pytest.param("tensor", "socket", marks=pytest.mark.exhaustive), ("pipeline", "socket"), ("tensor", "collectives")],
    ids=["tensor-socket", "pipeline-socket", "tensor-collectives"],
)
async def test_eight_concurrent_greedy_streams_over_two_ranks_equal_mlx_lm(tmp_path, references, mode, road):
    # Plans reach the followers over the control socket, or (no `distributed.control`) in collectives.
    environ = {"MLXRT_DISTRIBUTED_CONTROL": ""} if road == "collectives" else None
    with world(tmp_path / mode, mode, environ) as process:
        async with Client.connect(process.socket) as client:
            outcomes: dict[tuple[int, ...], object] = {}

            async def run(prompt: list[int]) -> None:
                outcomes[tuple(prompt)] = await collect(client.generate(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS)))

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for prompt in prompts(8, 16):
                        tg.start_soon(run, prompt)
            for prompt, expected in references[mode].items():
                outcome = outcomes[prompt]
                assert outcome.last.finish_reason in ("length", "stop"), outcome.last
                assert outcome.tokens == expected, f"{mode}: prompt of {len(prompt)} tokens"
            stats = await wait_idle(client)
            assert stats.kv.live_tokens == 0 and stats.world is not None and stats.world.available and stats.world.size == 2
        joined = log_events(process, "world_joined")
        assert len(joined) == 2 and all((j["control"] is None) == (road == "collectives") for j in joined), joined


async def test_grammar_prefix_hits_seeded_sampling_and_a_cancel_in_a_world(tmp_path):
    """A grammar request (rank 1 compiles the grammar when its plan names it), a prompt served twice
    (the second from the prefix cache) and a seeded sampled request: the same as one process gives.
    Then, in the same world, a long request cancelled mid-stream frees its KV on both ranks."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
    prompt = [random.Random(3).randrange(1000) for _ in range(3 * CHUNK)]
    requests = [
        GenerateRequest(prompt="answer:", max_tokens=48, response_format=fmt),
        GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS),
        GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS),
        GenerateRequest(prompt_ids=prompt[:20], max_tokens=MAX_TOKENS, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=7)),
    ]
    single = RuntimeConfig.from_tree({"model": {"path": MODELS["tensor"]}, "generation": {"seed": 0}}, source="<test>")
    expected = []
    async with Runtime.open(single) as rt:
        for request in requests:
            expected.append(await collect(rt.generate(request)))
    with world(tmp_path / "features", "tensor") as process:
        async with Client.connect(process.socket) as client:
            with anyio.fail_after(60):
                got = [await collect(client.generate(request)) for request in requests]
            assert [g.tokens for g in got] == [e.tokens for e in expected]
            assert isinstance(json.loads("".join(ev.text for ev in got[0].events if isinstance(ev, TokenDelta)))["ok"], bool)
            assert got[2].last.usage.cached_tokens > 0  # the repeat was seeded from the prefix cache

            long_one = GenerateRequest(request_id="long-one", prompt_ids=prompts(1, 5)[0], max_tokens=1500, ignore_eos=True)
            seen = 0
            with anyio.fail_after(60):
                async for event in client.generate(long_one):
                    seen += len(getattr(event, "token_ids", ()))
                    if seen >= 8:
                        await client.cancel("long-one")
                    if type(event).__name__ == "Finished":
                        assert event.finish_reason == "cancelled"
            stats = await wait_idle(client)
            assert stats.kv.live_tokens == 0 and stats.kv.live_requests == 0
        # Rank 1 logs what it holds after each step that releases a request.
        line = _follower_release(process, "long-one")
        assert line["kv_tokens"] == 0 and line["live"] == 0


@pytest.mark.exhaustive  # GGUF files and worlds each run in make test
async def test_a_gguf_file_in_a_world_equals_one_process(tmp_path):
    """Each rank reads the GGUF file whole, then keeps its shard: the tokens of one process."""
    path = write_gguf(builtin_dir("tiny"), tmp_path / "tiny.gguf", qtype="F32")
    async with Runtime.open(make_config(str(path))) as rt:
        expected = [(await collect(rt.generate(GenerateRequest(prompt_ids=p, max_tokens=MAX_TOKENS)))).tokens for p in prompts(4, 23)]
    with world(tmp_path / "world", "tensor", model=str(path)) as process:
        async with Client.connect(process.socket) as client:
            got = [(await collect(client.generate(GenerateRequest(prompt_ids=p, max_tokens=MAX_TOKENS)))).tokens for p in prompts(4, 23)]
            assert (await client.stats()).world.size == 2
    assert got == expected


def log_events(process: ServerProcess, event: str) -> list[dict]:
    """The JSON log events of that name, from every rank (their lines may interleave)."""
    return [json.loads(m.group(0)) for m in re.finditer(r'\{[^{}]*"event": "' + event + r'"[^{}]*\}', process.log_text())]


def _follower_release(process: ServerProcess, request_id: str) -> dict:
    return wait_until(
        lambda: next((found for found in log_events(process, "follower_released") if request_id in found["released"]), None),
        message=lambda: f"rank 1 never logged releasing {request_id!r}:\n{process.stderr()}",
    )


async def test_checkpoint_sigkill_of_the_world_relaunch_and_resume_is_exact(tmp_path, references):
    directory = tmp_path / "resume"
    prompt = prompts(1, 16)[0]
    expected = references["tensor"][tuple(prompt)]
    checkpoints = {"dir": str(directory / "checkpoints"), "every_tokens": 4}
    with world(directory, "tensor", checkpoints=checkpoints) as process:
        async with Client.connect(process.socket) as client:
            seen: list[int] = []
            request = GenerateRequest(request_id="durable", prompt_ids=prompt, max_tokens=MAX_TOKENS)
            with anyio.fail_after(60):
                async for event in client.generate(request):
                    seen += getattr(event, "token_ids", [])
                    if len(seen) >= 12:
                        break
        # Both ranks have written a checkpoint past 8 tokens: kill the whole world at once.
        rank1 = directory / "checkpoints" / "rank1"
        wait_until(lambda: list(rank1.glob("durable@*.ckpt")) and (directory / "checkpoints" / "durable.ckpt").exists(), message="no checkpoint on both ranks")
        process.kill_group()
    # One process cannot resume a shard of a 2-rank world: refused, typed, naming the world.
    single = RuntimeConfig.from_tree({"model": {"path": MODELS["tensor"]}, "checkpoints": checkpoints}, source="<test>")
    async with Runtime.open(single) as rt:
        with pytest.raises(ForeignCheckpointError, match="sharded tensor/2"):
            await collect(rt.resume("durable"))
    with world(directory, "tensor", checkpoints=checkpoints) as process:
        async with Client.connect(process.socket) as client:
            with anyio.fail_after(60):
                outcome = await collect(client.resume("durable"))
            assert outcome.last.finish_reason in ("length", "stop"), outcome.last
            assert outcome.tokens == expected


async def test_a_stalled_rank_ends_requests_with_unavailable_within_the_timeout(tmp_path):
    with world(tmp_path / "stall", "tensor") as process:
        follower = rank_pid(process, 1)
        async with Client.connect(process.socket) as client:
            request = GenerateRequest(prompt_ids=prompts(1, 7)[0], max_tokens=4000, ignore_eos=True)
            stopped = False
            try:
                with anyio.fail_after(STEP_TIMEOUT_S + 30):
                    outcome_events = []
                    async for event in client.generate(request):
                        outcome_events.append(event)
                        if not stopped and getattr(event, "token_ids", None):
                            os.kill(follower, signal.SIGSTOP)  # rank 1 stalls mid-generation
                            stopped = True
                finished = outcome_events[-1]
                assert finished.finish_reason == "error" and finished.error_code == "unavailable", finished
                # Ended by the step timeout (the reason says so), not by anything else.
                assert "distributed.step_timeout_s" in (finished.error or ""), finished
                # The world stays down: new requests are refused with the typed error.
                with pytest.raises(UnavailableError):
                    await collect(client.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=2)))
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(follower, signal.SIGCONT)
        # A clean shutdown of rank 0 ends the launch (the stuck follower is ended with it).
        process.terminate()
        assert process.wait_exit(30) is not None, "the world did not exit after SIGTERM"


async def test_a_killed_rank_ends_in_flight_requests_with_unavailable_and_the_world_exits(tmp_path):
    # A long step timeout: the lost peer must be what ends the request, even on a machine so busy
    # that a step takes seconds (a short one raced the ring's report beside a CPU hog).
    with world(tmp_path / "kill", "tensor", step_timeout_s=60.0) as process:
        follower = rank_pid(process, 1)
        async with Client.connect(process.socket) as client:
            request = GenerateRequest(prompt_ids=prompts(1, 9)[0], max_tokens=4000, ignore_eos=True)
            events = []
            with anyio.fail_after(60 + 30):
                async for event in client.generate(request):
                    events.append(event)
                    if len(events) == 1:
                        os.kill(follower, signal.SIGKILL)
            finished = events[-1]
            # The ring reports the lost peer at once: the step failed, it did not time out.
            assert finished.finish_reason == "error" and finished.error_code == "unavailable", finished
            assert "step_timeout_s" not in (finished.error or ""), finished
        # The launcher then shuts rank 0 down cleanly, and the launch ends with a failure.
        code = process.wait_exit(30)
        assert code is not None and code != 0, "the world did not exit after rank 1 died"
        assert "rank 1 exited with -9" in process.log_text()


class Intruder:
    """A local process on the control port: it connects as soon as rank 0 listens (before the
    followers, which retry less often) and again and again, staying silent (held open), sending
    garbage, or a well-sized answer without the secret."""

    PAYLOADS = (b"", b"GET / HTTP/1.1\r\n\r\n" * 8, bytes(68))
    HELD_MAX = 200

    def __init__(self, port: int):
        self.port = port
        self.connections = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="intruder", daemon=True)

    def __enter__(self) -> Intruder:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for conn in self._held:
            conn.close()

    def _run(self) -> None:
        # No pause while the port is closed: the first connection rank 0 accepts is this one's.
        while not self._stop.is_set():
            conn = socket.socket()
            if conn.connect_ex(("127.0.0.1", self.port)) != 0:
                conn.close()
                time.sleep(0.05 if self.connections else 0)  # (once the gate has closed, no hurry)
                continue
            payload = self.PAYLOADS[self.connections % len(self.PAYLOADS)]
            self.connections += 1
            with contextlib.suppress(OSError):
                conn.sendall(payload)
            self._held.append(conn)  # held open: a silent one must time out or be closed by rank 0
            time.sleep(0.001 if len(self._held) < self.HELD_MAX else 0.1)


async def test_a_local_intruder_on_the_control_port_takes_no_rank_and_the_world_serves_exactly(tmp_path, references):
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    secret = secrets.token_hex(32)  # the caller's own, which `mlxrt launch` passes on as it is
    prompt = prompts(1, 16)[0]
    environ = {"MLXRT_DISTRIBUTED_CONTROL": address, "MLXRT_DISTRIBUTED_SECRET": secret}
    with Intruder(port) as intruder, world(tmp_path / "intruder", "tensor", environ) as process:
        async with Client.connect(process.socket) as client:
            with anyio.fail_after(60):
                outcome = await collect(client.generate(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS)))
            assert outcome.last.finish_reason in ("length", "stop"), outcome.last
            assert outcome.tokens == references["tensor"][tuple(prompt)]
        log = process.log_text()
        joined = log_events(process, "world_joined")
        refused = log_events(process, "control_refused")
    assert intruder.connections >= 1
    assert len(joined) == 2 and all(j["control"] == address for j in joined), joined
    # Rank 0 refused the stranger's connections, by name, without the secret in its log.
    assert refused and all(r["peer"].startswith("127.0.0.1:") for r in refused), refused
    assert secret not in log
