"""A follower rank of a distributed world (any rank but 0): `mlxrt serve` on such a rank.

It loads its shard of the model, builds the same engine rank 0 builds, and makes rank 0's
calls on it (`engine.model.world.follow`) until rank 0 stops the world, or the world breaks (a
peer gone: the collective raises, and the process exits with an error, which ends the
launch). No actors, no sockets: this process's main thread is its MLX thread.

Its checkpoints (`ShardCheckpoints`) hold its own shard of each request's KV, beside rank 0's.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import msgspec
import structlog
import xgrammar as xgr

from engine.build import EngineSpec, build_engine
from engine.model.world import World, follow
from policies.layout import checkpoint_format
from protocols.api import GenerateRequest
from protocols.errors import CheckpointError, ConfigError
from protocols.model import AdmitRequest, GrammarSpec, ModelInfo, ResumeState, StepOutcome, StepPlan
from runtime import checkpoints, env
from runtime.config import RuntimeConfig
from runtime.grammar import GrammarCache
from runtime.logging import configure_logging
from runtime.progress import Progress

log = structlog.get_logger(actor="follower")


class CompilingGrammars:
    """Rank 0 compiles a request's grammar before admitting it; a follower compiles it when
    the engine first asks (the plan names it), then keeps it in the same bounded cache."""

    def __init__(self, cache: GrammarCache):
        self._cache = cache
        self.vocab_size = cache.vocab_size

    def matcher(self, spec: GrammarSpec) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self._cache.compile(spec))


class ShardCheckpoints:
    """This rank's shard of each checkpoint: `<checkpoint dir>/rank<r>/<request id>@<positions>`.

    Written right after the step that captured it; rank 0 writes its own a moment later, so a
    kill between the two leaves this rank one checkpoint ahead: the previous one is kept
    until the next is written. A resume takes the one covering as many positions as rank 0's.
    Deleted when rank 0 deletes its own (`StepPlan.forget_checkpoints`)."""

    KEPT = 2

    def __init__(self, directory: Path, info: ModelInfo):
        self.directory = directory
        self.info = info
        self.kv_format = checkpoint_format(info)
        self.max_bytes = checkpoints.max_file_bytes(info.max_context, info.layers)
        self._admitted: dict[str, AdmitRequest] = {}
        checkpoints.prepare_directory(directory)

    def _versions(self, request_id: str) -> list[int]:
        pattern = re.compile(re.escape(request_id) + r"@(\d+)\.ckpt$")
        found = (pattern.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def after_step(self, plan: StepPlan, outcome: StepOutcome) -> None:
        for admit in plan.admit:
            self._admitted[admit.request_id] = admit
        for data in outcome.checkpoints:
            admit = self._admitted[data.request_id]
            key = f"{data.request_id}@{data.num_kv_tokens}"
            header = checkpoints.CheckpointHeader(
                model_id=self.info.model_id,
                tokenizer_id=self.info.tokenizer_id,
                request=GenerateRequest(request_id=key, prompt_ids=admit.prompt_ids, max_tokens=admit.max_tokens),
                prompt_ids=admit.prompt_ids,
                seed=admit.seed,
                max_tokens=admit.max_tokens,
                stop_token_ids=admit.stop_token_ids,
                generated=data.generated,
                num_kv_tokens=data.num_kv_tokens,
                created_at=time.time(),
                adapter_digest=data.adapter_digest,
                kv_format=self.kv_format,
            )
            checkpoints.write_atomic(self.directory, key, checkpoints.encode(header, data.kv_tensors))
            for old in self._versions(data.request_id)[: -self.KEPT]:
                checkpoints.delete(self.directory, f"{data.request_id}@{old}")
        for rid in plan.release:
            self._admitted.pop(rid, None)
        for rid in plan.forget_checkpoints:
            for version in self._versions(rid):
                checkpoints.delete(self.directory, f"{rid}@{version}")

    def local_resume(self, admit: AdmitRequest) -> AdmitRequest:
        """Rank 0's resumed admission with this rank's shard of the same checkpoint."""
        assert admit.resume is not None
        wanted = admit.resume.num_kv_tokens
        key = f"{admit.request_id}@{wanted}"
        try:
            header, tensors = checkpoints.read(
                self.directory, key, model_id=self.info.model_id, tokenizer_id=self.info.tokenizer_id, max_bytes=self.max_bytes, kv_format=self.kv_format
            )
            checkpoints.check_tensors(header, tensors, self.info.layers)
        except (OSError, CheckpointError) as exc:
            # Rank 0 holds a checkpoint this rank does not: the world cannot resume it.
            raise CheckpointError(f"rank shard {self.directory}: no usable checkpoint of {admit.request_id!r} at {wanted} positions ({exc})") from exc
        if header.generated != admit.resume.generated:
            raise CheckpointError(f"rank shard of {admit.request_id!r} disagrees with rank 0's checkpoint")
        return msgspec.structs.replace(admit, resume=ResumeState(generated=header.generated, num_kv_tokens=wanted, kv_tensors=tensors))


def run_follower(config: RuntimeConfig) -> None:
    configure_logging(config.logging)
    config.check_distributed()
    world = World.join(config.distributed, env.world_secret())
    if world.rank == 0:
        raise ConfigError("rank 0 serves (`mlxrt serve`); only the other ranks follow")
    progress = Progress(f"rank {world.rank}")

    def make_grammars(tokenizer, info: ModelInfo) -> CompilingGrammars:
        return CompilingGrammars(GrammarCache.for_model(tokenizer, info, config.limits))

    spec = EngineSpec(model=config.model, kv=config.kv, speculative=config.speculative, lora=config.lora)
    built = build_engine(spec, env.home(), make_grammars, world=world, progress=progress.step)
    engine, info = built.engine, built.info
    shards = ShardCheckpoints(config.checkpoint_directory() / f"rank{world.rank}", info)
    shards_expired = checkpoints.expire(shards.directory, config.checkpoints.max_age_s)
    progress.done(f"rank {world.rank} of {world.size} following ({info.world}, {info.num_parameters / 1e6:.1f}M params here)")
    log.info("follower_ready", rank=world.rank, size=world.size, world=info.world, expired=len(shards_expired))
    follow(engine, world, shards)
