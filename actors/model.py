"""The model lease actor: the only door to the MLX thread.

Loads the model (and tokenizer) on the dedicated MLX thread, with the LoRA adapters the
config names, builds the engine there, then executes `RunStep` plans one at a time,
answering each with a `StepOutcome` (or `StepFailed`, after which the engine holds no
requests), and `AdapterCall`s (load, unload, list adapters) between steps.

Steps take a shorter way when they can (`start_step`): the scheduler queues its plan on the
MLX thread from its own task, so the step starts before any other task runs (sessions
detokenizing the last step's tokens run while it computes, not in front of it). A plan that
must read adapter files first, a world's and a diffusion model's that keeps to a share of a
shared thread go through the inbox (`RunStep`).

`Embed` calls (`engine.embed`) run a forward at a time on the MLX thread, so the scheduler's steps
go on between their forwards; a call whose asker left stops at the next forward.

Adapter files are read in worker threads, never on the MLX thread: a load reads its files
while steps go on, then installs them there; a step that admits requests for evicted adapters
first has their files read, and hands them to the bank for that step (`AdapterBank.staged`).

In a distributed world (`[distributed]`) this is rank 0's: its engine broadcasts every plan to
the other ranks (`engine.model.world.Leader`), and a step that does not finish on every rank within
`distributed.step_timeout_s`, or fails, ends its requests with an `unavailable` error and
leaves the world unavailable (`WorldState`): later steps fail at once, and the runtime
refuses requests, until the world is relaunched.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, assert_never

import anyio
import anyio.to_thread
import msgspec
import structlog

from actors.mailbox import Mailbox, abandoned, answer
from actors.mlx_thread import Job, MlxThread
from engine import affinity
from engine.build import BuiltEngine, EngineSpec, MakeGrammars, build_engine
from engine.denoise import Denoiser
from engine.embed import Embedder
from engine.engine import Engine, Grammars
from engine.lora import AdapterBank, AdapterFiles, read_adapter_files, read_staged
from engine.model.vision import VisionLanguageModel
from engine.model.world import Leader, World
from policies.images import warm_up_image_prompt
from protocols.api import AdapterInfo
from protocols.config import AdapterConfig, DistributedConfig, KvConfig, LoraConfig, ModelConfig, SpeculativeConfig
from protocols.errors import AdapterLoadError, InternalError, InvalidRequestError, MlxrtError, RuntimeClosedError, ServerBusyError
from protocols.model import (
    AdapterCall,
    DropPrefixes,
    Embed,
    ExportPrefix,
    ModelInbox,
    ModelInfo,
    PrefixExport,
    RunStep,
    StepFailed,
    StepOutcome,
    StepPlan,
    WorldStats,
)

# A clean shutdown tells the followers to stop; a world that does not take the message in
# this long is already gone.
WORLD_STOP_S = 5.0
# Embedding calls served at once; more are refused busy (the runtime lets fewer through).
MAX_EMBEDS = 4

T = TypeVar("T")

log = structlog.get_logger(actor="model")


@dataclass(frozen=True)
class ModelReady:
    """What the model actor hands the runtime once loaded."""

    info: ModelInfo
    # A transformers/mlx-lm tokenizer: plain Python, safe to use off the MLX thread.
    tokenizer: Any
    # Compiles response formats; shared with the engine, which only asks for matchers.
    grammars: Grammars
    # The adapters `[[adapters]]` named, loaded.
    adapters: list[AdapterInfo]
    # In a distributed world: rank 0's view of it.
    world: WorldState | None = None


class WorldState:
    """Whether the world can run steps (shared with the event loop side: the runtime refuses
    requests once `error` is set)."""

    def __init__(self, leader: Leader, timeout_s: float):
        self.leader = leader
        self.timeout_s = timeout_s
        self.error: str | None = None

    def stats(self) -> WorldStats:
        return self.leader.stats(available=self.error is None, error=self.error)


# Builds the grammar compiler for a loaded tokenizer (the runtime's GrammarCache).


class ModelActor:
    def __init__(
        self,
        config: ModelConfig,
        thread: MlxThread,
        *,
        builtin_root: Path,
        make_grammars: MakeGrammars,
        progress: Callable[[str], None] | None = None,
        speculative: SpeculativeConfig | None = None,
        lora: LoraConfig | None = None,
        adapters: list[AdapterConfig] | None = None,
        kv: KvConfig | None = None,
        distributed: DistributedConfig | None = None,
        world_secret: str = "",
        denoise_share: float = 1.0,
        bulk_share: float = 1.0,
        pin_kernel_thread: bool = False,
    ):
        self._config = config
        self._denoise_share = denoise_share
        self._bulk_share = bulk_share
        self._pin_kernel_thread = pin_kernel_thread
        # When a step for an interactive request last ended (embedding forwards yield to those).
        self._interactive_at = -math.inf
        self._kv = kv or KvConfig()
        self._speculative = speculative or SpeculativeConfig()
        self._lora = lora or LoraConfig()
        self._adapters = adapters or []
        self._builtin_root = builtin_root
        self._make_grammars = make_grammars
        self._thread = thread
        self._progress = progress
        self._distributed = distributed or DistributedConfig()
        self._world_secret = world_secret
        self.world: WorldState | None = None
        self.inbox: Mailbox[ModelInbox] = Mailbox(16)
        self._embeds = 0
        # The engine and adapter bank while serving (`start_step`'s).
        self._serving: tuple[Engine | Leader | Denoiser, AdapterBank] | None = None

    async def run(self, *, task_status) -> None:
        with self.inbox:  # closed however this ends, a failed load included
            spec = EngineSpec(model=self._config, kv=self._kv, speculative=self._speculative, lora=self._lora)
            distributed, secret = self._distributed, self._world_secret

            def build() -> BuiltEngine:
                world = World.join(distributed, secret) if distributed.backend else None
                return build_engine(spec, self._builtin_root, self._make_grammars, world=world, progress=self._progress)

            built = await self._thread.run(build)
            loaded, grammars, bank = built.loaded, built.grammars, built.bank
            engine: Engine | Leader | Denoiser = built.engine
            if built.world is not None:
                assert isinstance(built.engine, Engine)
                leader = engine = Leader(built.engine, built.world)
                self.world = WorldState(leader, self._distributed.step_timeout_s)
            for adapter in self._adapters:  # like any adapter load: files read off the MLX thread
                files = await anyio.to_thread.run_sync(read_adapter_files, adapter.name, adapter.path, bank.max_file_bytes)
                await self._thread.run(lambda a=adapter, f=files: bank.register(f, pinned=a.pinned))
            log.info("model_loaded", **{k: getattr(loaded.info, k) for k in ("path", "model_type", "dtype", "device", "num_parameters", "load_s")})
            if built.world is None and self._pin_kernel_thread and not self._distributed.backend:
                await self._thread.run(affinity.pin)
            if built.world is None:  # (a world's ranks step together: a warm-up on one would wait for the others)
                if self._progress is not None:
                    self._progress("warming up (MLX compiles the kernels of each kind of step once)")
                warm_s = await self._thread.run(built.engine.warm_up, loaded.info.vocab_size)
                warm_s += await self._warm_up_vision(loaded)
                log.info("model_warmed_up", warm_up_s=round(warm_s, 3))
            adapters = await self._thread.run(bank.infos)
            # (A world's body is sharded: a forward on this rank alone would wait for the others.)
            # (Nor a diffusion model's: its body is an encoder-decoder with no final hidden states per token.)
            embedder = await self._thread.run(Embedder, loaded.model, loaded.info.vocab_size) if built.world is None and not loaded.info.denoising else None
            info = msgspec.structs.replace(loaded.info, embedding_size=embedder.width) if embedder is not None else loaded.info
            task_status.started(ModelReady(info=info, tokenizer=loaded.tokenizer, grammars=grammars, adapters=adapters, world=self.world))
            try:
                self._serving = (engine, bank)
                await self._serve(engine, bank, embedder)
            finally:
                self._serving = None
                if self.world is not None and self.world.error is None:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(WORLD_STOP_S):
                        try:
                            await self._thread.run(self.world.leader.stop)
                        except Exception as exc:  # a rank already gone: nothing to stop
                            log.warning("world_stop_failed", error=f"{type(exc).__name__}: {exc}")

    async def _warm_up_vision(self, loaded) -> float:
        """A vision-language model's tower run once on a small image (its kernels compile
        here, not at the first image request); seconds taken."""
        if not isinstance(loaded.model, VisionLanguageModel):
            return 0.0
        started = time.perf_counter()
        rendered = await anyio.to_thread.run_sync(warm_up_image_prompt, loaded.tokenizer, loaded.info.vocab_size)
        await self._thread.run(loaded.model.warm_up, rendered.prompt_ids, rendered.arrays)
        return time.perf_counter() - started

    async def _serve(self, engine: Engine | Leader | Denoiser, bank: AdapterBank, embedder: Embedder | None) -> None:
        # One load's files in memory at a time (each up to `bank.max_file_bytes`).
        reading = anyio.Lock()
        async with anyio.create_task_group() as tg:
            while True:
                message = await self.inbox.receive()
                match message:
                    case RunStep(plan=plan, reply=reply):
                        answer(reply, await self._step(engine, bank, plan))
                    case ExportPrefix() if isinstance(engine, Engine):
                        answer(message.reply, await self._export(engine, message))
                    case ExportPrefix(reply=reply, keys=keys):
                        answer(reply, PrefixExport(keys=keys, arrays=[], error="a distributed world has no disk tier"))
                    case DropPrefixes(entry_ids=entry_ids):
                        if self.world is None:
                            await self._thread.run(engine.drop_prefixes, entry_ids)
                        elif self.world.error is None:
                            await self._on_world(engine.drop_prefixes, entry_ids)
                    case AdapterCall(op="load") if self.world is None:
                        tg.start_soon(self._load_adapter, bank, message, reading)
                    case AdapterCall(reply=reply):
                        answer(reply, await self._adapter_call(bank, message))
                    case Embed() if embedder is not None and self._embeds < MAX_EMBEDS:
                        self._embeds += 1
                        tg.start_soon(self._embed, embedder, message)
                    case Embed(reply=reply):
                        answer(reply, self._embed_refusal(embedder))
                    case _:
                        assert_never(message)

    async def _export(self, engine: Engine, call: ExportPrefix) -> PrefixExport:
        """A prefix entry's positions copied out for the disk tier (numpy, on the MLX thread)."""

        def run() -> tuple[list[dict], float]:
            started = time.perf_counter()
            arrays = engine.export_prefix(call.entry_id, call.spans, call.whole)
            return arrays, time.perf_counter() - started

        try:
            arrays, seconds = await self._thread.run(run)
        except Exception as exc:  # the entry went (a failed step resets nothing of prefixes), a bug
            log.warning("prefix_export_failed", entry_id=call.entry_id, error=f"{type(exc).__name__}: {exc}")
            return PrefixExport(keys=call.keys, arrays=[], error=f"{type(exc).__name__}: {exc}")
        return PrefixExport(keys=call.keys, arrays=arrays, export_s=seconds)

    async def _load_adapter(self, bank: AdapterBank, call: AdapterCall, reading: anyio.Lock) -> None:
        """Read an adapter's files in a worker thread while steps go on, then install them."""
        result: list[AdapterInfo] | Exception = RuntimeClosedError("the runtime closed during the adapter load")
        try:
            async with reading:
                files = await anyio.to_thread.run_sync(read_adapter_files, call.name, call.path, bank.max_file_bytes)
            result = await self._adapter_call(bank, call, files)
        except MlxrtError as exc:
            result = exc
        except Exception:
            log.exception("adapter_read_failed", name=call.name)
            result = InternalError(f"the adapter call failed (load {call.name!r}); the server log has the details")
        finally:
            answer(call.reply, result)

    async def _adapter_call(self, bank: AdapterBank, call: AdapterCall, files: AdapterFiles | None = None) -> list[AdapterInfo] | Exception:
        if self.world is not None and call.op != "list":
            return AdapterLoadError("a distributed world serves no LoRA adapters (adapters are not sharded)")

        def run() -> list[AdapterInfo]:
            if call.op == "load":
                assert files is not None
                bank.register(files, pinned=call.pinned)
            elif call.op == "unload":
                bank.unregister(call.name)
            return bank.infos()

        try:
            return await self._thread.run(run)
        except MlxrtError as exc:
            return exc
        except Exception:
            log.exception("adapter_call_failed", op=call.op, name=call.name)
            return InternalError(f"the adapter call failed ({call.op} {call.name!r}); the server log has the details")

    async def _embed(self, embedder: Embedder, call: Embed) -> None:
        """One embedding call, a forward per MLX-thread job: steps run between its forwards."""
        result: list[list[float]] | Exception = RuntimeClosedError("the runtime closed during the embedding call")
        try:
            job = await self._thread.run(embedder.job, call.inputs, call.pooling, call.normalize, call.batch_tokens)
            while (vectors := await self._thread.run(self._timed, job.step))[0] is None:
                if abandoned(call.reply):
                    await self._thread.run(job.close)
                    return
                await self._yield_to_interactive(vectors[1])
            result = vectors[0]
        except MlxrtError as exc:
            result = exc
        except Exception:
            log.exception("embed_failed", inputs=len(call.inputs))
            result = InternalError("the embedding call failed; the server log has the details")
        finally:
            self._embeds -= 1
            answer(call.reply, result)

    @staticmethod
    def _timed(fn: Callable[[], T]) -> tuple[T, float]:
        """(MLX thread) `fn()` and the seconds it took."""
        started = time.perf_counter()
        return fn(), time.perf_counter() - started

    async def _yield_to_interactive(self, forward_s: float) -> None:
        """After an embedding forward of `forward_s`, while steps for interactive requests run,
        leave the thread to them for the rest of `bulk_share` (bulk work, like the scheduler's)."""
        if self._bulk_share < 1 and time.monotonic() - self._interactive_at <= max(1.0, 4 * forward_s):
            await anyio.sleep(forward_s * (1 - self._bulk_share) / self._bulk_share)

    def _embed_refusal(self, embedder: Embedder | None) -> MlxrtError:
        if self.world is not None:
            return InvalidRequestError("a distributed world serves no embeddings (the model is sharded over its ranks)", field="model")
        if embedder is None:
            return InternalError("the model's embedder is missing")
        return ServerBusyError(f"{MAX_EMBEDS} embedding calls are running; retry later")

    def start_step(self, plan: StepPlan) -> Job[StepOutcome | StepFailed] | None:
        """Queue a step on the MLX thread now, from the caller's task (see the module
        docstring); None where it must go through the inbox, or the thread's queue is full."""
        shared_denoise = bool(plan.denoise) and self._denoise_share < 1
        if self._serving is None or self.world is not None or shared_denoise or any(admit.adapter is not None for admit in plan.admit):
            return None
        engine, bank = self._serving
        return self._thread.submit_nowait(self._run_step, engine, bank, {}, plan)

    async def _step(self, engine: Engine | Leader | Denoiser, bank: AdapterBank, plan: StepPlan) -> StepOutcome | StepFailed:
        if self.world is not None:
            if self.world.error is None:
                outcome = await self._on_world(engine.step, plan)
                if outcome is not None:
                    return outcome
            return StepFailed(error=f"the distributed world is unavailable: {self.world.error}", code="unavailable")
        try:
            files = await self._read_for_step(bank, plan)
        except Exception as exc:
            log.exception("step_failed")
            await self._thread.run(engine.reset)
            return StepFailed(error=f"{type(exc).__name__}: {exc}")
        outcome = await self._thread.run(self._run_step, engine, bank, files, plan)
        shared = isinstance(outcome, StepOutcome) and plan.denoise and self._denoise_share < 1
        if shared and self._thread.busy_besides(id(self), within_s=max(1.0, 4 * outcome.step_s)):
            # (Another model decodes on this thread: denoising keeps to its share of it.)
            await anyio.sleep(outcome.step_s * (1 - self._denoise_share) / self._denoise_share)
        return outcome

    def _run_step(
        self, engine: Engine | Leader | Denoiser, bank: AdapterBank, files: dict[str, AdapterFiles | AdapterLoadError], plan: StepPlan
    ) -> StepOutcome | StepFailed:
        """(MLX thread) One step; a step that fails resets the engine (it holds no requests after)."""
        try:
            with bank.staged(files):
                outcome = engine.step(plan)
        except Exception as exc:
            log.exception("step_failed")
            engine.reset()
            return StepFailed(error=f"{type(exc).__name__}: {exc}")
        self._thread.note(id(self))
        if not plan.bulk_only:
            self._interactive_at = time.monotonic()
        return outcome

    async def _read_for_step(self, bank: AdapterBank, plan: StepPlan) -> dict[str, AdapterFiles | AdapterLoadError]:
        """The files of the evicted adapters this step's admissions need, read in a worker
        thread (a cheap call on the MLX thread says which)."""
        names = {admit.adapter for admit in plan.admit if admit.adapter is not None}
        if not names:
            return {}
        wanted = await self._thread.run(bank.reserve, names)
        if not wanted:
            return {}
        return await anyio.to_thread.run_sync(read_staged, wanted, bank.max_file_bytes)

    async def _on_world(self, call: Callable[..., Any], *args: Any) -> Any:
        """A call every rank makes, within the step timeout; None (and the world unavailable
        from now on) if it fails or times out: the ranks may no longer agree on any state."""
        world = self.world
        assert world is not None
        try:
            with anyio.fail_after(world.timeout_s):
                return await self._thread.run(call, *args)
        except TimeoutError:
            world.error = f"a step did not finish on every rank within {world.timeout_s:g} s (distributed.step_timeout_s): a rank stalled or died"
        except Exception as exc:
            log.exception("world_step_failed")
            world.error = f"a step failed ({type(exc).__name__}: {exc}); the ranks may no longer agree"
        log.error("world_unavailable", reason=world.error)
        return None
