"""One model sharded over the ranks of an mlx.distributed world (MLX thread only).

Rank 0 runs the actors; its engine is a `Leader`: before each call that changes engine state
(a step, dropped prefixes, a reset) it sends the call to every rank as msgspec bytes (no
pickle). Every other rank runs `follow`: it receives each call and makes it on its own engine,
over its own shard, so every rank builds the same graphs in the same order and their
collectives (the tensor-parallel sums, the pipeline's sends) meet.

The calls travel over `distributed.control` (rank 0 listens, every follower connects: one
length-prefixed frame per call) when it is set, else through mx.distributed itself (two
`all_sum`s: the length, then the bytes, summed with the followers' zeros). The socket is the
better road, measured: a collective queues on the CPU stream behind the step still being
computed (decode is pipelined), so a plan sent that way waits for the previous step and the
pipeline is lost (7 ms of a 13 ms step on `tiny`); and MLX's ring backend spins a core while
it waits, where an idle follower blocked on the socket sleeps. Sampling reads logits every rank has in
full (after the sharded layers' `all_sum`, or the pipeline's `all_gather`) with the same
seeds, so every rank draws the same tokens and feeds them to its next step itself.

A control connection counts as a rank only once it proves the world's shared secret
(`engine.model.control`: an HMAC challenge both ways), so a local stranger that connected or listened
first takes no rank.

A rank's state is only what its plans made of it, so a follower needs nothing but the plans,
plus its own shard's checkpoints (written and read beside rank 0's, `rank<r>/` under the
checkpoint directory), which it substitutes into a resumed request's plan.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Protocol

import mlx.core as mx
import msgspec
import numpy as np
import structlog

from engine.model.control import HANDSHAKE_S, Gate, check_secret, reach_leader
from protocols.config import WORLD_SECRET_VARIABLE, DistributedConfig
from protocols.errors import ConfigError, ModelLoadError
from protocols.frames import HEADER, frame, frame_size
from protocols.model import AdmitRequest, StepOutcome, StepPlan, WorldCommand, WorldDrop, WorldReset, WorldStats, WorldStep, WorldStop

log = structlog.get_logger(actor="world")

# Followers reach rank 0's control socket within this (they start together).
CONTROL_CONNECT_S = 60.0
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(WorldCommand)


class World:
    """This process's place in the world: its group, rank and size, and the control sockets
    (`distributed.control`) rank 0 wakes the followers through."""

    def __init__(self, group: Any, config: DistributedConfig):
        self.group = group
        self.rank: int = group.rank()
        self.size: int = group.size()
        self.config = config
        self._control: list[socket.socket] = []

    @classmethod
    def join(cls, config: DistributedConfig, secret: str = "") -> World:
        """Join the world; `secret`: what its control connections prove (needed with `control`)."""
        if config.control:
            check_secret(config.control, secret)  # before the collectives: a refusal ends the launch
        try:
            group = mx.distributed.init(strict=True, backend=config.backend)
        except Exception as exc:  # no backend, no hostfile, a peer that never came up
            raise ConfigError(f"`distributed.backend = {config.backend!r}`: cannot join the world ({exc}); start with `mlxrt launch` or mlx.launch") from exc
        if group.size() < 2:
            raise ConfigError(f"`distributed.backend = {config.backend!r}` but this world has one process; start with `mlxrt launch -n 2` or mlx.launch")
        world = cls(group, config)
        if config.control:
            world._connect_control(config.control, secret)
        world.barrier()
        log.info("world_joined", rank=world.rank, size=world.size, backend=config.backend, mode=config.mode, control=config.control or None)
        return world

    def _connect_control(self, address: str, secret: str) -> None:
        check_secret(address, secret)
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + CONTROL_CONNECT_S
        if self.rank != 0:
            self._control = [reach_leader(address, secret.encode(), self.rank, deadline)]
            return
        with socket.create_server((host, int(port)), reuse_port=False) as server:
            gate = Gate(server, secret.encode(), range(1, self.size), HANDSHAKE_S)
            try:
                joined = gate.run(deadline)
            except TimeoutError:
                raise ConfigError(
                    f"`distributed.control = {address!r}`: {len(gate.joined)} of {self.size - 1} ranks connected within {CONTROL_CONNECT_S:g} s"
                    f" ({gate.refused} connections refused; every rank needs the same {WORLD_SECRET_VARIABLE})"
                ) from None
        self._control = list(joined.values())  # by rank, whatever order they connected in

    def _read_exactly(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self._control[0].recv(n - len(data))
            if not chunk:
                raise RuntimeError("rank 0 closed the control connection")
            data += chunk
        return bytes(data)

    def broadcast(self, data: bytes) -> bytes:
        """Rank 0's bytes on every rank (the others pass b"")."""
        group = self.group
        size = mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=group, stream=mx.cpu)
        length = int(size.item())  # type: ignore[arg-type]
        buffer = mx.array(np.frombuffer(data, dtype=np.uint8)) if self.rank == 0 else mx.zeros((length,), dtype=mx.uint8)
        total = mx.distributed.all_sum(buffer, group=group, stream=mx.cpu)
        mx.eval(total)
        return bytes(np.array(total, copy=True))

    def send(self, command: WorldCommand) -> None:
        data = _ENCODER.encode(command)
        if not self._control:
            self.broadcast(data)
            return
        framed = frame(data)
        for peer in self._control:
            peer.sendall(framed)

    def receive(self) -> WorldCommand:
        if not self._control:
            return _DECODER.decode(self.broadcast(b""))
        size = frame_size(self._read_exactly(HEADER.size))  # rank 0 proved the world's secret: no lower limit
        return _DECODER.decode(self._read_exactly(size))

    def barrier(self) -> None:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=self.group, stream=mx.cpu))


