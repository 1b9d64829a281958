"""Admission: every request is prepared here, once, before it reaches the scheduler.

`Admission.prepare` turns a `GenerateRequest` into what the engine runs (`AdmitRequest`):
validation against the model and `[limits]`, the prompt rendered and tokenized (refused
by size first), max_tokens fitted to the context, the seed, stop ids, the grammar
(compiled and pinned), jump-forward, the fast-forward plan, bad words as token ids and the
checkpoint cadence.
`prepare_resume` does the same from a checkpoint file, re-validating everything it holds.

Any failure is that request's typed error (`InvalidRequestError` naming the field when the
caller is at fault, `InternalError` otherwise, logged); nothing escapes to the runtime's
task group. Blocking work runs in worker threads, never on the event loop.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import msgspec
import structlog

from policies import features
from policies import fill_plan as fill
from policies import images as image_prompts
from policies import validation as requests
from policies.adapters import AdapterRegistry
from policies.layout import checkpoint_format
from protocols.api import FillStats, GenerateRequest, SpecStats
from protocols.model import AdmitRequest, GrammarSpec, ModelInfo, ResumeState, VisionPrompt
from runtime import checkpoints, offload, remote_images
from runtime.config import RuntimeConfig
from runtime.errors import (
    AdapterNotFoundError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    InternalError,
    InvalidRequestError,
    MlxrtError,
    ModelNotFoundError,
    ServerBusyError,
)
from runtime.grammar import GrammarCache, grammar_spec, model_tool_markers


def render_prompt(tokenizer: Any, request: GenerateRequest, max_bytes: int) -> list[int]:
    """(A worker thread or process: `runtime.offload`) the prompt's ids."""
    return requests.render_prompt(request, tokenizer, max_bytes)


log = structlog.get_logger(actor="admission")

T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """A request ready for the scheduler, and what its session needs."""

    admit: AdmitRequest
    request: GenerateRequest
    checkpoint_every: int
    fill_stats: FillStats | None = None
    spec_stats: SpecStats | None = None
    # Pinned in the grammar cache until the request ends (`Admission.release`).
    grammar: GrammarSpec | None = None


