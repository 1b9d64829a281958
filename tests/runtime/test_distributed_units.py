"""The distributed pieces that need no world: config refusals, the launcher, rank shards of
checkpoints, the typed error, the control connections' handshake (the 2-rank worlds are in
tests/integration/test_distributed.py)."""

from __future__ import annotations

import secrets
import socket
import sys
import threading
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import safetensors.numpy
import structlog

from engine.model.control import Gate, HandshakeError, answer_challenge, check_answer, check_secret
from engine.model.world import World, shard
from policies.layout import checkpoint_format, tensor_shapes
from protocols.api import SamplingParams
from protocols.config import DistributedConfig
from protocols.errors import ERROR_KINDS, CheckpointError, ConfigError, ModelLoadError, UnavailableError, error_for
from protocols.model import AdmitRequest, CheckpointData, LayerLayout, ModelInfo, ResumeState, StepOutcome, StepPlan, WorldCommand, WorldStep, WorldStop
from runtime import env
from runtime.config import RuntimeConfig
from runtime.follower import ShardCheckpoints
from tools.cli import main
from tools.launch import LocalWorld, free_ports, launch_environ, launched_rank, mlx_launch_command

LAYERS = [LayerLayout(kind="full", heads=1, key_dim=4, value_dim=4, dtype="float32") for _ in range(2)]
INFO = ModelInfo(
    path="m", model_type="llama", vocab_size=64, max_context=64, num_layers=2, kv_bytes_per_token=64, dtype="float32",
    device="cpu", eos_token_ids=[0], num_parameters=1, load_s=0.0, model_id="model-a", tokenizer_id="tok-a", layers=LAYERS, world="tensor/2",
)  # fmt: skip


def config(**tree) -> RuntimeConfig:
    return RuntimeConfig.from_tree({"model": {"path": "builtin:tiny"}, "distributed": {"backend": "ring"}, **tree}, source="<test>")


def test_a_plain_world_config_passes_and_what_is_not_sharded_is_refused_by_name():
    config().check_distributed()
    RuntimeConfig.from_tree({"model": {"path": "builtin:tiny"}, "kv": {"bits": 8}}, source="<t>").check_distributed()  # no world: no check
    refused = config(
        kv={"bits": 8, "block_size": 16},
        speculative={"draft": "builtin:tiny"},
        adapters=[{"name": "a", "path": "/x"}],
        models=[{"name": "other", "path": "builtin:tiny-qwen2"}],
    )
    with pytest.raises(ConfigError) as caught:
        refused.check_distributed()
    for key in ("[[models]]", "[[adapters]]", "speculative.draft", "kv.bits", "kv.block_size"):
        assert key in str(caught.value)


def test_distributed_keys_are_checked_like_any_other():
    with pytest.raises(ConfigError, match=r"distributed\.mode"):
        config(distributed={"backend": "ring", "mode": "expert"})
    with pytest.raises(ConfigError, match=r"distributed\.backend"):
        config(distributed={"backend": "tcp"})
    assert config().distributed == DistributedConfig(backend="ring")


def test_unavailable_is_a_typed_503_that_clients_raise_as_its_class():
    assert ERROR_KINDS["unavailable"].http_status == 503
    assert isinstance(error_for("unavailable", "rank 1 is gone"), UnavailableError)


def test_plans_cross_the_world_as_msgpack_without_pickle():
    plan = StepPlan(admit=[AdmitRequest(request_id="r", prompt_ids=[1, 2], max_tokens=3, sampling=SamplingParams(), seed=5, stop_token_ids=[0])], decode=True)
    data = msgspec.msgpack.encode(WorldStep(plan=plan))
    assert b"\x80\x04" not in data[:2]  # not a pickle
    assert msgspec.msgpack.decode(data, type=WorldCommand) == WorldStep(plan=plan)


def test_the_launched_rank_comes_from_the_launcher(monkeypatch):
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert launched_rank() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert launched_rank() == 3
    monkeypatch.setenv("MLX_RANK", "0")
    assert launched_rank() == 0


def test_hosts_or_other_backends_go_through_mlx_launch(tmp_path):
    hosts = tmp_path / "hosts.json"
    command = mlx_launch_command(config(distributed={"backend": "mpi"}), "c.toml", 2, str(hosts), ["--socket", "/s"])
    assert command[command.index("--backend") + 1] == "mpi" and command[command.index("--hostfile") + 1] == str(hosts)
    serve = command[command.index("--") + 1 :]
    assert serve[1:4] == ["-m", "tools.cli", "serve"] and serve[-2:] == ["--socket", "/s"]


