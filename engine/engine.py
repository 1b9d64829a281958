"""The engine: executes the scheduler's step plans on the MLX thread.

Owns every per-request array: prefill caches (mlx-lm `KVCache`s, chunk by chunk,
first chunks of several requests batched), the decode batch's KV slots, the batch
sampler state, the in-flight step, saved prefix entries, and parked rows. A plan
is applied in order: release, admit, park/unpark, prefill, decode, checkpoints.
Decode is pipelined like mlx-lm's `generate_step`: step n+1 is dispatched
(`mx.async_eval`) before step n's tokens are read back, so the only host round-trip
per step is one `tolist()` of already-computed ids. A step is read before the next
is built only when some row needs its token for that (a grammar mask, a fast-forward
span) or samples its first token (early token zero).

A prompt's last token is not prefilled: the request joins the batch with it as
its pending input, and the batched decode step computes the logits of that one
position only. A failure confined to one request (its grammar, fill session or
checkpoint) ends that request with `error`; anything else fails the step. Every
call returns plain Python data.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol, cast

import mlx.core as mx
import numpy as np
import structlog
import torch
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from engine import caches
from engine.batch import DecodeBatch
from engine.compiled import compile_decode_step
from engine.known import KnownTokens
from engine.sampler import BatchSampler, RowSampling, SampleResult
from engine.sequence import EngineInvariantError, InFlight, Sequence
from engine.speculation import Speculator
from policies.fill_session import FillSession
from policies.layout import is_trimmable
from protocols.api import FillStats, TokenLogprob, TopLogprob
from protocols.model import (
    AdmitRequest,
    CheckpointData,
    GrammarSpec,
    LayerLayout,
    PrefillReport,
    PrefillWork,
    RowOutput,
    SavedPrefix,
    StepOutcome,
    StepPlan,
)

CLEAR_CACHE_EVERY = 256

log = structlog.get_logger(actor="engine")

__all__ = ["Engine", "EngineInvariantError", "Grammars"]


class Grammars(Protocol):
    """What the engine needs of the grammar compiler: matchers for grammars compiled (and
    pinned) before their requests were admitted. It never compiles on the MLX thread."""

    vocab_size: int

    def matcher(self, spec: GrammarSpec) -> Any: ...


class Engine:
    """Runs plans against one model. Not thread-safe: the MLX thread only."""

    def __init__(self, model, layout: list[LayerLayout], grammars: Grammars | None = None, decode=None, speculator: Speculator | None = None):
        self._model = model
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
        self._batch = DecodeBatch(layout)
        self._decode_step = compile_decode_step(model, layout)
        self._sampler = BatchSampler()
        self._pending: mx.array | None = None
        self._in_flight: InFlight | None = None
        self._num_steps = 0
        # Saved prefixes by entry id: per-layer KVCaches whose length is the entry's.
        # Saved prefixes by entry id: per-layer caches, and the positions they cover.
        self._prefixes: dict[str, tuple[list, int]] = {}
        self._saved: list[SavedPrefix] = []
        self._checkpoints: list[CheckpointData] = []
        self._num_saved = 0
        self._prefix_bytes = 0

    def step(self, plan: StepPlan) -> StepOutcome:
        """Apply one plan; see the module docstring for the order."""
        if threading.current_thread() is not self._thread:
            raise EngineInvariantError("the engine was called off its MLX thread")
        started = time.perf_counter()
        released = [rid for rid in plan.release if self._release(rid)]
        outputs = [refused for admit in plan.admit if (refused := self._admit(admit)) is not None]
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
            checkpoints=self._take_checkpoint_list(),
        )

    def _take_checkpoint_list(self) -> list[CheckpointData]:
        taken, self._checkpoints = self._checkpoints, []
        return taken

    def drop_prefixes(self, entry_ids: list[str]) -> None:
        for entry_id in entry_ids:
            entry = self._prefixes.pop(entry_id, None)
            if entry is not None:
                self._prefix_bytes -= caches.nbytes(entry[0])

    def reset(self) -> None:
        """Drop every request (after a failed step)."""
        self._sequences.clear()
        self._batch = DecodeBatch(self._layout)
        if self._speculator.draft is not None:
            self._speculator.draft.reset()
        self._sampler = BatchSampler()
        self._pending = None
        self._in_flight = None
        self._checkpoints = []
        mx.clear_cache()

    def kv_tokens(self) -> dict[str, int]:
        tokens = {rid: seq.num_prefilled for rid, seq in self._sequences.items() if seq.cache is not None}
        tokens.update(zip(self._batch.row_ids, self._batch.lengths))
        return tokens

    def kv_bytes(self) -> int:
        outside = sum(caches.nbytes(s.cache) for s in self._sequences.values() if s.cache is not None)
        draft = self._speculator.draft.nbytes if self._speculator.draft is not None else 0
        return outside + self._prefix_bytes + self._batch.nbytes + draft

    # -- admission, parking, release ---------------------------------------------------------

    def _admit(self, admit: AdmitRequest) -> RowOutput | None:
        """Track a new request; a request that cannot start on its own account fails alone."""
        if admit.request_id in self._sequences:
            raise EngineInvariantError(f"request {admit.request_id!r} admitted twice")
        try:
            seq = self._new_sequence(admit)
        except EngineInvariantError:
            raise
        except Exception as exc:
            log.exception("request_failed_at_admission", request_id=admit.request_id)
            return RowOutput(request_id=admit.request_id, token_ids=[], finish_reason="error", error=f"{type(exc).__name__}: {exc}")
        self._sequences[admit.request_id] = seq
        return None

    def _new_sequence(self, admit: AdmitRequest) -> Sequence:
        seq = Sequence(admit=admit, stop_ids=frozenset(admit.stop_token_ids))
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
            seq.cache = caches.from_tensors(admit.resume.kv_tensors, self._layout, admit.resume.num_kv_tokens)
            seq.num_prefilled = admit.resume.num_kv_tokens
        elif admit.prefix_entry is not None:
            entry, n = self._prefixes.get(admit.prefix_entry), admit.prefix_tokens
            if entry is None or not 0 < n <= min(entry[1], len(admit.prompt_ids) - 1) or (not self._trimmable and n != entry[1]):
                raise EngineInvariantError(f"prefix {admit.prefix_entry!r} cannot seed {n} tokens")
            seq.cache, seq.num_prefilled = caches.prefix_view(entry[0], n), n
        if admit.spec is not None:
            self._speculator.start(seq)
        return seq

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
        self._speculator.release(request_id)
        del self._sequences[request_id]
        return True

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
            self._save_prefix(seq, kept if verified == length else caches.trimmed(kept, verified), verified)
        elif seq.cache is not None and seq.num_prefilled:
            self._save_prefix(seq, caches.trimmed(seq.cache, seq.num_prefilled), seq.num_prefilled)

    def _save_prefix(self, seq: Sequence, kept: list, length: int) -> None:
        """Keep KV as a prefix entry; the KV store decides whether it stays."""
        self._num_saved += 1
        entry_id = f"{seq.request_id}#{self._num_saved}"
        self._prefixes[entry_id] = (kept, length)
        num_bytes = caches.nbytes(kept)
        self._prefix_bytes += num_bytes
        self._saved.append(SavedPrefix(entry_id=entry_id, tokens=seq.tokens_with_kv(length), num_bytes=num_bytes))

    # -- prefill -----------------------------------------------------------------------------

    def _prefill(self, works: list[PrefillWork]) -> list[PrefillReport]:
        """Forward prompt chunks. First chunks go through batched forwards (padded, or for
        models with recurrent layers only chunks of one length together); later chunks extend
        their request's own cache one at a time."""
        seqs = [self._prefill_target(work) for work in works]
        first = [(s, w.num_tokens) for s, w in zip(seqs, works) if s.num_prefilled == 0]
        together = [group for group in self._batch.unpadded_groups([n for _, n in first]) if len(group) > 1]
        batched = {id(first[i][0]) for group in together for i in group}
        for seq, work in zip(seqs, works):
            if id(seq) not in batched:
                self._prefill_one(seq, work.num_tokens)
        for group in together:
            self._prefill_together([first[i] for i in group])
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
                self._save_prefix(seq, caches.trimmed(seq.cache, seq.num_prefilled), seq.num_prefilled)
        return [PrefillReport(request_id=s.request_id, processed_tokens=s.num_prefilled, total_tokens=s.prompt_len) for s in seqs]

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
        """First chunks of several prompts in one forward through mlx-lm's batch caches, each
        row then extracted as its own cache. Full-attention models pad on the left; sliding
        windows on the right, with each row's length passed to the caches (which roll the
        windows back into place), as mlx-lm's BatchGenerator does; recurrent ones never pad."""
        tokens = [seq.admit.prompt_ids[:n] for seq, n in chunks]
        width = max(n for _, n in chunks)
        padding = [width - n for _, n in chunks]
        if self._trimmable:
            cache: list = [BatchKVCache(padding) for _ in self._layout]
            self._model(mx.array([[0] * pad + t for pad, t in zip(padding, tokens)]), cache=cache)
        else:
            fresh = [make_prompt_cache(self._model) for _ in chunks]
            cache = [type(layer[0]).merge(list(layer)) for layer in zip(*fresh)]
            if max(padding):
                for c in cache:
                    c.prepare(lengths=[n for _, n in chunks], right_padding=padding)
            self._model(mx.array([t + [0] * pad for pad, t in zip(padding, tokens)]), cache=cache)
            if max(padding):
                for c in cache:
                    c.finalize()
        mx.eval([c.state for c in cache])
        for row, (seq, n) in enumerate(chunks):
            seq.cache = [c.extract(row) for c in cache]
            seq.num_prefilled = n

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
        self._capture_checkpoints()
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
            sub_logits, logits = self._forward_drafts(rows, appending, pending)
        else:
            if appending:
                pending, sub_logits = self._append_known(rows, appending, pending)
            logits = self._forward_pending(rows, pending)
        in_flight = InFlight(rows=rows)
        check = None
        if sub_logits is not None:
            self._known.trace_choices(rows, appending, sub_logits, in_flight)
            checked = self._speculator.check(rows, appending, sub_logits, logits, logits.shape[-1])
            if checked is not None:
                check, in_flight.verified = checked
                in_flight.verified_sampling = [self._sampler.rows[i] for i in check.rows]
        result = self._sampler.sample(logits, mask=self._grammar_mask(rows), check=check)
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

    def _forward_pending(self, rows: list[Sequence], pending: mx.array) -> mx.array:
        """The whole batch forwards its pending tokens, one each; returns their logits."""
        if len(rows) == 1 and self._decode_step is not None:
            # A lone row: the compiled step (no per-step graph build) is ~6-10% faster per token
            # on CPU. Batches build the graph: attending over the whole capacity costs them more
            # KV reads than the build saves (c16 0.90x vs 1.01x of mlx-lm, measured).
            return self._batch.forward_one(self._decode_step, pending)
        self._batch.begin_step([1] * len(rows))
        logits = self._model(pending[:, None], cache=self._batch.layers)[:, -1, :]
        self._batch.end_step()
        return logits

    def _forward_drafts(self, rows: list[Sequence], drafting: list[int], pending: mx.array) -> tuple[mx.array, mx.array]:
        """The rows that check a draft forward it whole, with the other rows' pending tokens,
        in one step (right-padded: on this backend a forward's cost is mostly its weight
        reads, not its width). Returns the drafting rows' logits at every position and each
        row's logits at its last position (what it samples)."""
        firsts = _host(pending)
        inputs = [[firsts[i], *rows[i].extra] for i in range(len(rows))]
        self._snapshot_spans(rows, drafting, inputs)
        logits = self._batch.forward_rows(self._model, list(range(len(rows))), inputs)
        last = logits[mx.arange(len(rows)), mx.array([len(tokens) - 1 for tokens in inputs])]
        return logits[mx.array(drafting, dtype=mx.int32)], last

    def _snapshot_spans(self, rows: list[Sequence], appending: list[int], inputs: list[list[int]]) -> None:
        """A recurrent state cannot be rewound: rows forwarding a span that may be cut keep
        their state to replay the accepted prefix."""
        if not self._batch.has_state:
            return
        for i in appending:
            seq = rows[i]
            if seq.verify is not None or seq.draft is not None:
                seq.snapshot, seq.replay = self._batch.snapshot(seq.request_id), [inputs[i][0], *seq.extra]

    def _append_known(self, rows: list[Sequence], appending: list[int], pending: mx.array) -> tuple[mx.array, mx.array]:
        """Forward the known tokens of some rows but the last of each, which becomes their
        pending input; returns the new pending inputs and the appended positions' logits."""
        firsts = _host(pending)
        inputs = [[firsts[i], *rows[i].extra[:-1]] for i in appending]
        self._snapshot_spans(rows, appending, [firsts[i : i + 1] for i in range(len(rows))])
        sub_logits = self._batch.forward_rows(self._model, appending, inputs)
        for i in appending:
            firsts[i] = rows[i].extra[-1]
        # Penalties see appended tokens like sampled ones (an echo span's only once accepted).
        self._sampler.advance({i: rows[i].extra for i in appending if rows[i].verify is None and rows[i].draft is None})
        return mx.array(firsts, dtype=mx.uint32), sub_logits

    def _grammar_mask(self, rows: list[Sequence]) -> mx.array | None:
        """Allowed-token bitmask rows from each grammar's state (all allowed elsewhere). A row
        whose matcher fails is marked failed and left unconstrained: it ends when read."""
        if not any(seq.matcher is not None for seq in rows):
            return None
        assert self._grammars is not None
        bitmask = np.full((len(rows), (self._grammars.vocab_size + 31) // 32), -1, dtype=np.int32)
        tensor = torch.from_numpy(bitmask)
        for i, seq in enumerate(rows):
            if seq.matcher is not None and seq.failure is None:
                try:
                    seq.matcher.fill_next_token_bitmask(tensor, i)
                except Exception as exc:
                    log.exception("grammar_mask_failed", request_id=seq.request_id)
                    seq.failure = f"the grammar failed: {type(exc).__name__}: {exc}"
                    bitmask[i] = -1
        return mx.array(bitmask)

    def _collect(self, in_flight: InFlight) -> list[RowOutput]:
        assert in_flight.result is not None
        result = in_flight.result
        tokens = _host(result.tokens)
        logprobs = _read_logprobs(result, tokens)
        choices = dict(zip(map(id, in_flight.appended), _host(in_flight.choices))) if in_flight.choices is not None else {}
        accepted = dict(zip(map(id, in_flight.verified), _host(in_flight.accepted))) if in_flight.accepted is not None else {}
        for sampling, seq in zip(in_flight.verified_sampling, in_flight.verified):
            sampling.num_sampled += accepted[id(seq)]  # a checked span's kept tokens were sampled too
        outputs = []
        for i, seq in enumerate(in_flight.rows):
            if self._sequences.get(seq.request_id) is not seq:
                continue  # released since the dispatch (its id may even be reused by now)
            try:
                if seq.failure is not None:
                    raise RuntimeError(seq.failure)
                if seq.draft is not None and id(seq) in accepted:
                    agreed = self._speculator.settle(seq, self._batch, accepted[id(seq)])
                else:
                    agreed = self._known.settle(seq, self._batch, accepted, choices)
                if seq.snapshot is not None:
                    self._replay(seq, len(agreed))
                outputs.append(self._account(seq, tokens[i], logprobs[i] if logprobs else None, agreed))
            except Exception as exc:  # this request's grammar or fill session: it alone ends
                log.exception("request_failed", request_id=seq.request_id)
                outputs.append(self._fail(seq, exc))
        return outputs

    def _replay(self, seq: Sequence, accepted: int) -> None:
        """After an echo span on a recurrent model: the state must have seen only the accepted
        prefix. Restore the state from before the span and forward that prefix again (its KV is
        rewritten unchanged); nothing to do when the whole span was accepted."""
        saved, forwarded = seq.snapshot, seq.replay
        seq.snapshot, seq.replay = None, []
        if saved is None or accepted + 1 == len(forwarded):  # the whole span: the state is right
            return
        tokens, rid = forwarded[: accepted + 1], seq.request_id
        self._batch.restore(rid, saved)
        self._batch.rewind(rid, len(tokens))
        self._batch.forward_rows(self._model, [self._batch.index(rid)], [tokens])

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

    def _fail(self, seq: Sequence, exc: Exception) -> RowOutput:
        """End one request with `error`; its KV is not kept (its state is suspect)."""
        self._release(seq.request_id, save_prefix=False)
        return RowOutput(request_id=seq.request_id, token_ids=[], finish_reason="error", error=str(exc) or type(exc).__name__)

    # -- checkpoints -------------------------------------------------------------------------

    def _capture_checkpoints(self) -> None:
        """Capture the checkpoints that are due and possible now, between a step's read and the
        next dispatch: a row's state then covers exactly its context but the last token (the
        pending input). A row with a token in flight or known tokens waiting is taken at the
        next chance. A failed capture skips that checkpoint and is logged, never fails the step."""
        in_flight = {id(seq) for seq in self._in_flight.rows} if self._in_flight is not None else set()
        for seq in self._sequences.values():
            if not (seq.checkpoint_due and seq.in_batch and seq.generated and not seq.extra) or id(seq) in in_flight:
                continue
            seq.checkpoint_due = False
            num_kv = len(seq.context) - 1
            try:
                if self._batch.lengths[self._batch.index(seq.request_id)] != num_kv:
                    raise EngineInvariantError(f"row holds {self._batch.lengths[self._batch.index(seq.request_id)]} positions, expected {num_kv}")
                tensors = caches.to_tensors(self._batch.extract(seq.request_id), self._layout, num_kv)
            except Exception:
                log.exception("checkpoint_failed", request_id=seq.request_id)
                continue
            self._checkpoints.append(CheckpointData(request_id=seq.request_id, generated=list(seq.generated), num_kv_tokens=num_kv, kv_tensors=tensors))


def _host(array: mx.array) -> list[Any]:
    """A device array's values as a Python list (the one host round trip of a step)."""
    return cast(list[Any], array.tolist())


def _read_logprobs(result: SampleResult, tokens: list[int]) -> list[TokenLogprob] | None:
    if result.logprobs is None:
        return None
    chosen = _host(result.logprobs)
    if result.top_ids is None or result.top_logprobs is None:
        return [TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(tokens, chosen)]
    top_ids, top_lps = _host(result.top_ids), _host(result.top_logprobs)
    out = []
    for t, lp, ids, lps in zip(tokens, chosen, top_ids, top_lps):
        top = sorted((TopLogprob(token_id=i, logprob=v) for i, v in zip(ids, lps)), key=lambda x: -x.logprob)
        out.append(TokenLogprob(token_id=t, logprob=lp, top=top))
    return out