class Admission:
    def __init__(
        self,
        config: RuntimeConfig,
        info: ModelInfo,
        tokenizer,
        grammars: GrammarCache,
        *,
        checkpoints_unavailable: str | None = None,
        adapters: AdapterRegistry | None = None,
    ):
        self._config = config
        self._adapters = adapters or AdapterRegistry()
        self._info = info
        self._tokenizer = tokenizer
        self._grammars = grammars
        self._checkpoint_dir = config.checkpoint_directory()
        self._checkpoints_unavailable = checkpoints_unavailable
        self._seeds = random.Random(config.generation.seed)
        self._eos_ids = list(info.eos_token_ids)
        self._tool_markers = model_tool_markers(tokenizer)
        self._max_prompt_bytes = requests.max_prompt_bytes(info, config.limits)
        self._max_checkpoint_bytes = checkpoints.max_file_bytes(info.max_context, info.layers)
        # Requests being prepared at once (tokenizing, compiling): beyond this, busy.
        self._preparing = anyio.Semaphore(config.scheduler.max_queued_requests)
        # Remote image fetches run in threads of their own: a slow host never holds the render threads.
        self._image_fetches = anyio.CapacityLimiter(config.server.remote_image_max_fetches)
        self._image_fetch_settings = remote_images.fetch_settings(config.server)

    async def prepare(self, request: GenerateRequest, request_id: str) -> Prepared:
        """Raises `MlxrtError`s only."""
        return await self._contained(self._prepare(request, request_id), request_id)

    async def prepare_resume(self, request_id: str) -> Prepared:
        """A checkpointed request, checked as thoroughly as a new one. Raises `MlxrtError`s only."""
        return await self._contained(self._prepare_resume(request_id), request_id)

    async def prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        """The tokens `prepare` renders the request's prompt into (checked as it would be,
        rendered and tokenized in a worker thread). Raises `MlxrtError`s only."""
        return await self._contained(self._render(request), request.request_id or "render")

    def release(self, prepared: Prepared) -> None:
        """The request has ended: its grammar may be evicted."""
        if prepared.grammar is not None:
            self._grammars.release(prepared.grammar)

    async def _contained(self, preparing: Coroutine[Any, Any, T], request_id: str) -> T:
        try:
            self._preparing.acquire_nowait()
        except anyio.WouldBlock:
            preparing.close()
            raise ServerBusyError("too many requests are being prepared; retry later") from None
        try:
            return await preparing
        except MlxrtError:
            raise
        except Exception as exc:
            log.exception("prepare_failed", request_id=request_id)
            raise InternalError(f"the request could not be prepared ({type(exc).__name__}); the server log has the details") from None
        finally:
            self._preparing.release()

    async def _render(self, request: GenerateRequest) -> list[int]:
        self._check(request)
        grammar_spec(request, self._tool_markers)  # its shape checked too (not compiled)
        return (await self._render_prompt(request))[0]

    async def _render_prompt(self, request: GenerateRequest) -> tuple[list[int], VisionPrompt | None]:
        """The prompt's ids (rendered and tokenized in a worker thread); an image prompt's also
        through the model's processor, with what the vision tower reads."""
        if not image_prompts.has_images(request.messages):
            size = offload.text_size(request.prompt, request.messages, request.tools)
            min_size = self._config.scheduler.bulk_tokenize_bytes
            return await offload.run(self._tokenizer, render_prompt, request, self._max_prompt_bytes, size=size, min_size=min_size), None
        if request.truncate_prompt_tokens:
            raise InvalidRequestError("truncate_prompt_tokens cannot cut an image prompt", field="truncate_prompt_tokens")
        assert request.messages is not None
        fetch = None
        if self._config.server.allow_remote_images:
            fetch = await remote_images.prefetch(request.messages, self._config.limits, self._image_fetch_settings, self._image_fetches)
        render_images = functools.partial(
            image_prompts.render_image_prompt,
            request.messages,
            request.tools,
            self._tokenizer,
            self._info.vocab_size,
            self._max_prompt_bytes,
            self._config.limits,
            fetch,
        )
        rendered = await anyio.to_thread.run_sync(render_images)
        return rendered.prompt_ids, VisionPrompt(arrays=rendered.arrays, digests=rendered.digests, key_ids=rendered.key_ids)

    def _check(self, request: GenerateRequest) -> None:
        config = self._config
        requests.validate(request, self._info, config.limits)
        if request.model is not None and request.model != config.model_name:
            raise ModelNotFoundError(f"no model named {request.model!r}; this runtime serves {config.model_name!r}", field="model")

    async def _prepare(self, request: GenerateRequest, request_id: str) -> Prepared:
        config, info = self._config, self._info
        self._check(request)
        checkpoint_every = self.checkpoint_every(request) if not info.denoising else 0
        if checkpoint_every and await anyio.to_thread.run_sync(self._names_foreign_checkpoint, request_id, request):
            # That file is another request's (a crashed one, to be resumed): never overwritten or deleted.
            raise InvalidRequestError(f"a checkpoint of another request {request_id!r} exists: resume it, or choose another request_id", field="request_id")
        grammar = grammar_spec(request, self._tool_markers)
        fill_mode = fill.resolve_mode(request, config.generation.fill) if not info.denoising else "off"
        prompt_ids, vision = await self._render_prompt(request)
        max_tokens = requests.effective_max_tokens(request, len(prompt_ids), info, config.generation.default_max_tokens)
        stop_ids = sorted(set(() if request.ignore_eos else self._eos_ids) | set(request.stop_token_ids))
        seed = request.sampling.seed if request.sampling.seed is not None else self._seeds.getrandbits(63)
        admit = AdmitRequest(
            request_id=request_id,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=request.sampling,
            seed=seed,
            stop_token_ids=stop_ids,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
            save_prefix=self._config.kv.prefix_cache_bytes > 0 and not info.denoising,
            # The last prompt token is never prefilled; a snapshot there is the end-of-request entry.
            snapshot_at=request.snapshot_at if request.snapshot_at and request.snapshot_at < len(prompt_ids) - 1 else None,
            adapter=request.adapter,
            adapter_digest=self._adapter_digest(request.adapter),
            vision=vision,
            denoise=features.denoising_options(request, info),
        )
        return await self._with_features(Prepared(admit=admit, request=request, checkpoint_every=checkpoint_every), grammar, fill_mode)

    async def _with_features(self, prepared: Prepared, grammar: GrammarSpec | None, fill_mode: str) -> Prepared:
        """Add the grammar (compiled and pinned: bad grammars are refused before any compute),
        jump-forward, the fast-forwarding plan and the bad words' token ids; the grammar is
        released if this fails."""
        request, admit, config = prepared.request, prepared.admit, self._config
        distributed = bool(config.distributed.backend)
        spec_plan, spec_stats = features.speculation(request, config.speculative, denoising=admit.denoise is not None, grammar=grammar, distributed=distributed)
        if grammar is not None:
            await self._grammars.acquire(grammar)
        words = request.sampling.bad_words
        try:
            fill_plan, fill_stats = await self._fill_plan(request, fill_mode, grammar, admit.prompt_ids, admit.stop_token_ids)
            # Bad words as token sequences, tokenized once here (off the event loop).
            bad_words_ids = await anyio.to_thread.run_sync(requests.bad_words_ids, words, self._tokenizer) if words else []
        except BaseException:
            if grammar is not None:
                self._grammars.release(grammar)
            raise
        jump_forward = features.jump_forward(request, grammar, fill_plan, config.generation.jump_forward)
        admit = msgspec.structs.replace(admit, grammar=grammar, jump_forward=jump_forward, fill=fill_plan, spec=spec_plan, bad_words_ids=bad_words_ids)
        return Prepared(admit=admit, request=request, checkpoint_every=prepared.checkpoint_every, fill_stats=fill_stats, spec_stats=spec_stats, grammar=grammar)

    async def _fill_plan(self, request: GenerateRequest, mode: str, grammar: GrammarSpec | None, prompt_ids: list[int], stop_ids: list[int]):
        """The request's fast-forwarding plan and initial stats; (None, None) when it is off."""
        if mode == "off":
            return None, None
        if reason := fill.refusal(request, grammar.kind if grammar else None):
            return None, FillStats(mode=mode, refused=reason)
        g = self._config.generation
        compile_plan = functools.partial(
            fill.compile_plan,
            request,
            mode,
            self._tokenizer,
            prompt_ids,
            stop_ids,
            max_span=g.fill_max_span,
            echo_k=g.fill_echo_k,
            trace_path=g.fill_trace or None,
        )
        return await anyio.to_thread.run_sync(compile_plan)

    def checkpoint_every(self, request: GenerateRequest) -> int:
        every = request.checkpoint_every if request.checkpoint_every is not None else self._config.checkpoints.every_tokens
        if not every:
            return 0
        if request.request_id is None:
            raise InvalidRequestError("checkpoints need a request_id to resume by", field="request_id")
        requests.check_request_id(request.request_id)
        if self._checkpoints_unavailable is not None:
            raise InvalidRequestError(f"checkpoints are unavailable: {self._checkpoints_unavailable}", field="checkpoint_every")
        return every

    async def _prepare_resume(self, request_id: str) -> Prepared:
        """A checkpointed request with everything it had: its grammar and fast-forwarding are
        rebuilt from the request, and the engine replays its output through both."""
        requests.check_request_id(request_id)
        header, tensors = await anyio.to_thread.run_sync(self._read_checkpoint, request_id)
        request = header.request
        try:
            self._check_header(header)
            grammar = grammar_spec(request, self._tool_markers)
            fill_mode = fill.resolve_mode(request, self._config.generation.fill)
        except InvalidRequestError as exc:
            raise CorruptCheckpointError(f"checkpoint of {request_id!r} holds an invalid request: {exc}") from None
        admit = AdmitRequest(
            request_id=request_id,
            prompt_ids=header.prompt_ids,
            max_tokens=header.max_tokens,
            sampling=request.sampling,
            seed=header.seed,
            stop_token_ids=header.stop_token_ids,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            save_prefix=self._config.kv.prefix_cache_bytes > 0,
            resume=ResumeState(generated=header.generated, num_kv_tokens=header.num_kv_tokens, kv_tensors=tensors),
            adapter=request.adapter,
            adapter_digest=self._resume_adapter(header, request_id),
            # An image prompt resumes from its KV (the images are in it): no pixels, its cache keys.
            vision=VisionPrompt(arrays={}, digests=header.image_digests, key_ids=header.key_ids, position_shift=header.position_shift)
            if header.key_ids is not None
            else None,
        )
        prepared = Prepared(admit=admit, request=request, checkpoint_every=self.checkpoint_every(request))
        return await self._with_features(prepared, grammar, fill_mode)

    def _adapter_digest(self, name: str | None) -> str:
        """The digest a request's adapter is admitted with ("" for none)."""
        if name is None:
            return ""
        info = self._adapters.get(name)
        if info is None:
            raise AdapterNotFoundError(f"no adapter named {name!r} (load it first, or list it in [[adapters]])", field="adapter")
        return info.digest

    def _resume_adapter(self, header: checkpoints.CheckpointHeader, request_id: str) -> str:
        """A checkpoint's KV belongs to the adapter it was computed under: the same weights."""
        name = header.request.adapter
        info = self._adapters.get(name) if name is not None else None
        digest = "" if name is None else info.digest if info is not None else None
        if digest != header.adapter_digest:
            what = f"adapter {name!r} ({header.adapter_digest})" if name is not None else "no adapter"
            now = "is not loaded" if digest is None else f"is now {digest or 'none'}"
            raise ForeignCheckpointError(f"checkpoint of {request_id!r} was written with {what}, which {now}")
        return header.adapter_digest

    def _names_foreign_checkpoint(self, request_id: str, request: GenerateRequest) -> bool:
        """Whether a checkpoint file of `request_id` exists that is not this same request's
        (a pool generating a preempted request again writes over its own; blocking)."""
        return checkpoints.path_for(self._checkpoint_dir, request_id).exists() and self.checkpointed_request(request_id) != request

    def checkpointed_request(self, request_id: str) -> GenerateRequest | None:
        """The request a readable checkpoint of `request_id` holds, or None (blocking)."""
        try:
            return self._read_checkpoint(request_id)[0].request
        except MlxrtError:
            return None

    def _read_checkpoint(self, request_id: str):
        """A checkpoint this model can resume, its tensors checked against the model (blocking)."""
        info = self._info
        try:
            header, tensors = checkpoints.read(
                self._checkpoint_dir,
                request_id,
                model_id=info.model_id,
                tokenizer_id=info.tokenizer_id,
                max_bytes=self._max_checkpoint_bytes,
                kv_format=checkpoint_format(info),
            )
        except (OSError, RecursionError, ValueError) as exc:
            raise CorruptCheckpointError(f"checkpoint of {request_id!r} cannot be read: {type(exc).__name__}") from None
        checkpoints.check_tensors(header, tensors, info.layers)
        return header, tensors

    def _check_header(self, header: checkpoints.CheckpointHeader) -> None:
        """Every value a checkpoint holds, checked as a new request's would be."""
        info = self._info
        requests.validate(header.request, info, self._config.limits)
        for field in ("prompt_ids", "generated", "stop_token_ids"):
            requests.check_ids(getattr(header, field), info.vocab_size, field)
        if not header.prompt_ids or not 1 <= len(header.generated) < header.max_tokens:
            raise InvalidRequestError("generated tokens must be at least one and fewer than max_tokens", field="max_tokens")
        if len(header.prompt_ids) + header.max_tokens > info.max_context:
            raise InvalidRequestError(f"prompt + max_tokens exceeds the context of {info.max_context}", field="max_tokens")
        if not 0 <= header.seed <= requests.MAX_SEED:
            raise InvalidRequestError("seed out of range", field="seed")
        if header.key_ids is not None:  # an image prompt's keys: its ids but at the images
            keys_ok = len(header.key_ids) == len(header.prompt_ids) and header.image_digests
            if not keys_ok or any(k != t and k < info.vocab_size for k, t in zip(header.key_ids, header.prompt_ids)):
                raise InvalidRequestError("an image prompt's cache keys do not match its prompt", field="key_ids")


def checkpoint_directory_problem(directory: Path) -> str | None:
    """Why checkpoints cannot be written to `directory` (blocking), or None when they can."""
    try:
        checkpoints.prepare_directory(directory)
    except checkpoints.CheckpointDirError as exc:
        return str(exc)
    return None
