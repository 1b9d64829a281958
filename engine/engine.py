"""The engine: executes the scheduler's step plans on the MLX thread.

Owns every per-request array: prefill caches (mlx-lm `KVCache`s, chunk by chunk,
first chunks of several requests batched), the decode batch's KV slots, the batch
sampler state, the in-flight step, saved prefix entries, and parked rows. A plan
is applied in order: release, admit, park/unpark, prefill, decode, checkpoints.
Decode is pipelined like mlx-lm's `generate_step`: step n+1 is
dispatched (`mx.async_eval`) before step n's tokens are read back, so the only
host round-trip per step is one `tolist()` of already-computed ids.

A prompt's last token is not prefilled: the request joins the batch with it as
its pending input, and the batched decode step computes the logits of that one
position only. Every call returns plain Python data.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
import safetensors.numpy
import structlog
import torch
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from engine.batch import DecodeBatch, LayerGeometry, compile_decode_step
from engine.sampler import BatchSampler, RowSampling, SampleResult
from policies.fill import FillSession, Proposal, trace_record
from protocols.api import FillStats, TokenLogprob, TopLogprob
from protocols.model import (
    AdmitRequest,
    CheckpointData,
    GrammarSpec,
    PrefillReport,
    PrefillWork,
    RowOutput,
    SavedPrefix,
    StepOutcome,
    StepPlan,
)

CLEAR_CACHE_EVERY = 256

log = structlog.get_logger(actor="engine")


class Grammars(Protocol):
    """What the engine needs of the grammar compiler: matchers for grammars compiled (and
    pinned) before their requests were admitted. It never compiles on the MLX thread."""

    vocab_size: int

    def matcher(self, spec: GrammarSpec) -> Any: ...


class EngineInvariantError(RuntimeError):
    """A plan asked for something the engine's state makes impossible (a scheduler bug)."""


@dataclass
class Sequence:
    """One admitted request's engine-side state."""

    admit: AdmitRequest
    stop_ids: frozenset[int]
    cache: list | None = None
    num_prefilled: int = 0
    num_generated: int = 0
    in_batch: bool = False
    joined: bool = False
    # Its caller is not reading: kept out of the batch (KV in `cache`) until unparked.
    parked: bool = False
    # Grammar state, and known tokens after the last sampled one (fed with it next step):
    # grammar-forced or fast-forwarded ones, already emitted, or an echo span to verify.
    matcher: Any = None
    extra: list[int] = field(default_factory=list)
    fill: FillSession | None = None
    verify: Proposal | None = None
    # A strict span whose model choices the trace wants from the next step.
    trace: Proposal | None = None
    generated: list[int] = field(default_factory=list)

    def tokens_with_kv(self, length: int) -> list[int]:
        """The tokens whose KV the first `length` cache positions hold."""
        tokens = self.admit.prompt_ids + self.generated
        if length > len(tokens):
            raise EngineInvariantError(f"cache of {length} positions but only {len(tokens)} tokens known")
        return tokens[:length]

    @property
    def prompt_len(self) -> int:
        return len(self.admit.prompt_ids)

    @property
    def context(self) -> list[int]:
        """Prompt and generated tokens; the last one is the next decode input until the row joins."""
        return self.admit.prompt_ids + self.generated

    @property
    def is_ready(self) -> bool:
        """Prefill is done: the cache covers the prompt but its last token (more, after a park)."""
        return not self.joined and not self.parked and self.prompt_len - 1 <= self.num_prefilled <= len(self.context) - 1


@dataclass
class InFlight:
    """A dispatched decode step whose tokens have not been read yet.

    Rows are the `Sequence` objects themselves, not ids: a request id may be
    reused once its request has ended, and a stale token must not reach the new one.
    """

    rows: list[Sequence]
    result: SampleResult
    # Rows that appended known tokens first, with each position's greedy choice, and the
    # echo rows among them with how many of their span's tokens the model agreed with.
    appended: list[Sequence] = field(default_factory=list)
    choices: mx.array | None = None
    verified: list[Sequence] = field(default_factory=list)
    accepted: mx.array | None = None


