"""`Runtime`: the embedding API, and the supervisor of the actors behind it.

`Runtime.open(config)` starts, in order, the MLX thread, the model actor (which
loads the model), the KV store and the scheduler, in one task group: if any
actor fails, the group is cancelled and the error propagates out of `open`.
Each `generate` call validates and tokenizes its request, starts a session
actor, and streams that session's events; leaving the stream early cancels it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import structlog

from actors.kv_store import KvStoreActor
from actors.mailbox import EventChannel, Mailbox, ask
from actors.mlx_thread import MlxThread
from actors.model import ModelActor, ModelReady
from actors.scheduler import SchedulerActor
from actors.session import SessionActor
from policies.adapters import AdapterRegistry, AdapterSlots
from policies.detokenize import make_detokenizer
from policies.embeddings import embedding_ids, embedding_options
from policies.layout import checkpoint_format
from policies.ledger import KvLedger
from policies.output_parser import OutputParser, StreamParser
from policies.scheduling import SchedulePolicy
from policies.tool_formats import make_parser, prompt_opens_reasoning, tokenizer_format
from policies.validation import check_request_id
from protocols.api import AdapterInfo, Event, GenerateRequest, new_request_id
from protocols.config import EmbeddingsConfig, LimitsConfig, Pooling
from protocols.kv import DrainFiles, GetKvStats
from protocols.model import AdapterCall, Embed, ModelInbox, ModelInfo
from protocols.scheduler import GetSchedulerStats
from protocols.stats import Stats
from runtime import allocator, blas, env, kv_files, offload
from runtime.admission import Admission, Prepared, checkpoint_directory_problem
from runtime.checkpoints import CheckpointStore
from runtime.config import RuntimeConfig
from runtime.errors import (
    ConfigError,
    InvalidRequestError,
    ModelNotFoundError,
    RuntimeClosedError,
    ServerBusyError,
    WorldUnavailableError,
    single_errors,
)
from runtime.grammar import GrammarCache
from runtime.logging import configure_logging
from runtime.metrics import RuntimeMetrics
from runtime.progress import Progress
from runtime.streams import Requests, RequestStream
from runtime.telemetry import Telemetry

log = structlog.get_logger(actor="runtime")

EVENT_BUFFER = 16
# Time live requests' callers get to receive their `Finished(cancelled)` at shutdown.
SHUTDOWN_GRACE_S = 2.0
# Embedding calls the model actor runs at once (their forwards take turns with engine steps).
EMBED_CALLS = 2


def tokenize_inputs(tokenizer: Any, inputs: Any, info: ModelInfo, settings: EmbeddingsConfig, limits: LimitsConfig) -> list[list[int]]:
    """(A worker thread or process: `runtime.offload`) each embedding input's token ids."""
    return embedding_ids(inputs, tokenizer, info, settings, limits)


