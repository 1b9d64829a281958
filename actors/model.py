"""The model lease actor: the only door to the MLX thread.

Loads the model (and tokenizer) on the dedicated MLX thread, with the LoRA adapters the
config names, builds the engine there, then executes `RunStep` plans one at a time,
answering each with a `StepOutcome` (or `StepFailed`, after which the engine holds no
requests), and `AdapterCall`s (load, unload, list adapters) between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, assert_never

import anyio
import anyio.to_thread
import structlog

from actors.mailbox import Mailbox, answer
from actors.mlx_thread import MlxThread
from engine.engine import Engine, Grammars
from engine.loader import load_model, load_speculator, with_kv_format
from engine.lora import AdapterBank
from protocols.api import AdapterInfo
from protocols.config import AdapterConfig, KvConfig, LoraConfig, ModelConfig, SpeculativeConfig
from protocols.errors import InternalError, MlxrtError
from protocols.model import AdapterCall, DropPrefixes, ModelInbox, ModelInfo, RunStep, StepFailed, StepOutcome, StepPlan

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


# Builds the grammar compiler for a loaded tokenizer (the runtime's GrammarCache).
MakeGrammars = Callable[[Any, ModelInfo], Grammars]


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
    ):
        self._config = config
        self._kv = kv or KvConfig()
        self._speculative = speculative or SpeculativeConfig()
        self._lora = lora or LoraConfig()
        self._adapters = adapters or []
        self._builtin_root = builtin_root
        self._make_grammars = make_grammars
        self._thread = thread
        self._progress = progress
        self.inbox: Mailbox[ModelInbox] = Mailbox(16)

    async def run(self, *, task_status) -> None:
        with self.inbox:  # closed however this ends, a failed load included
            loaded = await self._thread.run(load_model, self._config, self._builtin_root, self._progress)
            loaded = with_kv_format(loaded, self._kv)
            grammars = await anyio.to_thread.run_sync(self._make_grammars, loaded.tokenizer, loaded.info)
            speculator = await self._thread.run(load_speculator, loaded, self._speculative, self._config, self._builtin_root, self._progress)
            bank = await self._thread.run(AdapterBank, loaded.model, self._lora.max_resident, self._lora.max_rank)
            for adapter in self._adapters:
                await self._thread.run(lambda a=adapter: bank.register(a.name, a.path, pinned=a.pinned))
            pool_bytes = self._kv.budget_bytes
            engine = await self._thread.run(lambda: Engine(loaded.model, loaded.layout, grammars, loaded.tokenizer.decode, speculator, bank, pool_bytes))
            log.info("model_loaded", **{k: getattr(loaded.info, k) for k in ("path", "model_type", "dtype", "device", "num_parameters", "load_s")})
            adapters = await self._thread.run(bank.infos)
            task_status.started(ModelReady(info=loaded.info, tokenizer=loaded.tokenizer, grammars=grammars, adapters=adapters))
            while True:
                message = await self.inbox.receive()
                match message:
                    case RunStep(plan=plan, reply=reply):
                        answer(reply, await self._step(engine, plan))
                    case DropPrefixes(entry_ids=entry_ids):
                        await self._thread.run(engine.drop_prefixes, entry_ids)
                    case AdapterCall(reply=reply):
                        answer(reply, await self._adapter_call(bank, message))
                    case _:
                        assert_never(message)

    async def _adapter_call(self, bank: AdapterBank, call: AdapterCall) -> list[AdapterInfo] | Exception:
        def run() -> list[AdapterInfo]:
            if call.op == "load":
                bank.register(call.name, call.path, pinned=call.pinned)
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

    async def _step(self, engine: Engine, plan: StepPlan) -> StepOutcome | StepFailed:
        try:
            return await self._thread.run(engine.step, plan)
        except Exception as exc:
            log.exception("step_failed")
            await self._thread.run(engine.reset)
            return StepFailed(error=f"{type(exc).__name__}: {exc}")
