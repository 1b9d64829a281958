"""The engine: executes the scheduler's step plans on the MLX thread.

Owns every per-request array: prefill caches (`prefill.py`), the decode batch's KV slots,
the sampler state, the in-flight step, saved prefix entries, parked rows and (with
speculation) the draft model's rows. A plan is applied in order: release, admit,
park/unpark, prefill, decode, checkpoints. Decode is pipelined like mlx-lm's
`generate_step`: step n+1 is dispatched (`mx.async_eval`, `forward.py`) before step n's
tokens are read back. A step is read before the next is built only when some row needs its
token for that (a grammar mask, a fast-forward span, a draft) or samples its first token.

A prompt's last token is not prefilled: the request joins the batch with it as its pending
input. A failure confined to one request (its grammar, fill session or checkpoint) ends
that request with `error`; anything else fails the step. Every call returns plain data.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import mlx.core as mx
import structlog

from engine import lanes, native
from engine.batch import DecodeBatch
from engine.compiled import compile_decode_step
from engine.errors import EngineInvariantError
from engine.forward import append_known, forward_drafts, forward_pending, grammar_mask, host, read_logprobs, replay_accepted
from engine.known import KnownTokens
from engine.kv import caches
from engine.kv.attention import install as install_attention
from engine.kv.paged import BlockPool, paged_layers
from engine.kv.prefixes import PrefixEntries
from engine.kv.quantized import is_quantized, packed_nbytes, quantized_start
from engine.kv.tables import RequestBlocks
from engine.lora import AdapterBank
from engine.model.wired import WiredScope, model_bytes, recommended_working_set
from engine.prefill import encode_unit, prefill_one, prefill_together
from engine.sampler import BatchSampler, RowSampling
from engine.sequence import InFlight, Sequence, capture_checkpoints
from engine.speculation import Speculator
from policies.fill_session import FillSession
from policies.layout import is_trimmable, paged_block_bytes
from protocols.api import FillStats, SamplingParams, TokenLogprob
from protocols.config import LoraConfig
from protocols.errors import MlxrtError, error_code
from protocols.model import (
    AdmitRequest,
    CheckpointData,
    DeviceMemory,
    GrammarSpec,
    KvPool,
    LayerLayout,
    PrefillReport,
    PrefillWork,
    RowOutput,
    StepOutcome,
    StepPlan,
)

CLEAR_CACHE_EVERY = 256

log = structlog.get_logger(actor="engine")

__all__ = ["Engine", "EngineInvariantError", "Grammars"]


class Grammars(Protocol):
    """What the engine needs of the grammar compiler: matchers for grammars compiled (and
    pinned) before their requests were admitted (a follower rank compiles when first asked)."""

    vocab_size: int

    def matcher(self, spec: GrammarSpec) -> Any: ...


class Engine:
    """Runs plans against one model. Not thread-safe: the MLX thread only."""

    def __init__(
        self,
        model,
        layout: list[LayerLayout],
        grammars: Grammars | None = None,
        decode=None,
        speculator: Speculator | None = None,
        adapters: AdapterBank | None = None,
        pool_bytes: int = 0,
        compiled: bool = True,
    ):
        self._model = model
        # LoRA adapters: each row's forwards add its adapter's delta (`engine.lora`).
        self.adapters = adapters if adapters is not None else AdapterBank(model, LoraConfig().max_resident, LoraConfig().max_rank)
        # Speculative decoding (a draft model's rows, prompt lookup, the batch gate).
        self._speculator = speculator or Speculator()
        self._grammars = grammars
        # Token ids to text, for fast-forwarding's tool-call context and trace.
        self._to_text = decode
        self._known = KnownTokens(decode)
        self._layout = layout
        # Any prefix of a saved sequence can seed a request only when every layer keeps every
        # position; otherwise prefix entries are used whole, and one is kept at each prompt's end.
        self._trimmable = is_trimmable(layout)
        self._thread = threading.current_thread()
        self._sequences: dict[str, Sequence] = {}
        # Paged KV: the block pool (at most `pool_bytes`, the KV budget) outlives the batch.
        self._pool = BlockPool(layout, pool_bytes // paged_block_bytes(layout)) if paged_layers(layout) else None
        self._blocks = RequestBlocks(self._pool, layout, model)
        # The batch's caches attend by themselves in decode steps (`engine.kv.attention`).
        install_attention(model)
        lanes.install(model)
        # mlxrt's CPU kernels, built and checked once per process (`engine.native`: None where
        # MLX's ops serve; `build_engine` has built them first, with progress).
        if mx.default_device() == mx.cpu and compiled:  # (not in a distributed world: `engine.build`)
            native.load()
        self._batch = DecodeBatch(layout, self._pool)
        # A lone row decodes uncompiled when quantized (traced: 12.5 vs 13.5 tok/s at 2,048) or
        # sharded (collectives stay out of traced functions).
        self._quantized = is_quantized(layout)
        # (A model whose rotary positions the engine passes, Qwen-VL's, decodes uncompiled.)
        explicit = getattr(model, "explicit_positions", False)
        self._decode_step = compile_decode_step(model, layout) if compiled and not self._quantized and not explicit else None
        # Quantized first chunks prefill together over full attention without a float head only.
        together = not self._quantized or (self._trimmable and quantized_start(layout) == 0)
        self._batched_prefill_limit = float("inf") if together else quantized_start(layout)
        self._sampler = BatchSampler()
        # Metal: the weights stay wired while requests run, for a model over half the working set.
        self._wired = WiredScope(model_bytes(model), recommended_working_set())
        if self._wired.wanted:
            log.info("wired_limit_while_serving", weight_bytes=model_bytes(model), recommended_working_set=recommended_working_set())
        self._pending: mx.array | None = None
        self._in_flight: InFlight | None = None
        self._num_steps = 0
        self._prefixes = PrefixEntries(layout, self._pool, self._trimmable)
        self._checkpoints: list[CheckpointData] = []
        self._peak_bytes = 0

    def step(self, plan: StepPlan) -> StepOutcome:
        """Apply one plan; see the module docstring for the order. Its forwards split their
        elementwise-bound pieces over two CPU lanes and use mlxrt's CPU kernels (`engine.lanes`,
        `engine.native`: bit for bit the same)."""
        if threading.current_thread() is not self._thread:
            raise EngineInvariantError("the engine was called off its MLX thread")
        with lanes.parallel():
            return self._step(plan)

    def _step(self, plan: StepPlan) -> StepOutcome:
        started = time.perf_counter()
        released = [rid for rid in plan.release if self._release(rid)]
        outputs = [refused for admit in plan.admit if (refused := self._admit(admit)) is not None]
        if self._sequences:
            self._wired.hold()
        if self._in_flight is not None and self._in_flight.must_be_read_first and set(plan.park) & {s.request_id for s in self._in_flight.rows}:
            # A span being checked is settled before its row leaves the batch.
            outputs += self._collect(self._in_flight)
            self._in_flight = None
        for rid in plan.park:
            self._park(rid)
        for rid in plan.unpark:
            if rid in self._sequences:
                self._sequences[rid].parked = False
        for rid in plan.checkpoint:
            if rid in self._sequences:
                self._sequences[rid].checkpoint_due = True
        failed = {output.request_id for output in outputs}
        prefilled = self._prefill([work for work in plan.prefill if work.request_id not in failed])
        if plan.decode:
            outputs += self._decode()
        if not self._sequences:
            mx.clear_cache()
            self._wired.release()
        self._blocks.after_step()
        kv_bytes = self.kv_bytes()
        self._peak_bytes = max(self._peak_bytes, kv_bytes)
        return StepOutcome(
            outputs=outputs,
            prefilled=prefilled,
            released=released,
            num_decode_rows=len(self._batch),
            kv_tokens=self.kv_tokens(),
            kv_bytes=kv_bytes,
            kv_quantized_bytes=self.kv_quantized_bytes(),
            kv_pool=self.pool_stats(),
            kv_peak_bytes=self._peak_bytes,
            step_s=time.perf_counter() - started,
            saved_prefixes=self._prefixes.take_saved(),
            checkpoints=self._take_checkpoint_list(),
            adapter_bytes=self.adapters.nbytes,
            device=DeviceMemory(active=mx.get_active_memory(), peak=mx.get_peak_memory(), cache=mx.get_cache_memory()),
        )

    @property
    def batch_slots(self) -> list:
        """Every layer's slots of the decode batch (what a profiler patches)."""
        return self._batch.slots

    def warm_up(self, vocab_size: int) -> float:
        """Run the kinds of step serving runs (a batched first chunk, a lone row's step, a batch
        of rows) on throwaway requests, so that MLX compiles their kernels now (with g++ on the
        CPU backend, seconds on a fresh kernel cache) rather than during the first user's
        request. Leaves no request, prefix entry or checkpoint behind; returns its seconds."""
        started = time.perf_counter()
        prompt = [i % vocab_size for i in range(1, 9)]
        admits = [
            AdmitRequest(
                request_id=f"warm-up-{i}", prompt_ids=prompt, max_tokens=3 + 2 * i, sampling=SamplingParams(), seed=0, stop_token_ids=[], save_prefix=False
            )
            for i in range(2)
        ]
        self.step(StepPlan(admit=admits))
        self.step(StepPlan(prefill=[PrefillWork(request_id=a.request_id, num_tokens=len(prompt) - 1) for a in admits], decode=True))
        for _ in range(16):  # two rows, then the longer one alone (the lone-row step)
            if not self._sequences:
                break
            self.step(StepPlan(decode=True))
        self.step(StepPlan(release=[a.request_id for a in admits]))
        if self._sequences:
            raise EngineInvariantError("the warm-up requests did not finish")
        self._peak_bytes = 0
        return time.perf_counter() - started

    def uncompiled(self) -> contextlib.AbstractContextManager[None]:
        """Decode a lone row through the model's own code for a while (a profiler times its
        pieces; a compiled step runs as one traced graph)."""
        return _without_compiled_step(self)

    def _take_checkpoint_list(self) -> list[CheckpointData]:
        taken, self._checkpoints = self._checkpoints, []
        return taken

    def drop_prefixes(self, entry_ids: list[str]) -> None:
        self._prefixes.drop(entry_ids)

    def export_prefix(self, entry_id: str, spans: list[tuple[int, int]], whole: bool) -> list[dict]:
        """Numpy copies of a prefix entry's positions for the disk tier: per span, its arrays
        by tensor name (`caches.chunk_arrays`), or with `whole` the entire entry's
        (`caches.tensor_arrays`). Raises `KeyError` for an entry no longer kept."""
        return self._prefixes.export(entry_id, spans, whole)

    def reset(self) -> None:
        """Drop every request (after a failed step); prefix entries stay."""
        for seq in self._sequences.values():
            self._free(seq)
        self._sequences.clear()
        self.adapters.release_all()
        self._batch = DecodeBatch(self._layout, self._pool)
        if self._speculator.draft is not None:
            self._speculator.draft.reset()
        self._sampler = BatchSampler()
        self._pending = None
        self._wired.release()
        self._in_flight = None
        self._checkpoints = []
        mx.clear_cache()

    def kv_tokens(self) -> dict[str, int]:
        tokens = {rid: seq.num_prefilled for rid, seq in self._sequences.items() if seq.cache is not None}
        tokens.update(zip(self._batch.row_ids, self._batch.lengths))
        return tokens

    def kv_quantized_bytes(self) -> int:
        """Of `kv_bytes`, the quantized KV's (`kv.bits`)."""
        if not self._quantized:
            return 0
        outside = [c for s in self._sequences.values() if s.cache is not None for c in s.cache]
        return packed_nbytes(outside) + self._prefixes.quantized_bytes() + packed_nbytes(self._batch.slots)

    def kv_bytes(self) -> int:
        outside = sum(caches.nbytes(s.cache) for s in self._sequences.values() if s.cache is not None)
        draft = self._speculator.draft.nbytes if self._speculator.draft is not None else 0
        # (The pool's blocks held; its free ones are in `pool_stats`.)
        return outside + self._prefixes.nbytes + self._batch.nbytes + self._blocks.used_bytes + draft

    def pool_stats(self) -> KvPool | None:
        if self._pool is None:  # (every step asks: no walk over the prefix entries without a pool)
            return None
        return self._blocks.stats(self.kv_tokens(), self._sequences.values(), self._prefixes.holders())

    # -- admission, parking, release ---------------------------------------------------------

    def _admit(self, admit: AdmitRequest) -> RowOutput | None:
        """Track a new request; a request that cannot start on its own account fails alone.
        Whatever its start took before it failed is given back (`_free`)."""
        if admit.request_id in self._sequences:
            raise EngineInvariantError(f"request {admit.request_id!r} admitted twice")
        seq = Sequence(admit=admit, stop_ids=frozenset(admit.stop_token_ids))
        try:
            self._start(seq)
        except Exception as exc:
            self._free(seq)
            if isinstance(exc, EngineInvariantError):
                raise
            code = error_code(exc) if isinstance(exc, MlxrtError) else None
            if code is None:
                log.exception("request_failed_at_admission", request_id=admit.request_id)
            return RowOutput(request_id=admit.request_id, token_ids=[], finish_reason="error", error=f"{type(exc).__name__}: {exc}", error_code=code)
        self._sequences[admit.request_id] = seq
        return None

    def _start(self, seq: Sequence) -> None:
        """A new request's state: grammar, fill session, its KV (from a checkpoint or a prefix
        entry), speculation, its adapter slot. Each thing taken is recorded on `seq` as it is
        taken, so `_free` gives back exactly what was, wherever this stops."""
        admit = seq.admit
        if admit.grammar is not None:
            if self._grammars is None:
                raise EngineInvariantError("a grammar request reached an engine without grammars")
            seq.matcher = self._grammars.matcher(admit.grammar)
        resumed = admit.resume.generated if admit.resume is not None else []
        if admit.fill is not None:
            stats = FillStats(mode=admit.fill.mode, echo_refused=admit.fill.echo_refused)
            seq.fill = FillSession(admit.fill, stats, admit.prompt_ids, self._to_text)
            seq.fill.replay(resumed)
        for token in resumed:  # a resumed request's grammar state: its output so far, replayed
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                raise ValueError(f"the checkpoint's output does not follow its grammar at token {token}")
        if admit.resume is not None:
            seq.generated = list(resumed)
            seq.num_generated = len(resumed)
            if admit.resume.num_kv_tokens != len(admit.context_ids) - 1:
                raise EngineInvariantError(f"checkpoint covers {admit.resume.num_kv_tokens} tokens, expected {len(admit.context_ids) - 1}")
            restored = caches.from_tensors(admit.resume.kv_tensors, self._layout, admit.resume.num_kv_tokens)
            seq.cache = self._blocks.into_pool(seq, restored, admit.resume.num_kv_tokens)
            seq.num_prefilled = admit.resume.num_kv_tokens
        elif admit.prefix_entry is not None:
            n = admit.prefix_tokens
            seq.cache = self._prefixes.seed(admit.prefix_entry, n, seq)
            seq.num_prefilled = n
        elif admit.disk_prefix is not None:
            disk, n = admit.disk_prefix, admit.disk_prefix.num_tokens
            if not 0 < n < seq.prompt_len:
                raise EngineInvariantError(f"a disk prefix of {n} tokens cannot seed a {seq.prompt_len}-token prompt")
            restored = caches.from_arrays(disk.arrays, self._layout, n)
            seq.cache = self._blocks.into_pool(seq, restored, n)
            seq.num_prefilled = n
            if admit.save_prefix:  # kept in RAM too: the next request with this prefix need not read it
                self._prefixes.save(seq, caches.trimmed(seq.cache, n), n)
        if admit.vision is not None and getattr(self._model, "explicit_positions", False):
            if admit.vision.arrays:
                seq.vision_positions, seq.position_shift = self._model.prompt_positions(admit.prompt_ids, admit.vision.arrays)
            else:  # resumed: its KV holds the prompt; only the shift after it is needed
                seq.position_shift = admit.vision.position_shift
        if admit.spec is not None:
            self._speculator.start(seq)
        if admit.adapter is not None:
            seq.adapter_slot = self.adapters.acquire(admit.adapter, admit.adapter_digest)

    def _park(self, request_id: str) -> None:
        """Take a row out of the batch, keeping its KV; it rejoins once unparked."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return
        seq.parked = True
        self._known.withdraw(seq)
        self._speculator.withdraw(seq)
        self._speculator.park(seq)
        if seq.in_batch:
            seq.num_prefilled = self._batch.lengths[self._batch.index(request_id)]
            seq.cache = self._batch.extract(request_id)
            self._remove_row(request_id)
            seq.joined = False

    def _release(self, request_id: str, *, save_prefix: bool = True) -> bool:
        seq = self._sequences.get(request_id)
        if seq is None:
            return False
        if save_prefix:
            self._keep_kv(seq)
        if seq.in_batch:
            self._remove_row(request_id)
        self._free(seq)
        del self._sequences[request_id]
        return True

    def _free(self, seq: Sequence) -> None:
        """Give back what a request holds: its blocks (the prefix entry's shared ones among
        them), its draft model state, its adapter slot. The one place for this, at a request's
        end and after a failed admission alike (a grammar matcher holds nothing of the engine's)."""
        self._blocks.release(seq)
        self._speculator.release(seq.request_id)
        if seq.adapter_slot and seq.admit.adapter is not None:
            self.adapters.release(seq.admit.adapter)
            seq.adapter_slot = 0

    def _keep_kv(self, seq: Sequence) -> None:
        """Offer a leaving request's KV (prompt and everything fed) to the prefix cache."""
        if not seq.admit.save_prefix:
            return
        if seq.in_batch:
            length = self._batch.lengths[self._batch.index(seq.request_id)]
            # A span still being checked (a cancel mid-round) is not known to be the output.
            verified = min(length, len(seq.context))
            if verified < length and not self._trimmable:
                return
            kept = self._batch.extract(seq.request_id)
            self._prefixes.save(seq, kept if verified == length else caches.trimmed(kept, verified), verified)
        elif seq.cache is not None and seq.num_prefilled:
            self._prefixes.save(seq, caches.trimmed(seq.cache, seq.num_prefilled), seq.num_prefilled)

    # -- prefill -----------------------------------------------------------------------------

    def _prefill(self, works: list[PrefillWork]) -> list[PrefillReport]:
        """Forward prompt chunks. First chunks go through batched forwards (padded, or for
        models with recurrent layers only chunks of one length together); later chunks extend
        their request's own cache one at a time. Vision tower units (`PrefillWork.encode`) run
        first: the scheduler plans a request's chunks only once its tower is done."""
        encoded = [self._encode(work) for work in works if work.encode]
        works = [work for work in works if not work.encode]
        seqs = [self._prefill_target(work) for work in works]
        scored = [len(seq.prompt_logprobs) for seq in seqs]
        in_flight = self._in_flight.result.arrays() if self._in_flight is not None and self._in_flight.result is not None else []
        self._blocks.ready(zip(seqs, (work.num_tokens for work in works)), in_flight)
        first = [
            (s, w.num_tokens) for s, w in zip(seqs, works) if s.num_prefilled == 0 and w.num_tokens <= self._batched_prefill_limit and s.admit.vision is None
        ]
        together = [group for group in self._batch.unpadded_groups([n for _, n in first]) if len(group) > 1]
        batched = {id(first[i][0]) for group in together for i in group}
        for seq, work in zip(seqs, works):
            if id(seq) not in batched:
                prefill_one(self._model, self._layout, seq, work.num_tokens)
        for group in together:
            prefill_together(self._model, self._layout, self._trimmable, [first[i] for i in group])
            for i in group:
                seq = first[i][0]
                seq.cache = self._blocks.into_pool(seq, seq.cache or [], seq.num_prefilled)
        draft = self._speculator.draft
        if draft is not None and self._speculator.gate.allows(len(self._batch) + len(seqs)):
            # The draft model prefills what the target did (and any prefix it lacks); in a batch
            # too big to speculate it does not, and a row that drafts later catches up then.
            for seq in seqs:
                if seq.spec is not None and seq.lookup is None:
                    draft.prefill(seq.request_id, seq.admit.prompt_ids[: seq.num_prefilled])
        for seq in seqs:
            # A snapshot where asked, and (when entries are used whole) at the end of the prompt.
            wanted = seq.admit.snapshot_at == seq.num_prefilled or (not self._trimmable and seq.num_prefilled == seq.prompt_len - 1)
            if seq.admit.save_prefix and wanted and seq.cache is not None:
                self._prefixes.save(seq, caches.trimmed(seq.cache, seq.num_prefilled), seq.num_prefilled)
        return encoded + [
            PrefillReport(
                request_id=s.request_id,
                processed_tokens=s.num_prefilled,
                total_tokens=s.prompt_len,
                prompt_logprobs=s.prompt_logprobs[before:] if s.admit.prompt_logprobs is not None else None,
            )
            for s, before in zip(seqs, scored)
        ]

    def _encode(self, work: PrefillWork) -> PrefillReport:
        seq = self._sequences.get(work.request_id)
        if seq is None:
            raise EngineInvariantError(f"vision tower work for unknown request {work.request_id!r}")
        more = encode_unit(self._model, seq, work.num_tokens)
        return PrefillReport(request_id=seq.request_id, processed_tokens=seq.num_prefilled, total_tokens=seq.prompt_len, encoding=more)

    def _prefill_target(self, work: PrefillWork) -> Sequence:
        seq = self._sequences.get(work.request_id)
        if seq is None:
            raise EngineInvariantError(f"prefill for unknown request {work.request_id!r}")
        end = seq.num_prefilled + work.num_tokens
        if work.num_tokens <= 0 or end > seq.prompt_len - 1:
            raise EngineInvariantError(f"prefill to {end} outside the prompt of {seq.prompt_len}")
        return seq

    # -- decode ------------------------------------------------------------------------------

    def _decode(self) -> list[RowOutput]:
        """Dispatch the next step and read the one before it. A step is read before the next
        is built when a row needs its token for that; it is read at once when a row samples
        its first token. Otherwise it stays in flight while the caller goes on."""
        outputs = []
        if self._in_flight is not None and self._in_flight.must_be_read_first:
            outputs += self._collect(self._in_flight)
            self._in_flight = None
        self._retire_exhausted()
        self._join_ready()
        in_flight = self._in_flight.rows if self._in_flight is not None else []
        self._checkpoints += capture_checkpoints(self._sequences.values(), self._batch, self._layout, in_flight)
        dispatched = self._dispatch() if len(self._batch) else None
        if self._in_flight is not None:
            outputs += self._collect(self._in_flight)
        self._in_flight = dispatched
        if dispatched is not None and dispatched.has_first_tokens:
            outputs += self._collect(dispatched)
            self._in_flight = None
        return outputs

    def _retire_exhausted(self) -> None:
        """Rows whose in-flight token is their last leave before the next dispatch."""
        in_flight = {id(seq) for seq in self._in_flight.rows} if self._in_flight is not None else set()
        for rid in list(self._batch.row_ids):
            seq = self._sequences[rid]
            if seq.num_generated + (id(seq) in in_flight) >= seq.admit.max_tokens:
                self._keep_kv(seq)
                self._remove_row(rid)

    def _join_ready(self) -> None:
        for rid, seq in self._sequences.items():
            if not seq.is_ready:
                continue
            admit, context = seq.admit, seq.context
            self._batch.add_row(rid, seq.cache or [], seq.num_prefilled, table=seq.table if self._pool is not None else None, shift=seq.position_shift)
            # Everything the cache lacks is fed next: usually the last token, more after a park
            # (the sampler counts those when they are appended, like any appended token).
            seq.extra = context[seq.num_prefilled + 1 :]
            sampled = len(seq.generated) - len(seq.extra)
            row = RowSampling(
                admit.sampling,
                admit.seed,
                admit.logprobs,
                admit.top_logprobs,
                num_sampled=sampled,
                stop_ids=tuple(admit.stop_token_ids) if admit.sampling.min_tokens else (),
                bad_words=tuple(tuple(word) for word in admit.bad_words_ids),
            )
            self._sampler.add_row(row, context=context[: seq.num_prefilled + 1], generated=seq.generated[: max(0, sampled)])
            last = mx.array([context[seq.num_prefilled]], dtype=mx.uint32)
            self._pending = last if self._pending is None else mx.concatenate([self._pending, last])
            seq.cache = None
            seq.in_batch = seq.joined = True

    def _remove_row(self, request_id: str) -> None:
        order = self._batch.remove_row(request_id)
        self._sampler.reorder(order)
        self._pending = self._pending[mx.array(order, dtype=mx.int32)] if order and self._pending is not None else None
        self._sequences[request_id].in_batch = False

    def _dispatch(self) -> InFlight:
        """One decode step. Rows with known tokens to append (jump-forward, fast-forward, a
        rejoin) first forward all of them but the last in one step over just those rows;
        then the whole batch forwards one token each, so other rows never pay for padding."""
        batch = self._batch
        rows = [self._sequences[rid] for rid in batch.row_ids]
        self._speculator.propose(rows, self._sampler.rows, batch.lengths)
        appending = [i for i, seq in enumerate(rows) if seq.extra]
        assert self._pending is not None
        pending, sub_logits = self._pending, None
        if appending and all(rows[i].draft is not None for i in appending):
            sub_logits, logits = forward_drafts(self._model, self._batch, rows, appending, pending)
        else:
            if appending:
                pending, sub_logits = append_known(self._model, self._batch, self._sampler, rows, appending, pending)
            logits = forward_pending(self._model, self._batch, self._decode_step, rows, pending)
        in_flight = InFlight(rows=rows)
        check = None
        if sub_logits is not None:
            self._known.trace_choices(rows, appending, sub_logits, in_flight)
            checked = self._speculator.check(rows, appending, sub_logits, logits, logits.shape[-1])
            if checked is not None:
                check, in_flight.verified = checked
                in_flight.verified_sampling = [self._sampler.rows[i] for i in check.rows]
        result = self._sampler.sample(logits, mask=grammar_mask(self._grammars, rows), check=check)
        for seq in rows:
            seq.extra = []
        self._pending = result.tokens
        in_flight.result = result
        in_flight.accepted = result.accepted
        mx.async_eval(result.arrays() + [a for a in (in_flight.choices,) if a is not None])
        self._num_steps += 1
        if self._num_steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return in_flight

    def _collect(self, in_flight: InFlight) -> list[RowOutput]:
        assert in_flight.result is not None
        result = in_flight.result
        tokens = host(result.tokens)
        logprobs = read_logprobs(result, tokens)
        choices = dict(zip(map(id, in_flight.appended), host(in_flight.choices))) if in_flight.choices is not None else {}
        accepted = dict(zip(map(id, in_flight.verified), host(in_flight.accepted))) if in_flight.accepted is not None else {}
        exhausted = host(result.exhausted) if result.exhausted is not None else [False] * len(tokens)
        for sampling, seq in zip(in_flight.verified_sampling, in_flight.verified):
            sampling.num_sampled += accepted[id(seq)]  # a checked span's kept tokens were sampled too
        outputs = []
        for i, seq in enumerate(in_flight.rows):
            if self._sequences.get(seq.request_id) is not seq:
                continue  # released since the dispatch (its id may even be reused by now)
            if exhausted[i]:
                outputs.append(self._exhausted(seq))
                continue
            try:
                if seq.failure is not None:
                    raise RuntimeError(seq.failure)
                if seq.draft is not None and id(seq) in accepted:
                    agreed = self._speculator.settle(seq, self._batch, accepted[id(seq)])
                else:
                    agreed = self._known.settle(seq, self._batch, accepted, choices)
                if seq.snapshot is not None:
                    replay_accepted(self._model, self._batch, seq, len(agreed))
                outputs.append(self._account(seq, tokens[i], logprobs[i] if logprobs else None, agreed))
            except Exception as exc:  # this request's grammar or fill session: it alone ends
                log.exception("request_failed", request_id=seq.request_id)
                outputs.append(self._fail(seq, exc))
        return outputs

    def _account(self, seq: Sequence, token: int, logprob: TokenLogprob | None, agreed: list[int]) -> RowOutput:
        """Record a sampled token (after the echo tokens the model agreed with, if any)."""
        seq.generated += agreed
        seq.num_generated += len(agreed) + 1
        seq.generated.append(token)
        admit = seq.admit
        if seq.fill is not None and token not in seq.stop_ids:
            seq.fill.observe(token)
        if seq.spec is not None:
            seq.spec.record_step(len(agreed) + 1)
            if seq.lookup is not None:
                seq.lookup.observe([*agreed, token])

        def output(token_ids: list[int], **kw) -> RowOutput:
            fill = seq.fill.snapshot() if seq.fill else None
            return RowOutput(request_id=seq.request_id, token_ids=token_ids, fill=fill, spec=seq.spec.snapshot() if seq.spec else None, **kw)

        if seq.matcher is not None and not seq.matcher.accept_token(token):
            raise RuntimeError(f"the grammar rejected sampled token {token}")
        wanted = None
        if logprob is not None and (admit.logprobs or admit.top_logprobs):
            top = logprob.top[: admit.top_logprobs] if admit.top_logprobs and logprob.top else None
            wanted = [TokenLogprob(token_id=token, logprob=logprob.logprob, top=top)]
        if token in seq.stop_ids:
            self._release(seq.request_id)
            return output(list(agreed), finish_reason="stop", stop_token_id=token)
        if seq.matcher is not None and seq.matcher.is_terminated():
            # The grammar is complete: no further step is built for this row.
            self._release(seq.request_id)
            return output([*agreed, token], logprobs=wanted, finish_reason="stop")
        if seq.num_generated >= admit.max_tokens:
            self._release(seq.request_id)
            return output([*agreed, token], logprobs=wanted, finish_reason="length")
        forced = self._known.after_sample(seq)
        if seq.lookup is not None and forced:
            seq.lookup.observe(forced)
        if seq.num_generated >= admit.max_tokens:
            self._release(seq.request_id)
            return output([*agreed, token, *forced], finish_reason="length")
        return output([*agreed, token, *forced], logprobs=wanted)

    def _exhausted(self, seq: Sequence) -> RowOutput:
        """The request's own logits controls (with its grammar) left no token to sample: it ends
        with an `invalid_request` error, its KV not kept."""
        self._release(seq.request_id, save_prefix=False)
        why = "no token is left to sample: the request's allowed_token_ids, bad_words and min_tokens (with its grammar) exclude every token"
        return RowOutput(request_id=seq.request_id, token_ids=[], finish_reason="error", error=why, error_code="invalid_request")

    def _fail(self, seq: Sequence, exc: Exception) -> RowOutput:
        """End one request with `error`; its KV is not kept (its state is suspect)."""
        self._release(seq.request_id, save_prefix=False)
        return RowOutput(request_id=seq.request_id, token_ids=[], finish_reason="error", error=str(exc) or type(exc).__name__)


@contextlib.contextmanager
def _without_compiled_step(engine: Engine) -> Iterator[None]:
    step, engine._decode_step = engine._decode_step, None
    try:
        yield
    finally:
        engine._decode_step = step
