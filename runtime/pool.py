"""Several models in one process: `ModelPool` (embedding API).

`[model]` is the default model and `[[models]]` adds others; `GenerateRequest.model` names one
(an unknown name is `ModelNotFoundError`). Each resident model is a `Runtime` of its own, all
sharing one MLX thread (one device, one thread). Their weights stay under
`model_pool.memory_bytes`: a request for a model that is not resident loads it, swapping out
the least recently used unpinned models first, once each has been resident at least
`model_pool.min_resident_s` (no thrashing between two busy models).

A swapped-out model's running requests are preempted: their runtime shuts down, keeping each
request's last durable checkpoint (requests through a pool checkpoint every
`model_pool.checkpoint_every` tokens, under a fixed seed), and each request waits for its model
to come back, then resumes from its checkpoint (or, without one, is generated again from the
start). Generation is exact given the seed, so the resumed stream repeats what the caller already
has: those tokens, texts and tool calls are skipped, and the caller sees one uninterrupted stream.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import msgspec
import structlog

from actors.mlx_thread import MlxThread
from engine.model.memory import DTYPE_BYTES, estimate_weight_bytes, release_memory
from policies import residency
from policies.validation import check_request_id
from protocols.api import AdapterInfo, Event, Finished, GenerateRequest, ModelStatus, TokenDelta, new_request_id
from protocols.config import Pooling
from protocols.model import ModelInfo
from protocols.stats import Stats
from runtime.admission import checkpoint_directory_problem
from runtime.checkpoints import path_for
from runtime.config import RuntimeConfig
from runtime.errors import (
    ConfigError,
    DuplicateRequestError,
    InternalError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    ModelUnavailableError,
    RuntimeClosedError,
    single_errors,
)
from runtime.metrics import RuntimeMetrics
from runtime.pool_state import PoolEntry, PoolRequest
from runtime.replay import Replay, cancelled
from runtime.runtime import Runtime
from runtime.streams import PoolStream

if TYPE_CHECKING:
    from runtime.serving import Serving

log = structlog.get_logger(actor="pool")


class ModelPool:
    """Models served from one process under a memory cap. Create with `ModelPool.open`."""

    def __init__(self, config: RuntimeConfig, thread: MlxThread, task_group):
        self.config = config
        self._thread = thread
        self._tg = task_group
        self._lock = anyio.Lock()
        self._changed = anyio.Event()
        self._seeds = random.Random(config.generation.seed)
        self._models: dict[str, PoolEntry] = {}
        self._cancelled: set[str] = set()
        self._running: dict[str, PoolEntry] = {}
        self._live: set[str] = set()
        self._default_info: ModelInfo | None = None
        self._default_metrics: RuntimeMetrics | None = None
        self._last_stats: Stats | None = None
        self._closed = False
        # The most weight bytes ever resident at once (checked against the cap by tests).
        self.peak_weight_bytes = 0
        entries = [(config.model_name, config.model, False), *((m.name, m.model_config(config.model), m.pinned) for m in config.models)]
        for name, model_options, pinned in entries:
            if name in self._models:
                raise ConfigError(f"[[models]]: the name {name!r} is used twice")
            model_config = msgspec.structs.replace(
                config,
                model=model_options,
                server=msgspec.structs.replace(config.server, served_model_name=name),
                models=[],
                # `[[adapters]]` are the default model's (an adapter fits one model's shapes).
                adapters=config.adapters if name == config.model_name else [],
            )
            self._models[name] = PoolEntry(name, model_config, pinned, weight_bytes=0)
        self.default_model = config.model_name
        self._checkpoint_every = config.model_pool.checkpoint_every

    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig) -> AsyncIterator[ModelPool]:
        """Start the pool; the default model is loaded at once, the others on first use."""
        thread = MlxThread()
        thread.start(config.scheduler.switch_interval_s)
        try:
            with single_errors():
                async with anyio.create_task_group() as tg:
                    pool = cls(config, thread, tg)
                    for model in pool._models.values():
                        model.weight_bytes = await anyio.to_thread.run_sync(estimate_weight_bytes, model.config.model.path)
                    pool._check_fits()
                    problem = await anyio.to_thread.run_sync(checkpoint_directory_problem, config.checkpoint_directory())
                    if problem is not None:
                        pool._checkpoint_every = 0  # swapped-out requests are regenerated instead
                    try:
                        default = pool._models[pool.default_model]
                        await pool._acquire(default)
                        pool._release(default)
                        yield pool
                    finally:
                        with anyio.CancelScope(shield=True):
                            await pool._close()
        finally:
            with anyio.CancelScope(shield=True):
                await thread.stop()

    # -- requests ----------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Stream a request's events from the model it names, across swaps of that model."""
        async with self.submit(request) as stream:
            async for event in stream:
                yield event

    def submit(self, request: GenerateRequest) -> PoolStream:
        """Claim the request's id and return its stream (as `Runtime.submit`): raises
        `ModelNotFoundError` for an unknown model, `DuplicateRequestError` for a live id."""
        if self._closed:
            raise RuntimeClosedError("the pool is shutting down")
        model = self._model(request.model)
        rid = request.request_id or new_request_id()
        check_request_id(rid)
        if rid in self._live:
            raise DuplicateRequestError(f"request {rid!r} is already live", field="request_id")
        self._live.add(rid)
        return PoolStream(rid, self._events(model, msgspec.structs.replace(request, request_id=rid)), self)

    async def prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        """As `Runtime.prompt_token_ids`, on the model the request names (loaded, as a request
        for it would be, if it is not resident)."""
        if self._closed:
            raise RuntimeClosedError("the pool is shutting down")
        model = self._model(request.model)
        rt = await self._acquire(model)
        assert rt is not None  # (None only for a cancelled request id)
        try:
            return await rt.prompt_token_ids(msgspec.structs.replace(request, model=None))
        finally:
            self._release(model)

    async def embed(
        self, inputs: list[list[int]] | list[str], *, model: str | None = None, pooling: Pooling | None = None, normalize: bool | None = None
    ) -> tuple[list[list[float]], int]:
        """As `Runtime.embed`, on the model named (loaded, as a request for it would be, if it
        is not resident)."""
        if self._closed:
            raise RuntimeClosedError("the pool is shutting down")
        entry = self._model(model)
        rt = await self._acquire(entry)
        assert rt is not None  # (None only for a cancelled request id)
        try:
            return await rt.embed(inputs, pooling=pooling, normalize=normalize)
        finally:
            self._release(entry)

    def submit_resume(self, request_id: str) -> PoolStream:
        raise InvalidRequestError("resuming a checkpoint by id is not available with several models", field="request_id")

    @property
    def model_info(self) -> ModelInfo:
        """The default model's (what the socket's Welcome describes)."""
        assert self._default_info is not None
        return self._default_info

    async def stats(self, *, fresh: bool = True) -> Stats:
        """A resident model's runtime stats (the default model's when it is resident), with
        every model's state. Never loads a model: with none resident (all swapped out between
        loads), the last figures with nothing running and this pool's waiting requests."""
        resident = sorted((m for m in self._models.values() if m.runtime is not None and not m.loading), key=lambda m: m.name != self.default_model)
        runtime = resident[0].runtime if resident else None
        if runtime is not None:  # (not counted as a use: polling stats must not keep a model resident)
            try:
                self._last_stats = await runtime.stats(fresh=fresh)
            except RuntimeClosedError:
                pass  # swapped out meanwhile: the last figures below
        assert self._last_stats is not None  # the default model was loaded at start
        stats = self._last_stats
        if not resident:
            idle_kv = msgspec.structs.replace(stats.kv, live_requests=0, live_tokens=0, live_bytes=0, reserved_tokens=0, reserved_bytes=0, physical_bytes=0)
            idle = msgspec.structs.replace(stats.scheduler, waiting=len(self._live), prefilling=0, decoding=0, paused=0)
            stats = msgspec.structs.replace(stats, scheduler=idle, kv=idle_kv, live_requests=len(self._live))
        return msgspec.structs.replace(stats, models=self.models())

    def known_models(self) -> list[str]:
        return list(self._models)

    def known_adapters(self) -> list[str]:
        """Adapters are the default model's, not addressed by name over HTTP with several models."""
        return []

    @property
    def tokenizer(self):
        return self.tokenizer_for(None)

    def tokenizer_for(self, model: str | None):
        """A model's tokenizer (known once it has been loaded: a request's model has been by the
        time its tokens need texts)."""
        tokenizer = self._model(model).tokenizer
        if tokenizer is None:
            raise InternalError(f"the tokenizer of {model!r} is asked for before the model was loaded")
        return tokenizer

    @property
    def metrics(self) -> RuntimeMetrics:
        """The default model's request metrics (its latest runtime's)."""
        assert self._default_metrics is not None  # the default model was loaded at start
        return self._default_metrics

    @property
    def world_error(self) -> str | None:
        """None: a pool is never a distributed world (`RuntimeConfig.check_distributed`)."""
        return None

    async def load_adapter(self, name: str, path, *, pinned: bool = False) -> AdapterInfo:
        raise InvalidRequestError("with several models, adapters are the default model's [[adapters]]", field="name")

    async def unload_adapter(self, name: str) -> None:
        raise InvalidRequestError("with several models, adapters are the default model's [[adapters]]", field="name")

    async def adapters(self) -> list[AdapterInfo]:
        return []

    async def _events(self, model: PoolEntry, request: GenerateRequest) -> AsyncIterator[Event]:
        """The request's runs, one per residence of its model, until one finishes."""
        pending = await self._pending(model, request)
        try:
            while not pending.finished:
                rt = await self._acquire(model, pending.rid)
                if rt is None:
                    yield cancelled(pending.rid, pending.delivered)
                    return
                async for event in self._run(model, rt, pending):
                    yield event
                if not pending.finished:
                    log.info("request_preempted", request_id=pending.rid, model=model.name, delivered=len(pending.delivered.token_ids))
        finally:
            self.forget(pending.rid)

    async def _pending(self, model: PoolEntry, request: GenerateRequest) -> PoolRequest:
        """The request as the pool runs it: a fixed seed (every run generates the same stream) and
        the pool's checkpoint cadence, unless the request sets its own (checked as usual)."""
        rid = request.request_id
        assert rid is not None
        seed = request.sampling.seed if request.sampling.seed is not None else self._seeds.getrandbits(63)
        every = request.checkpoint_every if request.checkpoint_every is not None else self._checkpoint_every
        pending_cadence = request.checkpoint_every is None
        if request.checkpoint_every is None and every and await anyio.to_thread.run_sync(path_for(model.config.checkpoint_directory(), rid).exists):
            # The id names another request's checkpoint (a crashed one): leave it alone, and
            # generate this request again after a swap instead of checkpointing it.
            every = 0
        request = msgspec.structs.replace(
            request, model=None, request_id=rid, sampling=msgspec.structs.replace(request.sampling, seed=seed), checkpoint_every=every
        )
        return PoolRequest(rid, request, pool_cadence=pending_cadence)

    async def _run(self, model: PoolEntry, rt: Runtime, pending: PoolRequest) -> AsyncIterator[Event]:
        """One run on the model's runtime: resumed from the request's own checkpoint (only one
        this request wrote) or generated again, its events past what the caller has, until it
        finishes (`pending.finished`) or the model is swapped out under it."""
        rid, epoch = pending.rid, model.epoch
        replay = Replay(pending.delivered)
        catching_up = bool(pending.delivered.token_ids)  # the model is not swapped out before it gets past
        model.replaying += catching_up
        self._running[rid] = model
        try:
            if pending.pool_cadence and pending.request.checkpoint_every and rt.model_info.denoising:
                # A denoising request is not checkpointed: after a swap it is denoised again
                # from its seed (the same answer; what was delivered is skipped).
                pending.request = msgspec.structs.replace(pending.request, checkpoint_every=0)
            every = pending.request.checkpoint_every or 0
            resume = pending.runs > 0 and every > 0 and await rt.checkpointed_request(rid) == pending.request
            pending.runs += 1
            async for event in rt.resume(rid) if resume else rt.generate(pending.request):
                if isinstance(event, Finished) and event.finish_reason == "cancelled" and model.epoch != epoch and rid not in self._cancelled:
                    return  # preempted (with any flush of its cut text): resumed when the model is back
                for part in replay.deliver(event):
                    if isinstance(part, Finished) or (isinstance(part, TokenDelta) and part.token_ids):
                        if catching_up:
                            catching_up, model.replaying = False, model.replaying - 1
                        self._progressed(model)
                    yield part
                if isinstance(event, Finished):
                    pending.finished = True
                    return
            if model.epoch == epoch:
                raise InternalError(f"request {rid!r} ended without Finished")
        except RuntimeClosedError:
            if model.epoch == epoch or self._closed:
                raise
        finally:
            if catching_up:
                model.replaying -= 1
            self._running.pop(rid, None)
            self._release(model)

    async def cancel(self, request_id: str) -> None:
        """End a request; one waiting for its model ends as soon as it is noticed."""
        if request_id not in self._live:
            return  # not (or no longer) a request of this pool: nothing to remember
        self._cancelled.add(request_id)
        model = self._running.get(request_id)
        if model is not None and model.runtime is not None:
            await model.runtime.cancel(request_id)
        self._notify()

    def _progressed(self, model: PoolEntry) -> None:
        model.progress += 1
        if model.progress == 1:
            self._notify()  # a swap waiting for this model's first progress may go ahead

    def forget(self, request_id: str) -> None:
        """The request has ended (or never started): its id is free again."""
        self._cancelled.discard(request_id)
        self._live.discard(request_id)

    def models(self) -> list[ModelStatus]:
        return [
            ModelStatus(
                name=m.name,
                path=m.config.model.path,
                pinned=m.pinned,
                state="loading" if m.loading else "resident" if m.runtime is not None else "unloaded",
                weight_bytes=m.weight_bytes,
                live_requests=m.users,
                loads=m.loads,
                preempted=m.preempted,
            )
            for m in self._models.values()
        ]

    # -- residency ---------------------------------------------------------------------------

    def _model(self, name: str | None) -> PoolEntry:
        model = self._models.get(name or self.default_model)
        if model is None:
            raise ModelNotFoundError(f"no model named {name!r}; this pool serves {', '.join(self._models)}", field="model")
        return model

    def _check_fits(self) -> None:
        if problem := residency.pinned_overflow(self._models.values(), self.config.model_pool.memory_bytes):
            raise ConfigError(problem)

    async def _acquire(self, model: PoolEntry, rid: str | None = None) -> Runtime | None:
        """The model's runtime, loading it (and swapping others out) if it is not resident;
        None once request `rid` is cancelled while it waits."""
        while True:
            if rid in self._cancelled:
                return None
            if model.runtime is not None and not self._closed:
                return self._use(model, model.runtime)  # resident: no waiting behind another model's load
            async with self._lock:
                if self._closed:
                    raise RuntimeClosedError("the pool is shutting down")
                if model.runtime is not None:
                    return self._use(model, model.runtime)
                if not model.loads:  # its files may have changed since start: estimate again
                    model.weight_bytes = await anyio.to_thread.run_sync(estimate_weight_bytes, model.config.model.path)
                    self._check_can_fit(model)
                wait_s = await self._make_room(model)
                if wait_s is None:
                    try:
                        await self._load(model)
                    except ModelLoadError as exc:  # the other models keep serving; the caller learns why
                        log.error("model_load_failed", model=model.name, error=str(exc))
                        raise ModelUnavailableError(f"model {model.name!r} could not be loaded: {exc}") from None
                    continue
            with anyio.move_on_after(wait_s):
                await self._changed.wait()

    @staticmethod
    def _use(model: PoolEntry, runtime: Runtime) -> Runtime:
        model.users += 1
        model.last_used = time.monotonic()
        return runtime

    def _release(self, model: PoolEntry) -> None:
        model.users -= 1
        model.last_used = time.monotonic()
        self._notify()

    async def _make_room(self, model: PoolEntry) -> float | None:
        """Swap out models until `model` fits; None when it does, else how long to wait before
        trying again (the models in the way are too fresh)."""
        cap = self.config.model_pool.memory_bytes
        if not cap:
            return None
        now, floor = time.monotonic(), self.config.model_pool.min_resident_s
        while self._resident_bytes() + model.weight_bytes > cap:
            swap = residency.next_swap(self._models.values(), model, now, floor)
            if swap.victim is None:
                return swap.wait_s  # (a wait for progress is woken by `_progressed`)
            await self._unload(self._models[swap.victim.name])
        return None

    def _resident_bytes(self) -> int:
        return sum(m.weight_bytes for m in self._models.values() if m.runtime is not None or m.loading)

    async def _load(self, model: PoolEntry) -> None:
        model.loading, model.stop, model.stopped = True, anyio.Event(), anyio.Event()
        try:
            model.runtime = await self._tg.start(self._host, model)
        finally:
            model.loading = False
        model.loads += 1
        model.loaded_at, model.progress = time.monotonic(), 0
        info = model.runtime.model_info
        model.tokenizer = model.runtime.tokenizer
        if model.name == self.default_model:
            self._default_info, self._default_metrics = info, model.runtime.metrics
        model.weight_bytes = info.num_parameters * DTYPE_BYTES.get(info.dtype, 4)
        if not await self._kept_within_cap(model):
            return
        if self._last_stats is None:
            self._last_stats = await model.runtime.stats()
        self.peak_weight_bytes = max(self.peak_weight_bytes, self._resident_bytes())
        log.info("model_resident", model=model.name, weight_bytes=model.weight_bytes, resident_bytes=self._resident_bytes())

    async def _kept_within_cap(self, model: PoolEntry) -> bool:
        """The cap holds for what was loaded, not only for what was estimated (a model's files
        may have been replaced since): over it, the model goes out again (False), and comes back
        once room is made for its real size (`_acquire` loops), or is refused if it never fits."""
        cap = self.config.model_pool.memory_bytes
        if not cap or self._resident_bytes() <= cap:
            return True
        log.warning("model_over_cap", model=model.name, weight_bytes=model.weight_bytes, resident_bytes=self._resident_bytes(), cap=cap)
        await self._unload(model)
        self._check_can_fit(model)
        return False

    def _check_can_fit(self, model: PoolEntry) -> None:
        """Refuse a model that cannot fit the cap beside the pinned ones, however many are swapped out."""
        if problem := residency.never_fits(self._models.values(), model, self.config.model_pool.memory_bytes):
            raise ModelLoadError(problem)

    async def _host(self, model: PoolEntry, *, task_status) -> None:
        try:
            async with Runtime.open(model.config, thread=self._thread) as rt:
                task_status.started(rt)
                await model.stop.wait()
        finally:
            model.stopped.set()

    async def _unload(self, model: PoolEntry) -> None:
        """Swap a model out: its runtime shuts down (live requests keep their checkpoints and
        wait for it), its memory goes back."""
        model.epoch += 1
        model.preempted += model.users
        model.runtime = None
        model.stop.set()
        await model.stopped.wait()
        await self._thread.run(release_memory)
        log.info("model_swapped_out", model=model.name, preempted=model.users)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def shutdown(self) -> None:
        """Stop every model (live requests end `cancelled`, keeping their checkpoints)."""
        await self._close()

    async def _close(self) -> None:
        self._closed = True
        for model in self._models.values():
            if model.runtime is not None:
                model.runtime = None
                model.stop.set()
                await model.stopped.wait()
        self._notify()


if TYPE_CHECKING:  # both implement the serving contract the fronts are typed against (mypy checks)

    def _serving(pool: ModelPool, runtime: Runtime) -> tuple[Serving, Serving]:
        return pool, runtime