class Runtime:
    """A model served to many concurrent callers. Create with `Runtime.open`."""

    def __init__(
        self,
        config: RuntimeConfig,
        ready: ModelReady,
        actors: tuple[Mailbox[ModelInbox], SchedulerActor, KvStoreActor],
        task_group,
        admission: Admission,
        telemetry: Telemetry,
        adapters: AdapterRegistry,
    ):
        self.config = config
        model, scheduler, kv = actors
        self._model = model
        self._adapters = adapters
        # Prometheus metrics of every request (`metrics.render()`); spans go out through `_telemetry`.
        self.metrics = telemetry.metrics
        self._telemetry = telemetry
        self.model_info: ModelInfo = ready.info
        self._tokenizer = ready.tokenizer
        tokenizer = ready.tokenizer
        self._tool_markers = (tokenizer.tool_call_start, tokenizer.tool_call_end) if getattr(tokenizer, "has_tool_calling", False) else None
        # The family whose tool-call and reasoning markup the chat template names (None: mlx-lm's parser).
        self._tool_format = tokenizer_format(tokenizer)
        self._admission = admission
        self._scheduler = scheduler
        self._kv = kv
        self._requests = Requests(
            scheduler=scheduler.inbox, task_group=task_group, make_session=self._make_session, release=admission.release, buffer=EVENT_BUFFER
        )
        self._closed = False
        self._world = ready.world
        self._embed_calls = anyio.Semaphore(EMBED_CALLS)
        # Embedding calls in progress (tokenizing, waiting for a turn, running): past the queue's size, busy.
        self._embed_waiting = 0

    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig, *, tracer_provider=None, thread: MlxThread | None = None) -> AsyncIterator[Runtime]:
        """Start the runtime; `tracer_provider`: an OpenTelemetry one for request spans (default:
        the globally installed one, if an SDK installed any); `thread`: an MLX thread to share
        (a model pool's), else one of its own."""
        configure_logging(config.logging)
        _report_blas()
        config.check_distributed()
        own_thread = thread is None
        runtime: Runtime | None = None
        if thread is None:
            thread = MlxThread()
            thread.start(config.scheduler.switch_interval_s)
        try:
            with single_errors():
                async with anyio.create_task_group() as tg:
                    runtime = await cls._start_actors(config, thread, tg, tracer_provider)
                    try:
                        yield runtime
                    finally:
                        with anyio.CancelScope(shield=True):
                            await runtime.shutdown()
                        tg.cancel_scope.cancel()
        finally:
            if own_thread:
                # A world that lost a rank may hold the MLX thread in a collective for good.
                lost = runtime is not None and runtime.world_error is not None
                with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_GRACE_S if lost else None):
                    await thread.stop()

    @classmethod
    async def _start_actors(cls, config: RuntimeConfig, thread: MlxThread, tg, tracer_provider) -> Runtime:
        """The actors in dependency order: the model (loads it), the KV store, the scheduler."""
        problem = await anyio.to_thread.run_sync(checkpoint_directory_problem, config.checkpoint_directory())
        if problem is not None:
            if config.checkpoints.every_tokens:
                raise ConfigError(f"`checkpoints.every_tokens` is set but {problem}")
            log.warning("checkpoints_unavailable", reason=problem)
        model, ready = await _start_model(config, thread, tg)
        info, adapters = ready.info, AdapterRegistry(ready.adapters)
        kv = await _start_kv_store(config, info, model.inbox, tg, checkpoints=problem is None)
        scheduler = await _start_scheduler(config, model, kv.inbox, adapters, tg)
        grammars = ready.grammars
        assert isinstance(grammars, GrammarCache)  # what `_start_model` built
        admission = Admission(config, info, ready.tokenizer, grammars, checkpoints_unavailable=problem, adapters=adapters)
        span_log = Path(config.tracing.span_log).expanduser() if config.tracing.span_log else None
        telemetry = Telemetry(RuntimeMetrics(config.model_name, info.max_context), span_log=span_log, tracer_provider=tracer_provider)
        if span_log is not None:
            await tg.start(telemetry.run)
        return cls(config, ready, (model.inbox, scheduler, kv), tg, admission, telemetry, adapters)

    @property
    def tokenizer(self):
        return self._tokenizer

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Claim the request's id now and return its stream; the request is prepared (checked,
        tokenized) and started when the stream is first iterated.

        Raises `DuplicateRequestError` at once for an id that is live, `RuntimeClosedError`
        during shutdown; iterating raises `InvalidRequestError` for bad input and
        `ServerBusyError` when the queue is full.
        """
        self._check_open()
        request_id = request.request_id or new_request_id()
        check_request_id(request_id)
        claim = self._requests.claim(request_id)
        return RequestStream(self._requests, claim, lambda: self._admission.prepare(request, request_id))

    def submit_resume(self, request_id: str) -> RequestStream:
        """As `submit`, for a checkpointed request (`resume`)."""
        self._check_open()
        check_request_id(request_id)
        claim = self._requests.claim(request_id)
        return RequestStream(self._requests, claim, lambda: self._admission.prepare_resume(request_id))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Stream a request's events: `TokenDelta`s (and `PrefillProgress` if asked), then one `Finished`.

        Raises `InvalidRequestError` for bad input, `ServerBusyError` when the
        queue is full, `RuntimeClosedError` during shutdown.
        """
        async with self.submit(request) as stream:
            async for event in stream:
                yield event

    async def prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        """The tokens the request's prompt renders to, exactly as `submit` would render
        it (chat template, tools), without running it: tokenized in a worker thread.

        Raises `InvalidRequestError` for bad input (as `submit` would), `ServerBusyError` when
        too many requests are being prepared, `RuntimeClosedError` during shutdown."""
        self._check_open()
        return await self._admission.prompt_token_ids(request)

    async def embed(
        self, inputs: list[list[int]] | list[str], *, model: str | None = None, pooling: Pooling | None = None, normalize: bool | None = None
    ) -> tuple[list[list[float]], int]:
        """Each input's embedding, and the tokens the inputs had in all: the model's final hidden
        states (the model without its LM head) pooled (`last` token or `mean`; default
        `embeddings.pooling`) and scaled to unit length (default `embeddings.normalize`), float32
        values. Texts are tokenized as a completion prompt is, in a worker thread; the forwards
        run between engine steps on fresh state, so running requests' streams are unchanged.

        Raises `InvalidRequestError` naming the input at fault (`input[2]`: empty, a token id
        outside the vocabulary; `input`: none or too many), `RequestTooLargeError` for an input
        over the context or too many tokens in all (`embeddings.max_tokens`), `ServerBusyError`
        when too many calls wait, `RuntimeClosedError` during shutdown; a distributed world, and
        a model whose body cannot be found (`ModelInfo.embedding_size` 0), refuse them."""
        self._check_open()
        if model is not None and model != self.config.model_name:
            raise ModelNotFoundError(f"no model named {model!r}; this runtime serves {self.config.model_name!r}", field="model")
        if self._world is not None:
            raise InvalidRequestError("a distributed world serves no embeddings (the model is sharded over its ranks)", field="model")
        settings = self.config.embeddings
        options = embedding_options(pooling, normalize, settings)
        if self._embed_waiting >= self.config.scheduler.max_queued_requests:
            raise ServerBusyError("too many embedding calls are waiting; retry later")
        self._embed_waiting += 1
        try:
            listed = inputs if isinstance(inputs, list) else []
            size = offload.text_size(*(i for i in listed if isinstance(i, str))) + 4 * sum(len(i) for i in listed if isinstance(i, list))
            work = (inputs, self.model_info, settings, self.config.limits)
            ids = await offload.run(self._tokenizer, tokenize_inputs, *work, size=size, min_size=self.config.scheduler.bulk_tokenize_bytes)
            async with self._embed_calls:
                self._check_open()
                fields = {"inputs": ids, "pooling": options[0], "normalize": options[1], "batch_tokens": settings.batch_tokens}
                result = await ask(self._model, Embed, **fields)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
            raise RuntimeClosedError("the runtime is closed") from None
        finally:
            self._embed_waiting -= 1
        if isinstance(result, Exception):
            raise result
        return result, sum(len(tokens) for tokens in ids)

    async def checkpointed_request(self, request_id: str) -> GenerateRequest | None:
        """The request a usable checkpoint of `request_id` holds (None when there is none):
        whose the file is, before resuming it."""
        return await anyio.to_thread.run_sync(self._admission.checkpointed_request, request_id)

    async def resume(self, request_id: str) -> AsyncIterator[Event]:
        """Continue a checkpointed request: one `TokenDelta` re-delivering what it generated
        before the checkpoint, then the continuation, then `Finished`.

        Raises a `CheckpointError` subclass when there is no usable checkpoint.
        """
        async with self.submit_resume(request_id) as stream:
            async for event in stream:
                yield event

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the runtime is shutting down")
        if self.world_error is not None:
            raise WorldUnavailableError(f"the distributed world is unavailable ({self.world_error}); relaunch it")

    @property
    def world_error(self) -> str | None:
        """Why the distributed world cannot run steps (None: it can, or there is none)."""
        return self._world.error if self._world is not None else None

    async def cancel(self, request_id: str) -> None:
        """End a request at the next step boundary; its stream ends with `Finished(cancelled)`."""
        await self._requests.cancel(request_id)

    async def stats(self, *, fresh: bool = True) -> Stats:
        """The runtime's figures. `fresh`: as of every message sent before (the scheduler answers
        between steps); otherwise as of the actors' last turn, at once, however long a step runs
        (what `/metrics` serves)."""
        if not fresh:
            scheduler, kv = self._scheduler.latest, self._kv.latest
        else:
            try:
                scheduler = await ask(self._scheduler.inbox, GetSchedulerStats)
                kv = await ask(self._kv.inbox, GetKvStats)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                raise RuntimeClosedError("the runtime is closed") from None
        self.metrics.update(scheduler, kv)
        return Stats(
            scheduler=scheduler,
            kv=kv,
            live_requests=len(self._requests),
            metrics=self.metrics.snapshot(),
            adapters=self._adapters.list(),
            world=self._world.stats() if self._world is not None else None,
        )

    async def load_adapter(self, name: str, path: str | Path, *, pinned: bool = False) -> AdapterInfo:
        """Know a LoRA adapter (a directory in mlx-lm's format) by `name` and load it into a
        slot now; requests then name it (`GenerateRequest.adapter`). Loading a name again from
        the same directory only updates `pinned`.

        Raises `AdapterLoadError` when it cannot be applied (format, shapes, rank, no free slot),
        `InvalidRequestError` for a name already loaded from elsewhere."""
        if not isinstance(name, str) or not 0 < len(name) <= 200:
            raise InvalidRequestError("an adapter name has 1-200 characters", field="name")
        resolved = await anyio.to_thread.run_sync(lambda: str(Path(path).expanduser().resolve()))
        known = await self._adapter_call("load", name=name, path=resolved, pinned=pinned)
        return next(a for a in known if a.name == name)

    def known_models(self) -> list[str]:
        """The models this runtime serves: its own (a `ModelPool` serves several)."""
        return [self.config.model_name]

    def tokenizer_for(self, model: str | None):
        """The tokenizer of `model` (here always this runtime's own)."""
        return self._tokenizer

    def known_adapters(self) -> list[str]:
        """The names of the adapters known now (as of the last load or unload)."""
        return [a.name for a in self._adapters.list()]

    async def unload_adapter(self, name: str) -> None:
        """Forget an adapter. Raises `AdapterNotFoundError` for an unknown name and
        `InvalidRequestError` while live requests use it."""
        await self._adapter_call("unload", name=name)

    async def adapters(self) -> list[AdapterInfo]:
        """The adapters known, with their slots' state now (resident, users)."""
        return await self._adapter_call("list")

    async def _adapter_call(self, op: str, **fields) -> list[AdapterInfo]:
        self._check_open()
        try:
            result = await ask(self._model, AdapterCall, op=op, **fields)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
            raise RuntimeClosedError("the runtime is closed") from None
        if isinstance(result, Exception):
            raise result
        self._adapters.update(result)
        return result

    def _make_session(self, prepared: Prepared, events: EventChannel) -> SessionActor:
        admit, request = prepared.admit, prepared.request
        return SessionActor(
            request_id=admit.request_id,
            num_prompt_tokens=len(admit.prompt_ids),
            detokenizer=make_detokenizer(self._tokenizer),
            stop=list(request.stop),
            scheduler=self._scheduler.inbox,
            events=events,
            # A grammar writes the output from its first token, never inside a reasoning block the prompt opened.
            parser=self._output_parser(request, admit.prompt_ids if admit.grammar is None else ()),
            fill=prepared.fill_stats,
            spec=prepared.spec_stats,
            max_pause_s=self.config.scheduler.max_pause_s,
            observer=self._telemetry,
            stream_tool_calls=request.stream_tool_calls,
            report_progress=request.report_progress,
        )

    def _output_parser(self, request: GenerateRequest, prompt_ids: Sequence[int] = ()) -> StreamParser | None:
        """Reasoning split when the model has think markers; tool calls when the request has tools;
        both in the model family's own format when its template names one (policies/tool_formats.py)."""
        tokenizer, fmt = self._tokenizer, self._tool_format
        think = (tokenizer.think_start, tokenizer.think_end) if getattr(tokenizer, "has_thinking", False) else None
        calls = bool(request.tools) and request.tool_choice != "none"
        if fmt is not None and (fmt.family != "hermes" or self._tool_markers is None):
            fmt = fmt if fmt.think or think is None else replace(fmt, think=think)
            return make_parser(fmt, tools=request.tools if calls else None, in_reasoning=self._prompt_opens(prompt_ids, fmt.think))
        opens = self._prompt_opens(prompt_ids, think)
        tools = self._tool_markers if calls else None
        if think is None and tools is None:
            return None
        parser = tokenizer.tool_parser if tools is not None else None
        return OutputParser(think=think, tool_markers=tools, parse_call=(lambda body: parser(body, request.tools)) if parser else None, in_think=opens)

    def _prompt_opens(self, prompt_ids: Sequence[int], think: tuple[str, str] | None) -> bool:
        """Whether the prompt leaves a reasoning block open (a template that ends its generation
        prompt with the think marker), so the output starts inside it."""
        if think is None or not prompt_ids:
            return False
        return prompt_opens_reasoning(self._tokenizer.decode(list(prompt_ids[-16:])), think)

    async def shutdown(self) -> None:
        """Refuse new requests, cancel live ones and give their callers a moment to hear it.

        A caller that does not read its `Finished(cancelled)` within `SHUTDOWN_GRACE_S` gets
        the end of its stream instead (`RuntimeClosedError`); the runtime never waits longer.
        """
        self._closed = True
        await self._requests.wind_down(SHUTDOWN_GRACE_S)
        with anyio.move_on_after(SHUTDOWN_GRACE_S):
            # Pending checkpoint writes and deletes reach the disk before the actors stop.
            await ask(self._kv.inbox, DrainFiles)
        with anyio.move_on_after(SHUTDOWN_GRACE_S):
            await self._telemetry.close()  # the spans of the requests just ended