@pytest.mark.distributed
def test_a_local_world_runs_every_rank_with_its_rank_and_a_ring_hostfile(capfd):
    script = "import json, os; hosts = json.load(open(os.environ['MLX_HOSTFILE'])); print('rank', os.environ['MLX_RANK'], len(hosts), os.environ['MLXRT_DISTRIBUTED_CONTROL'].startswith('127.0.0.1:'))"
    assert LocalWorld(3, [sys.executable, "-c", script], {}).run() == 0
    out = capfd.readouterr().out
    assert sorted(line for line in out.splitlines() if line.startswith("rank")) == [f"rank {r} 3 True" for r in range(3)]


@pytest.mark.distributed
def test_a_failing_rank_ends_the_local_world_with_a_failure():
    # Rank 1 fails at once; rank 0 would sleep for a minute: it is ended (SIGTERM) instead.
    script = "import os, sys, time; sys.exit(3) if os.environ['MLX_RANK'] == '1' else time.sleep(60)"
    world = LocalWorld(2, [sys.executable, "-c", script], {})
    assert world.run() == 1
    assert world.processes[1].returncode == 3 and world.processes[0].returncode not in (None, 0)


def _admit(rid: str, resume: ResumeState | None = None) -> AdmitRequest:
    return AdmitRequest(request_id=rid, prompt_ids=[1, 2, 3, 4], max_tokens=20, sampling=SamplingParams(), seed=1, stop_token_ids=[0], resume=resume)


def _checkpoint(rid: str, generated: list[int], fill: float) -> CheckpointData:
    num = 4 + len(generated) - 1
    arrays = {name: np.full(shape, fill, dtype=np.float32) for name, shape in tensor_shapes(LAYERS, num).items()}
    return CheckpointData(request_id=rid, generated=generated, num_kv_tokens=num, kv_tensors=safetensors.numpy.save(arrays))


def _outcome(*checkpoints: CheckpointData) -> StepOutcome:
    return StepOutcome(outputs=[], prefilled=[], released=[], num_decode_rows=1, kv_tokens={}, kv_bytes=0, step_s=0.0, checkpoints=list(checkpoints))


def test_a_rank_keeps_its_last_two_shards_and_resumes_the_one_rank_0_holds(tmp_path):
    shards = ShardCheckpoints(tmp_path / "rank1", INFO)
    shards.after_step(StepPlan(admit=[_admit("r")]), _outcome(_checkpoint("r", [5, 6], 1.0)))
    shards.after_step(StepPlan(decode=True), _outcome(_checkpoint("r", [5, 6, 7, 8], 2.0)))
    shards.after_step(StepPlan(decode=True), _outcome(_checkpoint("r", [5, 6, 7, 8, 9, 10], 3.0)))
    assert sorted(p.name for p in (tmp_path / "rank1").iterdir()) == ["r@7.ckpt", "r@9.ckpt"]
    # Rank 0 had written only its checkpoint at 7 positions when the world was killed.
    resumed = shards.local_resume(_admit("r", ResumeState(generated=[5, 6, 7, 8], num_kv_tokens=7, kv_tensors=b"rank 0's shard")))
    assert resumed.resume is not None and resumed.resume.num_kv_tokens == 7
    arrays = safetensors.numpy.load(resumed.resume.kv_tensors)
    assert all(float(a.max()) == 2.0 for a in arrays.values())  # this rank's own tensors
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        shards.local_resume(_admit("r", ResumeState(generated=[5, 6], num_kv_tokens=5, kv_tensors=b"")))
    with pytest.raises(CheckpointError, match="disagrees"):
        shards.local_resume(_admit("r", ResumeState(generated=[5, 6, 7, 99], num_kv_tokens=7, kv_tensors=b"")))
    shards.after_step(StepPlan(forget_checkpoints=["r"]), _outcome())
    assert list((tmp_path / "rank1").iterdir()) == []


def test_a_sharded_checkpoint_names_its_world():
    assert checkpoint_format(INFO) == "float, sharded tensor/2"
    assert checkpoint_format(msgspec.structs.replace(INFO, world="")) == "float"


