"""The engine: executes the scheduler's step plans on the MLX thread.

Owns every per-request array: prefill caches (`prefill.py`), the decode batch's KV slots,
the sampler state, the in-flight step, saved prefix entries, parked rows and (with
speculation) the draft model's rows. A plan is applied in order: release, admit,
park/unpark, prefill, decode, checkpoints. Decode is pipelined like mlx-lm's
`generate_step`: step n+1 is dispatched (`mx.async_eval`, `forward.py`) before step n's
tokens are read back. A step is read before the next is built only when some row needs its
token for that (a grammar mask, a fast-forward span, a draft) or samples its first token.

A step reads as schedule (`_schedule`: release, admit, park), run (prefill, decode) and
postprocess (`_postprocess`: the `StepOutcome`); a request's start and end are `starting.py`'s,
rows joining and leaving the batch `parking.py`'s, what each row emits `outcome.py`'s.

A prompt's last token is not prefilled: the request joins the batch with it as its pending
input. A failure confined to one request (its grammar, fill session or checkpoint) ends
that request with `error`; anything else fails the step. Every call returns plain data.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import mlx.core as mx
import structlog

from engine import lanes, native, outcome
from engine.batch import DecodeBatch
from engine.compiled import compile_decode_step
from engine.errors import EngineInvariantError
from engine.forward import append_known, forward_drafts, forward_pending, grammar_mask, replay_accepted
from engine.known import KnownTokens
from engine.kv import caches
from engine.kv.attention import install as install_attention
from engine.kv.pool import BlockPool, paged_layers
from engine.kv.prefixes import PrefixEntries
from engine.kv.quantized import is_quantized, packed_nbytes, quantized_start
from engine.kv.tables import RequestBlocks
from engine.lora import AdapterBank
from engine.model.wired import WiredScope, model_bytes, recommended_working_set
from engine.parking import BatchRows
from engine.prefill import encode_unit, prefill_one, prefill_together
from engine.sequence import InFlight, Sequence, capture_checkpoints, capture_prompt_ends
from engine.speculation import Speculator
from engine.starting import Grammars, RequestStarts
from engine.warm_up import run_warm_up
from policies.layout import is_trimmable, paged_block_bytes
from protocols.config import LoraConfig
from protocols.errors import MlxrtError, error_code
from protocols.model import (
    AdmitRequest,
    CheckpointData,
    DeviceMemory,
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
        self._rows = BatchRows(layout, self._pool)
        # A lone row decodes uncompiled when quantized (traced: 12.5 vs 13.5 tok/s at 2,048) or
        # sharded (collectives stay out of traced functions).
        self._quantized = is_quantized(layout)
        # (A model whose rotary positions the engine passes, Qwen-VL's, decodes uncompiled.)
        explicit = getattr(model, "explicit_positions", False)
        self._decode_step = compile_decode_step(model, layout) if compiled and not self._quantized and not explicit else None
        # Quantized first chunks prefill together over full attention without a float head only.
        together = not self._quantized or (self._trimmable and quantized_start(layout) == 0)
        self._batched_prefill_limit = float("inf") if together else quantized_start(layout)
        # Metal: the weights stay wired while requests run, for a model over half the working set.
        self._wired = WiredScope(model_bytes(model), recommended_working_set())
        if self._wired.wanted:
            log.info("wired_limit_while_serving", weight_bytes=model_bytes(model), recommended_working_set=recommended_working_set())
        self._in_flight: InFlight | None = None
        self._num_steps = 0
        self._prefixes = PrefixEntries(layout, self._pool, self._trimmable)
        self._starts = RequestStarts(
            model, layout, grammars=grammars, to_text=decode, blocks=self._blocks, prefixes=self._prefixes, speculator=self._speculator, adapters=self.adapters
        )
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
        released, outputs = self._schedule(plan)
        failed = {output.request_id for output in outputs}
        prefilled = self._prefill([work for work in plan.prefill if work.request_id not in failed])
        if plan.decode:
            outputs += self._decode()
        return self._postprocess(started, outputs, prefilled, released)

    def _schedule(self, plan: StepPlan) -> tuple[list[str], list[RowOutput]]:
        """Release, admit, park and unpark, mark checkpoints due: the requests released, and the
        outputs of admissions that failed and of a step settled before a row parks."""
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
        return released, outputs

    def _postprocess(self, started: float, outputs: list[RowOutput], prefilled: list[PrefillReport], released: list[str]) -> StepOutcome:
        """Give memory back when idle, and report the step with the KV and device figures."""
        if not self._sequences:
            mx.clear_cache()
            self._wired.release()
        self._blocks.after_step()
        kv_bytes = self.kv_bytes()
        self._peak_bytes = max(self._peak_bytes, kv_bytes)
        checkpoints, self._checkpoints = self._checkpoints, []
        return StepOutcome(
            outputs=outputs,
            prefilled=prefilled,
            released=released,
            num_decode_rows=len(self._rows.batch),
            kv_tokens=self.kv_tokens(),
            kv_bytes=kv_bytes,
            kv_quantized_bytes=self.kv_quantized_bytes(),
            kv_pool=self.pool_stats(),
            kv_peak_bytes=self._peak_bytes,
            step_s=time.perf_counter() - started,
            saved_prefixes=self._prefixes.take_saved(),
            checkpoints=checkpoints,
            adapter_bytes=self.adapters.nbytes,
            device=DeviceMemory(active=mx.get_active_memory(), peak=mx.get_peak_memory(), cache=mx.get_cache_memory()),
        )

    @property
    def _batch(self) -> DecodeBatch:
        """The decode batch (tests read its rows)."""
        return self._rows.batch

    @property
    def batch_slots(self) -> list:
        """Every layer's slots of the decode batch (what a profiler patches)."""
        return self._rows.batch.slots

    @property
    def num_requests(self) -> int:
        """Requests admitted and not yet released."""
        return len(self._sequences)

    def warm_up(self, vocab_size: int) -> float:
        """Run the kinds of step serving runs on throwaway requests (`engine.warm_up`), so that
        MLX compiles their kernels now. Leaves no request, prefix entry or checkpoint behind;
        returns its seconds."""
        started = time.perf_counter()
        run_warm_up(self, vocab_size)
        self._peak_bytes = 0
        return time.perf_counter() - started

    def uncompiled(self) -> contextlib.AbstractContextManager[None]:
        """Decode a lone row through the model's own code for a while (a profiler times its
        pieces; a compiled step runs as one traced graph)."""
        return _without_compiled_step(self)

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
            self._starts.free(seq)
        self._sequences.clear()
        self.adapters.release_all()
        self._rows = BatchRows(self._layout, self._pool)
        if self._speculator.draft is not None:
            self._speculator.draft.reset()
        self._wired.release()
        self._in_flight = None
        self._checkpoints = []
        mx.clear_cache()

    def kv_tokens(self) -> dict[str, int]:
        tokens = {rid: seq.num_prefilled for rid, seq in self._sequences.items() if seq.cache is not None}
        tokens.update(zip(self._rows.batch.row_ids, self._rows.batch.lengths))
        return tokens

    def kv_quantized_bytes(self) -> int:
        """Of `kv_bytes`, the quantized KV's (`kv.bits`)."""
        if not self._quantized:
            return 0
        outside = [c for s in self._sequences.values() if s.cache is not None for c in s.cache]
        return packed_nbytes(outside) + self._prefixes.quantized_bytes() + packed_nbytes(self._rows.batch.slots)

    def kv_bytes(self) -> int:
        outside = sum(caches.nbytes(s.cache) for s in self._sequences.values() if s.cache is not None)
        draft = self._speculator.draft.nbytes if self._speculator.draft is not None else 0
        # (The pool's blocks held; its free ones are in `pool_stats`.)
        return outside + self._prefixes.nbytes + self._rows.batch.nbytes + self._blocks.used_bytes + draft

    def pool_stats(self) -> KvPool | None:
        if self._pool is None:  # (every step asks: no walk over the prefix entries without a pool)
            return None
        return self._blocks.stats(self.kv_tokens(), self._sequences.values(), self._prefixes.holders())

    # -- admission, parking, release ---------------------------------------------------------

    def _admit(self, admit: AdmitRequest) -> RowOutput | None:
        """Track a new request; a request that cannot start on its own account fails alone.
        Whatever its start took before it failed is given back (`RequestStarts.free`)."""
        if admit.request_id in self._sequences:
            raise EngineInvariantError(f"request {admit.request_id!r} admitted twice")
        # Entries used whole: besides the one at `prompt_len - 1` (`_prefill`: the same prompt
        # again), one of the whole prompt, for prompts that extend it (`_keep_prompt_ends`).
        prompt_end_due = admit.save_prefix and not self._trimmable
        seq = Sequence(admit=admit, stop_ids=frozenset(admit.stop_token_ids), prompt_end_due=prompt_end_due)
        try:
            self._starts.start(seq)
        except Exception as exc:
            self._starts.free(seq)
            if isinstance(exc, EngineInvariantError):
                raise
            code = error_code(exc) if isinstance(exc, MlxrtError) else None
            if code is None:
                log.exception("request_failed_at_admission", request_id=admit.request_id)
            return RowOutput(request_id=admit.request_id, token_ids=[], finish_reason="error", error=f"{type(exc).__name__}: {exc}", error_code=code)
        self._sequences[admit.request_id] = seq
        return None

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
            self._rows.park(seq)

    def _release(self, request_id: str, *, save_prefix: bool = True) -> bool:
        seq = self._sequences.get(request_id)
        if seq is None:
            return False
        if save_prefix:
            self._keep_kv(seq)
        if seq.in_batch:
            self._rows.remove(seq)
        self._starts.free(seq)
        del self._sequences[request_id]
        return True

    def _keep_kv(self, seq: Sequence) -> None:
        """Offer a leaving request's KV (prompt and everything fed) to the prefix cache."""
        if seq.admit.save_prefix and (kept := self._rows.kept_kv(seq, self._trimmable)) is not None:
            self._prefixes.save(seq, *kept)

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
        together = [group for group in self._rows.batch.unpadded_groups([n for _, n in first]) if len(group) > 1]
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
        if draft is not None and self._speculator.gate.allows(len(self._rows.batch) + len(seqs)):
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
        self._checkpoints += capture_checkpoints(self._sequences.values(), self._rows.batch, self._layout, in_flight)
        self._keep_prompt_ends(in_flight)
        dispatched = self._dispatch() if len(self._rows.batch) else None
        if self._in_flight is not None:
            outputs += self._collect(self._in_flight)
        self._in_flight = dispatched
        if dispatched is not None and dispatched.has_first_tokens:
            outputs += self._collect(dispatched)
            self._in_flight = None
            self._keep_prompt_ends([])  # (nothing in flight: reported with the first tokens)
        return outputs

    def _keep_prompt_ends(self, in_flight: list[Sequence]) -> None:
        """Offer the prefix cache the whole prompt's KV of rows that want it (when entries are
        used whole), as soon as a row holds exactly that: a prompt extending it then seeds from
        it and prefills only its new tokens (the entry at `prompt_len - 1` would leave the last
        token before them to prefill again). Taken as soon as a row's first token is read, or
        (a row that first holds its whole prompt on joining: resumed, unparked) before the next
        dispatch. A row ending after one token offers it on release instead."""
        for seq, kept in capture_prompt_ends(self._sequences.values(), self._rows.batch, in_flight):
            self._prefixes.save(seq, kept, seq.prompt_len)

    def _retire_exhausted(self) -> None:
        """Rows whose in-flight token is their last leave before the next dispatch."""
        in_flight = {id(seq) for seq in self._in_flight.rows} if self._in_flight is not None else set()
        for rid in list(self._rows.batch.row_ids):
            seq = self._sequences[rid]
            if seq.num_generated + (id(seq) in in_flight) >= seq.admit.max_tokens:
                self._keep_kv(seq)
                self._rows.remove(seq)

    def _join_ready(self) -> None:
        for seq in self._sequences.values():
            if seq.is_ready:
                self._rows.join(seq)

    def _dispatch(self) -> InFlight:
        """One decode step. Rows with known tokens to append (jump-forward, fast-forward, a
        rejoin) first forward all of them but the last in one step over just those rows;
        then the whole batch forwards one token each, so other rows never pay for padding."""
        batch = self._rows.batch
        rows = [self._sequences[rid] for rid in batch.row_ids]
        self._speculator.propose(rows, self._rows.sampler.rows, batch.lengths)
        appending = [i for i, seq in enumerate(rows) if seq.extra]
        assert self._rows.pending is not None
        pending, sub_logits = self._rows.pending, None
        if appending and all(rows[i].draft is not None for i in appending):
            sub_logits, logits = forward_drafts(self._model, self._rows.batch, rows, appending, pending)
        else:
            if appending:
                pending, sub_logits = append_known(self._model, self._rows.batch, self._rows.sampler, rows, appending, pending)
            logits = forward_pending(self._model, self._rows.batch, self._decode_step, rows, pending)
        in_flight = InFlight(rows=rows)
        check = None
        if sub_logits is not None:
            self._known.trace_choices(rows, appending, sub_logits, in_flight)
            checked = self._speculator.check(rows, appending, sub_logits, logits, logits.shape[-1])
            if checked is not None:
                check, in_flight.verified = checked
                in_flight.verified_sampling = [self._rows.sampler.rows[i] for i in check.rows]
        result = self._rows.sampler.sample(logits, mask=grammar_mask(self._grammars, rows), check=check)
        for seq in rows:
            seq.extra = []
        self._rows.pending = result.tokens
        in_flight.result = result
        in_flight.accepted = result.accepted
        mx.async_eval(result.arrays() + [a for a in (in_flight.choices,) if a is not None])
        self._num_steps += 1
        if self._num_steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return in_flight

    def _collect(self, in_flight: InFlight) -> list[RowOutput]:
        """Read a dispatched step back: each row's output, its request released when it ends."""
        read = outcome.read_step(in_flight)
        outputs = []
        for i, seq in enumerate(in_flight.rows):
            if self._sequences.get(seq.request_id) is not seq:
                continue  # released since the dispatch (its id may even be reused by now)
            if read.exhausted[i]:
                outputs.append(self._end(seq, outcome.exhausted(seq), save_prefix=False))
                continue
            try:
                if seq.failure is not None:
                    raise RuntimeError(seq.failure)
                if seq.draft is not None and id(seq) in read.accepted:
                    agreed = self._speculator.settle(seq, self._rows.batch, read.accepted[id(seq)])
                else:
                    agreed = self._known.settle(seq, self._rows.batch, read.accepted, read.choices)
                if seq.snapshot is not None:
                    replay_accepted(self._model, self._rows.batch, seq, len(agreed))
                logprob = read.logprobs[i] if read.logprobs else None
                outputs.append(self._end(seq, outcome.account(seq, read.tokens[i], logprob, agreed, self._known)))
            except Exception as exc:  # this request's grammar or fill session: it alone ends
                log.exception("request_failed", request_id=seq.request_id)
                outputs.append(self._end(seq, outcome.failed(seq, exc), save_prefix=False))
        return outputs

    def _end(self, seq: Sequence, output: RowOutput, *, save_prefix: bool = True) -> RowOutput:
        """Release the request when its output ends it."""
        if output.finish_reason is not None:
            self._release(seq.request_id, save_prefix=save_prefix)
        return output


@contextlib.contextmanager
def _without_compiled_step(engine: Engine) -> Iterator[None]:
    step, engine._decode_step = engine._decode_step, None
    try:
        yield
    finally:
        engine._decode_step = step