def _report_blas() -> None:
    status = blas.status()
    if status.warning():
        log.warning("slow_blas", state=status.state, message=status.warning())
    else:
        log.debug("blas", state=status.state, library=status.library)
    log.debug("malloc", allocator=allocator.name())


async def _start_model(config: RuntimeConfig, thread: MlxThread, tg) -> tuple[ModelActor, ModelReady]:
    """The model actor, once its model is loaded (progress shown on a terminal)."""
    progress = Progress("model", summary=config.logging.level in ("debug", "info"))
    limits = config.limits

    def make_grammars(tokenizer, info: ModelInfo) -> GrammarCache:
        return GrammarCache.for_model(tokenizer, info, limits)

    model = ModelActor(
        config.model,
        thread,
        builtin_root=env.home(),
        make_grammars=make_grammars,
        progress=progress,
        speculative=config.speculative,
        kv=config.kv,
        lora=config.lora,
        adapters=config.adapters,
        distributed=config.distributed,
        world_secret=env.world_secret(),
        denoise_share=config.scheduler.denoise_share,
        bulk_share=config.scheduler.bulk_share,
        pin_kernel_thread=config.scheduler.pin_kernel_thread,
    )
    try:
        ready: ModelReady = await tg.start(model.run)
    except BaseException:
        progress.clear()
        raise
    progress.done(f"{ready.info.model_type} {ready.info.num_parameters / 1e6:.1f}M params, {ready.info.dtype} on {ready.info.device}")
    return model, ready


