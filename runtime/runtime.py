"""`Runtime`: the embedding API, and the supervisor of the actors behind it.

`Runtime.open(config)` starts, in order, the MLX thread, the model actor (which
loads the model), the KV store and the scheduler, in one task group: if any
actor fails, the group is cancelled and the error propagates out of `open`.
Each `generate` call validates and tokenizes its request, starts a session
actor, and streams that session's events; leaving the stream early cancels it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import structlog

from actors.kv_store import KvStoreActor
from actors.mailbox import EventChannel, ask
from actors.mlx_thread import MlxThread
from actors.model import ModelActor, ModelReady
from actors.scheduler import SchedulerActor
from actors.session import SessionActor
from policies.detokenize import make_detokenizer
from policies.ledger import KvLedger
from policies.output_parser import OutputParser
from policies.scheduling import SchedulePolicy
from protocols.api import Event, Finished, GenerateRequest
from protocols.errors import error_for
from protocols.kv import DrainFiles, GetKvStats, KvStats
from protocols.model import ModelInfo
from protocols.scheduler import AddRequest, CancelRequest, GetSchedulerStats, SchedulerStats
from protocols.session import RequestRejected
from runtime import blas, env
from runtime.admission import Admission, Prepared, checkpoint_directory_problem
from runtime.checkpoints import CheckpointStore
from runtime.config import RuntimeConfig
from runtime.errors import ConfigError, DuplicateRequestError, RuntimeClosedError, ServerBusyError, single_errors
from runtime.grammar import GrammarCache
from runtime.logging import configure_logging
from runtime.progress import Progress

log = structlog.get_logger(actor="runtime")

EVENT_BUFFER = 16
# Time live requests' callers get to receive their `Finished(cancelled)` at shutdown.
SHUTDOWN_GRACE_S = 2.0


@dataclass(frozen=True)
class RuntimeStats:
    scheduler: SchedulerStats
    kv: KvStats
    live_requests: int


class Runtime:
    """A model served to many concurrent callers. Create with `Runtime.open`."""

    def __init__(self, config: RuntimeConfig, ready: ModelReady, scheduler: SchedulerActor, kv: KvStoreActor, task_group, admission: Admission):
        self.config = config
        self.model_info: ModelInfo = ready.info
        self._tokenizer = ready.tokenizer
        tokenizer = ready.tokenizer
        self._tool_markers = (tokenizer.tool_call_start, tokenizer.tool_call_end) if getattr(tokenizer, "has_tool_calling", False) else None
        self._admission = admission
        self._scheduler = scheduler
        self._kv = kv
        self._task_group = task_group
        self._sessions: dict[str, SessionActor] = {}
        self._no_sessions = anyio.Event()
        self._no_sessions.set()
        self._closed = False
        # Requests still being tokenized, and cancels that arrived for them meanwhile.
        self._preparing: set[str] = set()
        self._early_cancels: set[str] = set()

    @classmethod
    @asynccontextmanager
    async def open(cls, config: RuntimeConfig) -> AsyncIterator[Runtime]:
        configure_logging(config.logging)
        _report_blas()
        thread = MlxThread()
        thread.start()
        try:
            with single_errors():
                async with anyio.create_task_group() as tg:
                    runtime = await cls._start_actors(config, thread, tg)
                    try:
                        yield runtime
                    finally:
                        with anyio.CancelScope(shield=True):
                            await runtime.shutdown()
                        tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await thread.stop()

    @classmethod
    async def _start_actors(cls, config: RuntimeConfig, thread: MlxThread, tg) -> Runtime:
        directory = config.checkpoint_directory()
        problem = await anyio.to_thread.run_sync(checkpoint_directory_problem, directory)
        if problem is not None:
            if config.checkpoints.every_tokens:
                raise ConfigError(f"`checkpoints.every_tokens` is set but {problem}")
            log.warning("checkpoints_unavailable", reason=problem)
        progress = Progress("model")
        limits = config.limits

        def make_grammars(tokenizer, info: ModelInfo) -> GrammarCache:
            return GrammarCache(
                tokenizer, info.vocab_size, info.eos_token_ids, max_bytes=limits.grammar_cache_bytes, timeout_s=limits.grammar_compile_timeout_s
            )

        model = ModelActor(config.model, thread, builtin_root=env.home(), make_grammars=make_grammars, progress=progress)
        ready: ModelReady = await tg.start(model.run)
        progress.done(f"{ready.info.model_type} {ready.info.num_parameters / 1e6:.1f}M params, {ready.info.dtype} on {ready.info.device}")
        ledger = KvLedger(
            bytes_per_token=ready.info.kv_bytes_per_token,
            budget_bytes=config.kv.budget_bytes,
            prefix_cache_bytes=config.kv.prefix_cache_bytes,
            prefix_min_tokens=config.kv.prefix_min_tokens,
        )
        info = ready.info
        store = None if problem is not None else CheckpointStore(directory, model_id=info.model_id, tokenizer_id=info.tokenizer_id)
        kv = KvStoreActor(ledger, model=model.inbox, checkpoints=store, max_age_s=config.checkpoints.max_age_s)
        await tg.start(kv.run)
        s = config.scheduler
        policy = SchedulePolicy(
            max_batch_size=s.max_batch_size,
            max_queued=s.max_queued_requests,
            chunk_size=s.prefill_chunk_size,
            token_budget=config.step_token_budget,
        )
        scheduler = SchedulerActor(policy, model=model.inbox, kv=kv.inbox, capacity=s.max_queued_requests + 2 * s.max_batch_size + 16)
        await tg.start(scheduler.run)
        admission = Admission(config, info, ready.tokenizer, ready.grammars, checkpoints_unavailable=problem)
        return cls(config, ready, scheduler, kv, tg, admission)

    @property
    def tokenizer(self):
        return self._tokenizer

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Stream a request's events: `TokenDelta`s (and `PrefillProgress` if asked), then one `Finished`.

        Raises `InvalidRequestError` for bad input, `ServerBusyError` when the
        queue is full, `RuntimeClosedError` during shutdown.
        """
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        async with self._claim(rid):
            self._check_open()
            prepared = await self._admission.prepare(request, rid)
            session, events = self._submit(prepared)
        async for event in self._stream(session, events):
            yield event

    async def resume(self, request_id: str) -> AsyncIterator[Event]:
        """Continue a checkpointed request: one `TokenDelta` re-delivering what it generated
        before the checkpoint, then the continuation, then `Finished`.

        Raises a `CheckpointError` subclass when there is no usable checkpoint.
        """
        async with self._claim(request_id):
            self._check_open()
            prepared = await self._admission.prepare_resume(request_id)
            session, events = self._submit(prepared)
        async for event in self._stream(session, events):
            yield event

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError("the runtime is shutting down")

    @asynccontextmanager
    async def _claim(self, request_id: str):
        """Hold `request_id` while a request is prepared; a cancel meanwhile applies once it starts."""
        if request_id in self._sessions or request_id in self._preparing:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in use")
        self._preparing.add(request_id)
        try:
            yield
        finally:
            self._preparing.discard(request_id)
            cancelled_early = request_id in self._early_cancels
            self._early_cancels.discard(request_id)
        if cancelled_early and request_id in self._sessions:
            self._task_group.start_soon(self._cancel_session, self._sessions[request_id])

    async def _stream(self, session: SessionActor, events) -> AsyncIterator[Event]:
        finished = False
        try:
            async with events:
                async for event in events:
                    if isinstance(event, RequestRejected):
                        finished = True
                        raise _rejection_error(event)
                    # Before yielding: a caller may stop at Finished and never resume us.
                    finished = isinstance(event, Finished)
                    yield event
                    if finished:
                        return
            finished = True  # the session was abandoned at shutdown: nothing left to cancel
            raise RuntimeClosedError("the runtime shut down before the request finished")
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await self._cancel_session(session)

    async def cancel(self, request_id: str) -> None:
        """End a request at the next step boundary; its stream ends with `Finished(cancelled)`."""
        if request_id in self._sessions:
            await self._cancel_session(self._sessions[request_id])
        elif request_id in self._preparing:
            self._early_cancels.add(request_id)

    async def _cancel_session(self, session: SessionActor) -> None:
        # Only while that very session is live: its id may already belong to a newer request.
        if self._sessions.get(session.request_id) is session:
            await self._scheduler.inbox.send(CancelRequest(request_id=session.request_id))

    async def stats(self) -> RuntimeStats:
        try:
            scheduler = await ask(self._scheduler.inbox, GetSchedulerStats)
            kv = await ask(self._kv.inbox, GetKvStats)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
            raise RuntimeClosedError("the runtime is closed") from None
        return RuntimeStats(scheduler=scheduler, kv=kv, live_requests=len(self._sessions))

    def _submit(self, prepared: Prepared):
        """Start the request's session and hand the request to the scheduler; returns both ends."""
        admit, request = prepared.admit, prepared.request
        rid = admit.request_id
        send = receive = EventChannel[Event | RequestRejected](EVENT_BUFFER)
        session = SessionActor(
            request_id=rid,
            num_prompt_tokens=len(admit.prompt_ids),
            detokenizer=make_detokenizer(self._tokenizer),
            stop=list(request.stop),
            scheduler=self._scheduler.inbox,
            events=send,
            parser=self._output_parser(request),
            fill=prepared.fill_stats,
            max_pause_s=self.config.scheduler.max_pause_s,
        )
        message = AddRequest(
            admit=admit,
            submitted=time.monotonic(),
            session=session.inbox,
            request=request,
            priority=request.priority,
            report_progress=request.report_progress,
            checkpoint_every=prepared.checkpoint_every,
        )
        try:
            self._scheduler.inbox.send_nowait(message)
        except anyio.WouldBlock:
            self._admission.release(prepared)
            raise ServerBusyError("the scheduler's inbox is full") from None
        self._sessions[rid] = session
        self._no_sessions = anyio.Event()
        self._task_group.start_soon(self._run_session, session, prepared, name=f"session-{rid}")
        return session, receive

    def _output_parser(self, request: GenerateRequest) -> OutputParser | None:
        """Reasoning split when the model has think markers; tool calls when the request has tools."""
        tokenizer = self._tokenizer
        think = (tokenizer.think_start, tokenizer.think_end) if getattr(tokenizer, "has_thinking", False) else None
        tools = self._tool_markers if request.tools and request.tool_choice != "none" else None
        if think is None and tools is None:
            return None
        parser = tokenizer.tool_parser if tools is not None else None
        return OutputParser(think=think, tool_markers=tools, parse_call=(lambda body: parser(body, request.tools)) if parser else None)

    async def _run_session(self, session: SessionActor, prepared: Prepared) -> None:
        with structlog.contextvars.bound_contextvars(request_id=session.request_id):
            try:
                await session.run()
            finally:
                if self._sessions.get(session.request_id) is session:
                    del self._sessions[session.request_id]
                if not self._sessions:
                    self._no_sessions.set()
                self._admission.release(prepared)

    async def shutdown(self) -> None:
        """Refuse new requests, cancel live ones and give their callers a moment to hear it.

        A caller that does not read its `Finished(cancelled)` within `SHUTDOWN_GRACE_S` gets
        the end of its stream instead (`RuntimeClosedError`); the runtime never waits longer.
        """
        self._closed = True
        for rid in list(self._sessions):
            await self._scheduler.inbox.send(CancelRequest(request_id=rid, keep_checkpoint=True))
        with anyio.move_on_after(SHUTDOWN_GRACE_S):
            await self._no_sessions.wait()
        for session in list(self._sessions.values()):
            session.abandon()
        with anyio.move_on_after(SHUTDOWN_GRACE_S):
            await self._no_sessions.wait()
            # Pending checkpoint writes and deletes reach the disk before the actors stop.
            await ask(self._kv.inbox, DrainFiles)


def _report_blas() -> None:
    status = blas.status()
    if status.warning():
        log.warning("slow_blas", state=status.state, message=status.warning())
    else:
        log.debug("blas", state=status.state, library=status.library)


def _rejection_error(event: RequestRejected) -> Exception:
    return error_for(event.code, event.message, event.field)