class _Shardable:
    def __init__(self, heads: int, kv_heads: int):
        self.layers = [SimpleNamespace(self_attn=SimpleNamespace(n_heads=heads, n_kv_heads=kv_heads)) for _ in range(2)]
        self.sharded = False

    def shard(self, group) -> None:
        self.sharded = True


def _world(mode: str, size: int = 2) -> SimpleNamespace:
    return SimpleNamespace(config=DistributedConfig(backend="ring", mode=mode), size=size, group=None)


def test_a_model_is_sharded_only_where_the_world_splits_it_evenly():
    fits = _Shardable(heads=8, kv_heads=2)
    shard(fits, "llama", _world("tensor"))  # type: ignore[arg-type]
    assert fits.sharded
    # SmolLM's shape: 9 query heads over 3 KV heads; mlx-lm would floor 9 // 2 and serve another model.
    odd = _Shardable(heads=9, kv_heads=3)
    with pytest.raises(ModelLoadError, match="9 attention heads"):
        shard(odd, "llama", _world("tensor"))  # type: ignore[arg-type]
    assert not odd.sharded
    with pytest.raises(ModelLoadError, match="no `pipeline\\(\\)`"):
        shard(odd, "llama", _world("pipeline"))  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="no tensor-parallel"):
        shard(SimpleNamespace(layers=[]), "mamba", _world("tensor"))  # type: ignore[arg-type]


# The control connections' handshake (engine.model.world): a localhost listener and real sockets.
SECRET = b"s" * 32


class _Rank0:
    """Rank 0's gate on a localhost port, run in a thread: `joined` by rank, or `error`."""

    def __init__(self, ranks: set[int], handshake_s: float = 5.0, within_s: float = 10.0):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.gate = Gate(self.server, SECRET, ranks, handshake_s)
        self.joined: dict[int, socket.socket] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(time.monotonic() + within_s,), daemon=True)
        self._thread.start()

    def _run(self, deadline: float) -> None:
        try:
            self.joined = self.gate.run(deadline)
        except BaseException as exc:
            self.error = exc
        finally:
            self.server.close()

    def follower(self, rank: int, secret: bytes = SECRET) -> socket.socket:
        conn = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        try:
            answer_challenge(conn, secret, rank)
        except BaseException:
            conn.close()
            raise
        return conn

    def wait(self) -> dict[int, socket.socket]:
        self._thread.join(15)
        assert self.error is None and self.joined is not None, self.error
        return self.joined

    def __enter__(self) -> _Rank0:
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join(15)
        for conn in (self.joined or {}).values():
            conn.close()


def test_the_right_secret_joins_a_rank_and_its_connection_carries_frames():
    with structlog.testing.capture_logs() as logs, _Rank0({1}) as rank0, rank0.follower(1) as follower:
        joined = rank0.wait()
        assert list(joined) == [1]
        joined[1].sendall(b"plan")
        assert follower.recv(4) == b"plan"
    assert rank0.gate.refused == 0 and not logs


def test_a_wrong_secret_is_refused_and_rank_0_keeps_waiting_for_the_real_rank():
    with structlog.testing.capture_logs() as logs, _Rank0({1}) as rank0:
        with pytest.raises(HandshakeError, match="closed by the peer"):
            rank0.follower(1, secret=b"w" * 32)
        with rank0.follower(1):
            assert list(rank0.wait()) == [1]
    assert rank0.gate.refused == 1
    assert [(e["event"], e["log_level"], e["reason"]) for e in logs] == [("control_refused", "warning", "wrong proof of the world's secret")]
    assert all(SECRET.decode() not in str(e) for e in logs)


def test_a_rank_out_of_range_or_already_connected_is_refused_and_ranks_come_ordered():
    with _Rank0({1, 2}) as rank0, rank0.follower(2):
        with pytest.raises(HandshakeError):
            rank0.follower(2)  # the right secret, but rank 2 is already in
        with pytest.raises(HandshakeError):
            rank0.follower(7)  # not a rank of this world
        with rank0.follower(1):
            assert list(rank0.wait()) == [1, 2] and rank0.gate.refused == 2