def shard(model, model_type: str, world: World) -> None:
    """Split a lazily loaded model's layers over the world, the way mlx-lm's `sharded_load`
    does; only this rank's shard is then read from the weights."""
    mode = world.config.mode
    try:
        if mode == "tensor":
            if not hasattr(model, "shard"):
                raise ModelLoadError(f'{model_type}: mlx-lm has no tensor-parallel `shard()` for this model type; try `distributed.mode = "pipeline"`')
            _check_heads(model, model_type, world.size)
            model.shard(world.group)
        else:
            inner = getattr(model, "model", None)
            if inner is None or not hasattr(inner, "pipeline"):
                raise ModelLoadError(f'{model_type}: mlx-lm has no `pipeline()` for this model type; try `distributed.mode = "tensor"`')
            if len(inner.layers) < world.size:
                raise ModelLoadError(f"{model_type}: {len(inner.layers)} layers cannot make {world.size} pipeline stages")
            inner.pipeline(world.group)
    except ModelLoadError:
        raise
    except Exception as exc:  # shapes the world size does not divide, and the like
        raise ModelLoadError(f"{model_type}: cannot shard over {world.size} ranks in {mode} mode: {type(exc).__name__}: {exc}") from exc


# Attention head counts mlx-lm's `shard()` divides by the world size (with `//=`: a count the
# size does not divide would silently make another model).
_HEAD_COUNTS = ("n_heads", "n_kv_heads", "num_heads", "num_key_value_heads", "num_attention_heads", "num_kv_heads")


def _check_heads(model, model_type: str, size: int) -> None:
    for index, layer in enumerate(getattr(model, "layers", [])):
        attention = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        for name in _HEAD_COUNTS:
            count = getattr(attention, name, None)
            if isinstance(count, int) and count % size:
                raise ModelLoadError(
                    f'{model_type}: layer {index} has {count} attention heads ({name}), which {size} ranks cannot split evenly; try `distributed.mode = "pipeline"`'
                )


class Leader:
    """Rank 0's engine: each state-changing call is broadcast, then made here. Every other
    attribute is the engine's own (read-only figures)."""

    def __init__(self, engine, world: World):
        self._engine = engine
        self._world = world
        self.steps = 0
        self.broadcast_s = 0.0
        self.step_s = 0.0

    def _send(self, command: WorldCommand) -> None:
        started = time.perf_counter()
        self._world.send(command)
        self.broadcast_s += time.perf_counter() - started

    def step(self, plan: StepPlan) -> StepOutcome:
        started = time.perf_counter()
        self._send(WorldStep(plan=plan))
        try:
            return self._engine.step(plan)
        finally:
            self.steps += 1
            self.step_s += time.perf_counter() - started

    def drop_prefixes(self, entry_ids: list[str]) -> None:
        self._send(WorldDrop(entry_ids=entry_ids))
        self._engine.drop_prefixes(entry_ids)

    def reset(self) -> None:
        self._send(WorldReset())
        self._engine.reset()

    def stop(self) -> None:
        """The followers exit their loops (a clean shutdown of the whole world)."""
        self._send(WorldStop())

    def stats(self, *, available: bool, error: str | None) -> WorldStats:
        config = self._world.config
        return WorldStats(
            size=self._world.size,
            backend=config.backend,
            mode=config.mode,
            available=available,
            error=error,
            steps=self.steps,
            step_s=self.step_s,
            broadcast_s=self.broadcast_s,
        )

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class Shards(Protocol):
    """A follower's own shard of each checkpoint (`runtime.follower.ShardCheckpoints`)."""

    def local_resume(self, admit: AdmitRequest) -> AdmitRequest:
        """A resumed request's admission with this rank's shard of its checkpoint."""
        ...

    def after_step(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """Keep the shards the step captured; delete those rank 0 deleted."""
        ...


def follow(engine, world: World, shards: Shards) -> None:
    """A follower's whole life: make rank 0's calls until it says stop (or the world breaks,
    which raises out of the collective: the peer is gone)."""
    while True:
        command = world.receive()
        if isinstance(command, WorldStep):
            plan = command.plan
            if any(a.resume is not None for a in plan.admit):
                plan = msgspec.structs.replace(plan, admit=[shards.local_resume(a) if a.resume is not None else a for a in plan.admit])
            outcome = engine.step(plan)
            shards.after_step(plan, outcome)
            if plan.release:
                log.info("follower_released", rank=world.rank, released=plan.release, kv_tokens=sum(outcome.kv_tokens.values()), live=len(outcome.kv_tokens))
        elif isinstance(command, WorldDrop):
            engine.drop_prefixes(command.entry_ids)
        elif isinstance(command, WorldReset):
            engine.reset()
        elif isinstance(command, WorldStop):
            log.info("follower_stopped", rank=world.rank)
            return
