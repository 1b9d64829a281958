"""One engine, built in one call on the MLX thread: by the model actor (rank 0, or the only
rank) and by a follower rank alike.

`build_engine` loads the model (this rank's shard in a world), applies the KV format, makes
the grammar side for its tokenizer, loads the draft model (the speculator), creates the
adapter bank, and builds the `Engine` on them. The adapters a configuration names are
registered afterwards, like any adapter load: their files are read in a worker thread (bounded
by the bank's largest file for this model, known only once it is loaded), then handed to
`AdapterBank.register` on the MLX thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec

from engine import native
from engine.denoise import DenoiseEngine, Denoiser
from engine.denoise_blocks import BlockDenoiseEngine
from engine.draft import DraftRunner
from engine.engine import Engine, Grammars
from engine.lora import AdapterBank
from engine.model.diffusion import is_block_diffusion
from engine.model.loader import LoadedModel, load_model, with_kv_format
from engine.model.world import World
from engine.speculation import Speculator
from policies.speculation import MEASURED_MAX_BATCH, SpeculationGate
from protocols.config import KvConfig, LoraConfig, ModelConfig, SpeculativeConfig
from protocols.errors import ModelLoadError
from protocols.model import ModelInfo

MakeGrammars = Callable[[Any, ModelInfo], Grammars]


class EngineSpec(msgspec.Struct, frozen=True):
    """What an engine is built from: the configuration sections that shape it."""

    model: ModelConfig
    kv: KvConfig = msgspec.field(default_factory=KvConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)


@dataclass
class BuiltEngine:
    engine: Engine | Denoiser
    loaded: LoadedModel
    grammars: Grammars
    bank: AdapterBank
    world: World | None = None

    @property
    def info(self) -> ModelInfo:
        return self.loaded.info


def build_engine(
    spec: EngineSpec,
    builtin_root: Path,
    make_grammars: MakeGrammars,
    *,
    world: World | None = None,
    progress: Callable[[str], None] | None = None,
) -> BuiltEngine:
    """Runs on the MLX thread. In a `world`, the model is this rank's shard, its `ModelInfo`
    names the world, and the step is not compiled (a collective inside a compiled function
    is not supported)."""
    if world is not None:
        native.disable("a distributed world's rank (a lost peer hung the step with the kernels)")
    elif mx.default_device() == mx.cpu:
        # (compiled on first use: before "ready", with progress; before the load, whose policy for
        # quantized weights depends on them: `engine.model.weights`)
        native.load(builtin_root, progress)
    model = load_model(spec.model, builtin_root, progress, world)
    loaded = with_kv_format(model, spec.kv, sharded=world is not None)
    if world is not None:
        loaded.info = msgspec.structs.replace(loaded.info, world=f"{world.config.mode}/{world.size}")
    grammars = make_grammars(loaded.tokenizer, loaded.info)
    if loaded.info.denoising:
        if spec.speculative.draft:
            raise ModelLoadError("speculative decoding does not apply to a diffusion language model: leave speculative.draft unset")
        bank = AdapterBank(loaded.model, 0, spec.lora.max_rank)
        denoiser = BlockDenoiseEngine(loaded.model) if is_block_diffusion(loaded.info.model_type) else DenoiseEngine(loaded.model)
        return BuiltEngine(engine=denoiser, loaded=loaded, grammars=grammars, bank=bank, world=world)
    speculator = load_speculator(loaded, spec.speculative, spec.model, builtin_root, progress)
    bank = AdapterBank(loaded.model, spec.lora.max_resident, spec.lora.max_rank)
    engine = Engine(loaded.model, loaded.layout, grammars, loaded.tokenizer.decode, speculator, bank, spec.kv.budget_bytes, compiled=world is None)
    return BuiltEngine(engine=engine, loaded=loaded, grammars=grammars, bank=bank, world=world)


def load_speculator(
    target: LoadedModel, config: SpeculativeConfig, model: ModelConfig, builtin_root: Path, progress: Callable[[str], None] | None = None
) -> Speculator:
    """Speculative decoding for `target`: its draft model (loaded like the target, refused with
    `ModelLoadError` unless it shares the target's tokenizer and vocabulary), the batch gate,
    and a drafted token's cost estimated from the two models' sizes (decoding on this backend
    streams the weights: its time follows the parameter count)."""
    gate = SpeculationGate(config.max_batch or MEASURED_MAX_BATCH)
    if not config.draft:
        return Speculator(gate=gate)
    draft_config = msgspec.structs.replace(model, path=config.draft, max_context=None)
    draft = load_model(draft_config, builtin_root, progress)
    if _vocabulary(draft.tokenizer) != _vocabulary(target.tokenizer) or draft.info.vocab_size != target.info.vocab_size:
        raise ModelLoadError(f"draft model {config.draft!r} does not share the model's tokenizer and vocabulary")
    runner = DraftRunner(draft.model, draft.layout)
    return Speculator(runner, gate, draft_cost=draft.info.num_parameters / max(1, target.info.num_parameters))


def _vocabulary(tokenizer) -> dict[str, int]:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return dict(hf.get_vocab())