def test_a_silent_or_garbage_connection_is_closed_while_the_real_rank_joins_beside_it():
    with structlog.testing.capture_logs() as logs, _Rank0({1}, handshake_s=0.5) as rank0:
        with socket.create_connection(("127.0.0.1", rank0.port)) as silent, socket.create_connection(("127.0.0.1", rank0.port)) as garbage:
            garbage.sendall(b"\xff" * 200)
            assert len(silent.recv(64)) == 32  # the challenge: a nonce
            silent.settimeout(5)
            assert silent.recv(64) == b""  # closed...
            host, port = silent.getsockname()
            with rank0.follower(1):
                assert list(rank0.wait()) == [1]
        assert rank0.gate.refused == 2
    reasons = {e["peer"]: e["reason"] for e in logs if e["event"] == "control_refused"}
    assert reasons[f"{host}:{port}"] == "no answer within 0.5 s"  # ...once its handshake time ran out


def test_rank_0_gives_up_at_its_deadline_and_a_follower_refuses_a_stranger_posing_as_rank_0():
    rank0 = _Rank0({1}, within_s=0.3)
    rank0._thread.join(5)
    assert isinstance(rank0.error, TimeoutError)
    # A stranger listening first: it challenges, but cannot prove the secret back.
    with socket.create_server(("127.0.0.1", 0)) as stranger:

        def pose() -> None:
            conn, _ = stranger.accept()
            with conn:
                conn.sendall(secrets.token_bytes(32))
                conn.recv(68)
                conn.sendall(secrets.token_bytes(32))

        threading.Thread(target=pose, daemon=True).start()
        with socket.create_connection(stranger.getsockname(), timeout=5) as conn, pytest.raises(HandshakeError, match="not rank 0"):
            answer_challenge(conn, SECRET, 1)


def test_an_answer_is_checked_for_its_length_its_proof_and_its_rank():
    nonce = secrets.token_bytes(32)
    with pytest.raises(HandshakeError, match="bytes"):
        check_answer(SECRET, nonce, b"short", {1})
    with pytest.raises(HandshakeError, match="wrong proof"):
        check_answer(SECRET, nonce, bytes(68), {1})


def test_two_worlds_ranks_join_over_the_control_port_and_exchange_plans():
    (port,) = free_ports(1)
    config = DistributedConfig(backend="ring", control=f"127.0.0.1:{port}")
    rank0, rank1 = (World(SimpleNamespace(rank=lambda r=r: r, size=lambda: 2), config) for r in (0, 1))
    secret = "x" * 40
    leader = threading.Thread(target=rank0._connect_control, args=(config.control, secret))
    leader.start()
    rank1._connect_control(config.control, secret)
    leader.join(10)
    rank0.send(WorldStop())
    assert rank1.receive() == WorldStop()
    for conn in (*rank0._control, *rank1._control):
        conn.close()


def test_a_world_with_a_control_address_and_no_secret_refuses_to_start():
    config = DistributedConfig(backend="ring", control="127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"no MLXRT_DISTRIBUTED_SECRET.*`mlxrt launch` sets one"):
        World.join(config, "")  # before joining any collective
    with pytest.raises(ConfigError, match="a 5-character MLXRT_DISTRIBUTED_SECRET"):
        World.join(config, "short")
    check_secret(config.control, "z" * 16)


def test_the_secret_is_read_from_the_environment_and_never_a_config_key(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MLXRT_DISTRIBUTED_SECRET", "do-not-print-" + "q" * 20)
    assert env.world_secret().startswith("do-not-print-")
    assert "MLXRT_DISTRIBUTED_SECRET" not in env.environment()
    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "builtin:tiny"\n[distributed]\nbackend = "ring"\n')
    assert RuntimeConfig.load(path).distributed == DistributedConfig(backend="ring")
    assert main(["config", "show", "--config", str(path)]) == 0
    assert "do-not-print" not in capsys.readouterr().out


def test_each_launch_makes_a_fresh_secret_unless_the_caller_set_one(monkeypatch):
    monkeypatch.delenv("MLXRT_DISTRIBUTED_SECRET", raising=False)
    first, second = launch_environ()["MLXRT_DISTRIBUTED_SECRET"], launch_environ()["MLXRT_DISTRIBUTED_SECRET"]
    assert len(first) == 64 and int(first, 16) >= 0 and first != second
    monkeypatch.setenv("MLXRT_DISTRIBUTED_SECRET", "mine-" + "m" * 20)
    assert launch_environ()["MLXRT_DISTRIBUTED_SECRET"] == "mine-" + "m" * 20