async def _start_kv_store(config: RuntimeConfig, info: ModelInfo, model: Mailbox[ModelInbox], tg, *, checkpoints: bool) -> KvStoreActor:
    """The KV store: the ledger of the model's KV budget and prefix cache, and the checkpoint
    files (when the directory is usable)."""
    ledger = KvLedger(
        bytes_per_token=info.kv_bytes_per_token,
        layers=info.layers,
        budget_bytes=config.kv.budget_bytes,
        prefix_cache_bytes=config.kv.prefix_cache_bytes,
        prefix_min_tokens=config.kv.prefix_min_tokens,
    )
    store = (
        CheckpointStore(config.checkpoint_directory(), model_id=info.model_id, tokenizer_id=info.tokenizer_id, kv_format=checkpoint_format(info))
        if checkpoints
        else None
    )
    disk = await kv_files.open_tier(config.kv, info)
    kv = KvStoreActor(ledger, model=model, checkpoints=store, max_age_s=config.checkpoints.max_age_s, disk=disk)
    await tg.start(kv.run)
    return kv


async def _start_scheduler(config: RuntimeConfig, model: ModelActor, kv: Mailbox, adapters: AdapterRegistry, tg) -> SchedulerActor:
    s = config.scheduler
    policy = SchedulePolicy(
        max_batch_size=s.max_batch_size,
        max_queued=s.max_queued_requests,
        chunk_size=s.prefill_chunk_size,
        token_budget=config.step_token_budget,
        adapter_slots=AdapterSlots(config.lora.max_resident, adapters),
        bulk_share=s.bulk_share,
    )
    capacity = s.max_queued_requests + 2 * s.max_batch_size + 16
    scheduler = SchedulerActor(policy, model=model.inbox, kv=kv, capacity=capacity, start_step=model.start_step, run_ahead_below_s=s.run_ahead_below_s)
    await tg.start(scheduler.run)
    return scheduler