class Engine:
    """Runs plans against one model. Not thread-safe: the MLX thread only."""

    def __init__(self, model, geometry: list[LayerGeometry], grammars: Grammars | None = None, decode=None):
        self._model = model
        self._grammars = grammars
        # Token ids to text, for fast-forwarding's tool-call context and trace.
        self._to_text = decode
        self._geometry = geometry
        self._bytes_per_token = sum(g.bytes_per_token for g in geometry)
        self._thread = threading.current_thread()
        self._sequences: dict[str, Sequence] = {}
        self._batch = DecodeBatch(geometry)
        self._decode_step = compile_decode_step(model, len(geometry))
        self._sampler = BatchSampler()
        self._pending: mx.array | None = None
        self._in_flight: InFlight | None = None
        self._num_steps = 0
        # Tokens appended by jump-forward rather than sampled (for benchmarks and stats).
        self.num_forced_tokens = 0
        # Saved prefixes by entry id: per-layer KVCaches whose length is the entry's.
        self._prefixes: dict[str, list[KVCache]] = {}
        self._saved: list[SavedPrefix] = []
        self._num_saved = 0
        self._prefix_bytes = 0

    def step(self, plan: StepPlan) -> StepOutcome:
        """Apply one plan; see the module docstring for the order."""
        if threading.current_thread() is not self._thread:
            raise EngineInvariantError("the engine was called off its MLX thread")
        started = time.perf_counter()
        released = [rid for rid in plan.release if self._release(rid)]
        for admit in plan.admit:
            self._admit(admit)
        for rid in plan.park:
            self._park(rid)
        for rid in plan.unpark:
            if rid in self._sequences:
                self._sequences[rid].parked = False
        prefilled = self._prefill(plan.prefill)
        # After a prefill the pipeline has stalled anyway: read this step's tokens
        # now, so requests that just joined get their first token one step sooner.
        outputs = self._decode(synchronous=bool(prefilled)) if plan.decode else []
        checkpoints = [c for c in map(self._checkpoint_or_skip, plan.checkpoint) if c is not None]
        if not self._sequences:
            mx.clear_cache()
        saved, self._saved = self._saved, []
        return StepOutcome(
            outputs=outputs,
            prefilled=prefilled,
            released=released,
            num_decode_rows=len(self._batch),
            kv_tokens=self.kv_tokens(),
            kv_bytes=self.kv_bytes(),
            step_s=time.perf_counter() - started,
            saved_prefixes=saved,
            checkpoints=checkpoints,
        )

    def drop_prefixes(self, entry_ids: list[str]) -> None:
        for entry_id in entry_ids:
            caches = self._prefixes.pop(entry_id, None)
            if caches is not None:
                self._prefix_bytes -= sum(c.nbytes for c in caches)

    def reset(self) -> list[str]:
        """Drop every request (after a failed step); returns the ids dropped."""
        dropped = list(self._sequences)
        self._sequences.clear()
        self._batch = DecodeBatch(self._geometry)
        self._sampler = BatchSampler()
        self._pending = None
        self._in_flight = None
        mx.clear_cache()
        return dropped

    def kv_tokens(self) -> dict[str, int]:
        tokens = {rid: seq.num_prefilled for rid, seq in self._sequences.items() if seq.cache is not None}
        tokens.update(zip(self._batch.row_ids, self._batch.lengths))
        return tokens

    def kv_bytes(self) -> int:
        prefill = sum(c.nbytes for s in self._sequences.values() if s.cache is not None for c in s.cache)
        return prefill + self._prefix_bytes + self._batch.nbytes

    @property
    def bytes_per_token(self) -> int:
        return self._bytes_per_token

    def _admit(self, admit: AdmitRequest) -> None:
        if admit.request_id in self._sequences:
            raise EngineInvariantError(f"request {admit.request_id!r} admitted twice")
        seq = Sequence(admit=admit, stop_ids=frozenset(admit.stop_token_ids))
        if admit.grammar is not None:
            if self._grammars is None:
                raise EngineInvariantError("a grammar request reached an engine without grammars")
            seq.matcher = self._grammars.matcher(admit.grammar)
        if admit.fill is not None:
            if self._to_text is None:
                raise EngineInvariantError("a fast-forwarding request reached an engine without a tokenizer")
            stats = FillStats(mode=admit.fill.mode, echo_refused=admit.fill.echo_refused)
            seq.fill = FillSession(admit.fill, stats, admit.context_ids, self._to_text)
        if admit.resume is not None:
            seq.generated = list(admit.resume.generated)
            seq.num_generated = len(seq.generated)
            seq.cache = self._restore(admit)
            seq.num_prefilled = admit.resume.num_kv_tokens
        elif admit.prefix_entry is not None:
            seq.cache = self._start_from_prefix(admit)
            seq.num_prefilled = admit.prefix_tokens
        self._sequences[admit.request_id] = seq

    def _start_from_prefix(self, admit: AdmitRequest) -> list[KVCache]:
        """Caches that read the entry's first tokens without copying them.

        Each cache gets its own array objects (slices): `a[...] = b` rebinds the
        array object `a` in place, so sharing the entry's objects would let a
        request's writes leak into the entry. The slices end exactly at the prefix,
        so the first write reallocates and the entry's buffers are never touched.
        """
        entry = self._prefixes.get(admit.prefix_entry)
        n = admit.prefix_tokens
        if entry is None or not 0 < n <= min(entry[0].offset, len(admit.prompt_ids) - 1):
            raise EngineInvariantError(f"prefix {admit.prefix_entry!r} cannot seed {n} tokens")
        caches = []
        for saved in entry:
            cache = KVCache()
            cache.keys, cache.values, cache.offset = saved.keys[..., :n, :], saved.values[..., :n, :], n
            caches.append(cache)
        return caches

    def _restore(self, admit: AdmitRequest) -> list[KVCache]:
        state = admit.resume
        if state.num_kv_tokens != len(admit.context_ids) - 1:
            raise EngineInvariantError(f"checkpoint covers {state.num_kv_tokens} tokens, expected {len(admit.context_ids) - 1}")
        tensors = safetensors.numpy.load(state.kv_tensors)
        caches = []
        for layer, geometry in enumerate(self._geometry):
            cache = KVCache()
            cache.keys = mx.array(tensors[f"keys_{layer}"]).astype(geometry.dtype)
            cache.values = mx.array(tensors[f"values_{layer}"]).astype(geometry.dtype)
            cache.offset = state.num_kv_tokens
            if cache.keys.shape != (1, geometry.num_heads, state.num_kv_tokens, geometry.key_dim):
                raise EngineInvariantError(f"checkpoint layer {layer} has shape {cache.keys.shape}")
            caches.append(cache)
        return caches

    def _checkpoint_or_skip(self, request_id: str) -> CheckpointData | None:
        """A failed capture skips that checkpoint; it must not fail the step for everyone."""
        try:
            return self._checkpoint(request_id)
        except Exception:
            log.exception("checkpoint_failed", request_id=request_id)
            return None

    def _checkpoint(self, request_id: str) -> CheckpointData | None:
        """The request's cache over all tokens but its last, which becomes the pending input."""
        seq = self._sequences.get(request_id)
        if seq is None or not seq.in_batch or not seq.generated or seq.extra:
            return None  # (forced tokens not yet fed: the next step's checkpoint covers them)
        num_kv = len(seq.context) - 1
        tensors = {}
        # Stored as float32: numpy has no bfloat16, and the widening is exact (restore narrows back).
        for layer, cache in enumerate(self._batch.extract(request_id)):
            tensors[f"keys_{layer}"] = np.array(cache.keys[..., :num_kv, :].astype(mx.float32))
            tensors[f"values_{layer}"] = np.array(cache.values[..., :num_kv, :].astype(mx.float32))
        return CheckpointData(request_id=request_id, generated=list(seq.generated), num_kv_tokens=num_kv, kv_tensors=safetensors.numpy.save(tensors))

    def _park(self, request_id: str) -> None:
        """Take a row out of the batch, keeping its KV; it rejoins once unparked."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return
        seq.parked = True
        if seq.verify is not None:  # an echo span not yet forwarded: offered again later, maybe
            seq.fill.commit(seq.verify, 0)
            seq.verify, seq.extra = None, []
        if seq.in_batch:
            seq.cache = self._batch.extract(request_id)
            seq.num_prefilled = seq.cache[0].offset
            self._remove_row(request_id)
            seq.joined = False

    def _release(self, request_id: str) -> bool:
        seq = self._sequences.get(request_id)
        if seq is None:
            return False
        if seq.in_batch:
            self._leave_batch(request_id)
        elif seq.cache is not None and seq.num_prefilled:
            self._save_prefix(seq, [_trimmed(c, seq.num_prefilled) for c in seq.cache])
        del self._sequences[request_id]
        return True

    def _save_prefix(self, seq: Sequence, caches: list[KVCache]) -> None:
        if not seq.admit.save_prefix:
            return
        self._num_saved += 1
        entry_id = f"{seq.admit.request_id}#{self._num_saved}"
        self._prefixes[entry_id] = caches
        num_bytes = sum(c.nbytes for c in caches)
        self._prefix_bytes += num_bytes
        self._saved.append(SavedPrefix(entry_id=entry_id, tokens=seq.tokens_with_kv(caches[0].offset), num_bytes=num_bytes))

    def _prefill(self, works: list[PrefillWork]) -> list[PrefillReport]:
        """Forward prompt chunks. First chunks go through one left-padded batched
        forward; later chunks extend their request's own cache one at a time."""
        seqs = [self._prefill_target(work) for work in works]
        first = [(s, w.num_tokens) for s, w in zip(seqs, works) if s.num_prefilled == 0]
        if len(first) < 2:
            first = []
        batched = {id(s) for s, _ in first}
        for seq, work in zip(seqs, works):
            if id(seq) not in batched:
                self._prefill_one(seq, work.num_tokens)
        if first:
            self._prefill_together(first)
        for seq in seqs:
            if seq.admit.snapshot_at is not None and seq.num_prefilled == seq.admit.snapshot_at:
                self._save_prefix(seq, [_trimmed(c, seq.num_prefilled) for c in seq.cache])
        return [PrefillReport(request_id=s.admit.request_id, processed_tokens=s.num_prefilled, total_tokens=s.prompt_len) for s in seqs]

    def _prefill_target(self, work: PrefillWork) -> Sequence:
        seq = self._sequences.get(work.request_id)
        if seq is None:
            raise EngineInvariantError(f"prefill for unknown request {work.request_id!r}")
        end = seq.num_prefilled + work.num_tokens
        if work.num_tokens <= 0 or end > seq.prompt_len - 1:
            raise EngineInvariantError(f"prefill to {end} outside the prompt of {seq.prompt_len}")
        return seq

    def _prefill_one(self, seq: Sequence, num_tokens: int) -> None:
        start, end = seq.num_prefilled, seq.num_prefilled + num_tokens
        if seq.cache is None:
            seq.cache = make_prompt_cache(self._model)
        self._model(mx.array(seq.admit.prompt_ids[start:end])[None], cache=seq.cache)
        mx.eval([c.state for c in seq.cache])
        seq.num_prefilled = end

    def _prefill_together(self, chunks: list[tuple[Sequence, int]]) -> None:
        tokens = [seq.admit.prompt_ids[:n] for seq, n in chunks]
        width = max(n for _, n in chunks)
        padding = [width - n for _, n in chunks]
        cache = [BatchKVCache(padding) for _ in self._geometry]
        self._model(mx.array([[0] * pad + t for pad, t in zip(padding, tokens)]), cache=cache)
        mx.eval([c.state for c in cache])
        for row, (seq, n) in enumerate(chunks):
            seq.cache = [c.extract(row) for c in cache]
            seq.num_prefilled = n

    def _decode(self, *, synchronous: bool) -> list[RowOutput]:
        self._retire_exhausted()
        self._join_ready()
        # A grammar's next mask, or a fast-forward span, needs this step's token: no
        # pipelining while such a row decodes.
        synchronous = synchronous or any(
            self._sequences[rid].matcher is not None or (self._sequences[rid].fill is not None and self._sequences[rid].fill.active)
            for rid in self._batch.row_ids
        )
        dispatched = self._dispatch() if len(self._batch) else None
        outputs = self._collect(self._in_flight) if self._in_flight is not None else []
        self._in_flight = dispatched
        if synchronous and dispatched is not None:
            outputs += self._collect(dispatched)
            self._in_flight = None
        return outputs

    def _retire_exhausted(self) -> None:
        """Rows whose in-flight token is their last leave before the next dispatch."""
        in_flight = {id(seq) for seq in self._in_flight.rows} if self._in_flight is not None else set()
        for rid in list(self._batch.row_ids):
            seq = self._sequences[rid]
            if seq.num_generated + (id(seq) in in_flight) >= seq.admit.max_tokens:
                self._leave_batch(rid)

    def _join_ready(self) -> None:
        for rid, seq in self._sequences.items():
            if not seq.is_ready:
                continue
            admit, context = seq.admit, seq.context
            self._batch.add_row(rid, seq.cache or [], seq.num_prefilled)
            # Everything the cache lacks is fed next: usually the last token, more after a park
            # (the sampler counts those when they are appended, like any appended token).
            seq.extra = context[seq.num_prefilled + 1 :]
            row = RowSampling(admit.sampling, admit.seed, admit.logprobs, admit.top_logprobs, num_sampled=len(seq.generated) - len(seq.extra))
            self._sampler.add_row(row, context=context[: seq.num_prefilled + 1])
            last = mx.array([context[seq.num_prefilled]], dtype=mx.uint32)
            self._pending = last if self._pending is None else mx.concatenate([self._pending, last])
            seq.cache = None
            seq.in_batch = seq.joined = True

    def _leave_batch(self, request_id: str) -> None:
        """Remove an ending request's row, keeping its KV as a prefix entry if wanted."""
        if self._sequences[request_id].admit.save_prefix:
            self._save_prefix(self._sequences[request_id], self._batch.extract(request_id))
        self._remove_row(request_id)

    def _remove_row(self, request_id: str) -> None:
        order = self._batch.remove_row(request_id)
        self._sampler.reorder(order)
        self._pending = self._pending[mx.array(order, dtype=mx.int32)] if order else None
        self._sequences[request_id].in_batch = False

    def _dispatch(self) -> InFlight:
        """One decode step. Rows with known tokens to append (jump-forward, fast-forward, a
        rejoin) first forward all of them but the last in one step over just those rows;
        then the whole batch forwards one token each, so other rows never pay for padding."""
        batch = self._batch
        rows = [self._sequences[rid] for rid in batch.row_ids]
        appending = [i for i, seq in enumerate(rows) if seq.extra]
        pending, sub_logits = self._pending, None
        if appending:
            firsts = pending.tolist()
            width = max(len(rows[i].extra) for i in appending)
            inputs = [[firsts[i], *rows[i].extra[:-1]] + [0] * (width - len(rows[i].extra)) for i in appending]
            batch.begin_step([len(rows[i].extra) for i in appending], rows=appending)
            sub_logits = self._model(mx.array(inputs, dtype=mx.uint32), cache=batch.layers)
            batch.end_step()
            for i in appending:
                firsts[i] = rows[i].extra[-1]
            pending = mx.array(firsts, dtype=mx.uint32)
            # Penalties see appended tokens like sampled ones (an echo span's only once accepted).
            self._sampler.advance({i: rows[i].extra for i in appending if rows[i].verify is None})
        if len(rows) == 1:
            # A lone row: the compiled step (no per-step graph build) is ~6-10% faster per token
            # on CPU. Batches build the graph: attending over the whole capacity costs them more
            # KV reads than the build saves (c16 0.90x vs 1.01x of mlx-lm, measured).
            logits = batch.forward_one(self._decode_step, pending)
        else:
            batch.begin_step([1] * len(rows))
            logits = self._model(pending[:, None], cache=batch.layers)[:, -1, :]
            batch.end_step()
        in_flight = InFlight(rows=rows, result=None)
        if any(rows[i].verify is not None or rows[i].trace is not None for i in appending):
            logits = self._verify(rows, appending, sub_logits, logits, in_flight)
        result = self._sampler.sample(logits, mask=self._grammar_mask(rows))
        for seq in rows:
            seq.extra = []
        self._pending = result.tokens
        in_flight.result = result
        mx.async_eval(result.arrays() + [a for a in (in_flight.choices, in_flight.accepted) if a is not None])
        self._num_steps += 1
        if self._num_steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return in_flight

    def _verify(self, rows: list[Sequence], appending: list[int], sub_logits: mx.array, logits: mx.array, in_flight: InFlight) -> mx.array:
        """Greedy choices along the appended spans; echo rows keep the prefix of their span the
        model agrees with and sample from the logits just after it, all on device."""
        choices = mx.argmax(sub_logits, axis=-1).astype(mx.int32)
        in_flight.appended, in_flight.choices = [rows[i] for i in appending], choices
        verify = [j for j, i in enumerate(appending) if rows[i].verify is not None]
        if not verify:
            return logits
        width = sub_logits.shape[1]
        spans = [rows[appending[j]].extra for j in verify]
        targets = mx.array([span + [-1] * (width - len(span)) for span in spans], dtype=mx.int32)
        sub_index = mx.array(verify, dtype=mx.int32)
        accepted = mx.cumprod((choices[sub_index] == targets).astype(mx.int32), axis=1).sum(axis=1)
        picked = sub_logits[sub_index, mx.minimum(accepted, width - 1)]
        batch_index = mx.array([appending[j] for j in verify], dtype=mx.int32)
        whole = (accepted == mx.array([len(span) for span in spans], dtype=mx.int32))[:, None]
        logits[batch_index] = mx.where(whole, logits[batch_index], picked)
        in_flight.verified, in_flight.accepted = [rows[appending[j]] for j in verify], accepted
        return logits

    def _grammar_mask(self, rows: list[Sequence]) -> mx.array | None:
        """Allowed-token bitmask rows from each grammar's state (all allowed elsewhere)."""
        if not any(seq.matcher is not None for seq in rows):
            return None
        bitmask = np.full((len(rows), (self._grammars.vocab_size + 31) // 32), -1, dtype=np.int32)
        tensor = torch.from_numpy(bitmask)
        for i, seq in enumerate(rows):
            if seq.matcher is not None:
                seq.matcher.fill_next_token_bitmask(tensor, i)
        return mx.array(bitmask)

    def _collect(self, in_flight: InFlight) -> list[RowOutput]:
        result = in_flight.result
        tokens = result.tokens.tolist()
        logprobs = _read_logprobs(result, tokens)
        choices = dict(zip(map(id, in_flight.appended), in_flight.choices.tolist())) if in_flight.choices is not None else {}
        accepted = dict(zip(map(id, in_flight.verified), in_flight.accepted.tolist())) if in_flight.accepted is not None else {}
        outputs = []
        for i, seq in enumerate(in_flight.rows):
            rid = seq.admit.request_id
            if self._sequences.get(rid) is not seq:
                continue  # released since the dispatch (its id may even be reused by now)
            agreed: list[int] = []
            if seq.verify is not None and id(seq) in accepted:
                proposal, seq.verify = seq.verify, None
                n = accepted[id(seq)]
                self._batch.rewind(rid, len(proposal.ids) - n)  # the rejected tail's KV
                seq.fill.commit(proposal, n)
                agreed = proposal.ids[:n]
                self._trace(seq, proposal, n, choices.get(id(seq)))
            elif seq.trace is not None and id(seq) in choices:
                proposal, seq.trace = seq.trace, None
                self._trace(seq, proposal, len(proposal.ids), choices[id(seq)])
            outputs.append(self._account(rid, seq, tokens[i], logprobs[i] if logprobs else None, agreed))
        return outputs

    def _account(self, rid: str, seq: Sequence, token: int, logprob: TokenLogprob | None, agreed: list[int] = ()) -> RowOutput:
        """Record a sampled token (after the echo tokens the model agreed with, if any)."""
        seq.generated += agreed
        seq.num_generated += len(agreed) + 1
        seq.generated.append(token)
        admit = seq.admit
        if seq.fill is not None and token not in seq.stop_ids:
            seq.fill.observe(token)

        def output(token_ids: list[int], **kw) -> RowOutput:
            return RowOutput(request_id=rid, token_ids=token_ids, fill=seq.fill.snapshot() if seq.fill else None, **kw)

        if seq.matcher is not None and not seq.matcher.accept_token(token):
            log.error("grammar_rejected_token", request_id=rid, token=token)
            self._finish(rid, seq)
            return output([token], finish_reason="stop")
        wanted = None
        if logprob is not None and (admit.logprobs or admit.top_logprobs):
            top = logprob.top[: admit.top_logprobs] if admit.top_logprobs and logprob.top else None
            wanted = [TokenLogprob(token_id=token, logprob=logprob.logprob, top=top)]
        if token in seq.stop_ids:
            self._finish(rid, seq)
            return output(list(agreed), finish_reason="stop", stop_token_id=token)
        if seq.num_generated >= admit.max_tokens:
            self._finish(rid, seq)
            return output([*agreed, token], logprobs=wanted, finish_reason="length")
        forced = self._fast_forward(seq) if seq.fill is not None and seq.fill.active else self._jump_forward(seq)
        if seq.num_generated >= admit.max_tokens:
            self._finish(rid, seq)
            return output([*agreed, token, *forced], finish_reason="length")
        return output([*agreed, token, *forced], logprobs=wanted)

    def _fast_forward(self, seq: Sequence) -> list[int]:
        """A fast-forward span after the token just sampled: a strict one is emitted now and its
        KV written with the next step; an echo one is forwarded with the next step and emitted as
        far as the model agrees. Room is kept for the token sampled after the span."""
        fill = seq.fill
        proposal = fill.propose(budget=seq.admit.max_tokens - seq.num_generated - 1)
        if proposal is None:
            return []
        if seq.matcher is not None:
            # A forced tool call's grammar guards the rows: a span ends where it would not accept.
            # (A single accepted token is emitted too: the matcher has taken it.)
            num_ok = next((i for i, t in enumerate(proposal.ids) if not seq.matcher.accept_token(t)), len(proposal.ids))
            proposal = Proposal(proposal.ids[:num_ok], proposal.policy, proposal.origin)
            if not num_ok:
                fill.commit(proposal, 0)
                return []
        seq.extra = list(proposal.ids)
        if proposal.policy == "verify":
            seq.verify = proposal
            return []
        fill.commit(proposal, len(proposal.ids))
        seq.generated += proposal.ids
        seq.num_generated += len(proposal.ids)
        if fill.plan.trace_path:
            seq.trace = proposal
        return list(proposal.ids)

    def _trace(self, seq: Sequence, proposal: Proposal, accepted: int, choices: list[int] | None) -> None:
        """Best effort: a trace that cannot be written must not fail the step."""
        path = seq.fill.plan.trace_path
        if not path:
            return
        actual = (choices or [])[: len(proposal.ids)]
        generated = seq.num_generated - (len(proposal.ids) if proposal.policy == "assert" else 0)
        try:
            with open(path, "a") as handle:  # a diagnostic, opt-in: one short append per span
                handle.write(trace_record(seq.admit.request_id, proposal, generated, accepted, actual, self._to_text) + "\n")
        except OSError as exc:
            log.warning("fill_trace_failed", path=path, error=str(exc))

    def _jump_forward(self, seq: Sequence) -> list[int]:
        """Tokens the grammar now forces: emitted at once, their KV written with the next step."""
        if seq.matcher is None or not seq.admit.jump_forward or seq.matcher.is_terminated():
            return []
        forced = []
        for token in seq.matcher.find_jump_forward_tokens()[: seq.admit.max_tokens - seq.num_generated]:
            # Ending the output is the model's choice, never a forced one.
            if token in seq.stop_ids or not seq.matcher.accept_token(token):
                break
            forced.append(token)
        seq.generated += forced
        seq.num_generated += len(forced)
        seq.extra = forced
        self.num_forced_tokens += len(forced)
        return forced

    def _finish(self, rid: str, seq: Sequence) -> None:
        self._release(rid)


def _trimmed(cache: KVCache, length: int) -> KVCache:
    trimmed = KVCache()
    trimmed.keys = mx.contiguous(cache.keys[..., :length, :])
    trimmed.values = mx.contiguous(cache.values[..., :length, :])
    trimmed.offset = length
    mx.eval(trimmed.keys, trimmed.values)
    return trimmed


def _read_logprobs(result: SampleResult, tokens: list[int]) -> list[TokenLogprob] | None:
    if result.logprobs is None:
        return None
    chosen = result.logprobs.tolist()
    if result.top_ids is None:
        return [TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(tokens, chosen)]
    top_ids, top_lps = result.top_ids.tolist(), result.top_logprobs.tolist()
    out = []
    for t, lp, ids, lps in zip(tokens, chosen, top_ids, top_lps):
        top = sorted((TopLogprob(token_id=i, logprob=v) for i, v in zip(ids, lps)), key=lambda x: -x.logprob)
        out.append(TokenLogprob(token_id=t, logprob=lp, top=top))
    return out
