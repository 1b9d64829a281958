"""How a decode step's inputs go through the model, and what it reads back (MLX thread).

The engine decides what each row forwards this step; these functions run it: every row's
pending token (compiled for a lone row), rows that check a draft forwarding it whole with the
others' pending tokens, known tokens appended before the batch's one-token step, the
grammar bitmask rows, and the host readback of tokens and log-probabilities.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import numpy as np
import structlog
import torch

from engine.batch import DecodeBatch
from engine.lora import routed
from engine.sampler import BatchSampler, SampleResult
from engine.sequence import Sequence
from protocols.api import TokenLogprob, TopLogprob

log = structlog.get_logger(actor="engine")


def forward_pending(model, batch: DecodeBatch, decode_step, rows: list[Sequence], pending: mx.array) -> mx.array:
    """The whole batch forwards its pending tokens, one each; returns their logits."""
    if (len(rows) == 1 or batch.paged) and decode_step is not None and not any(seq.adapter_slot for seq in rows):
        # The compiled step (no per-step graph build: a few ms of Python the CPU backend cannot
        # overlap with compute) for a lone row (~6-10% faster per token on CPU) and for a batch
        # over paged KV, whose rows attend over their own positions in place (mlxrt's paged
        # attention kernel): SmolLM2 Q4's c4 step 26 -> 19 ms, c16 71 -> 57 ms. A batch over
        # per-row buffers builds the graph: attending over the whole capacity cost it more KV
        # reads than the build saves (c16 0.90x vs 1.01x of mlx-lm, measured). (A row with an
        # adapter builds it: the traced step holds no adapter deltas.)
        return batch.forward_one(decode_step, pending)
    batch.begin_step([1] * len(rows))
    with routed(model, [seq.adapter_slot for seq in rows]):
        logits = model(pending[:, None], cache=batch.layers)[:, -1, :]
    batch.end_step()
    return logits


def forward_drafts(model, batch: DecodeBatch, rows: list[Sequence], drafting: list[int], pending: mx.array) -> tuple[mx.array, mx.array]:
    """The rows that check a draft forward it whole, with the other rows' pending tokens, in
    one step (right-padded: on this backend a forward's cost is mostly its weight reads, not
    its width). Returns the drafting rows' logits at every position and each row's logits at
    its last position (what it samples)."""
    firsts = host(pending)
    inputs = [[firsts[i], *rows[i].extra] for i in range(len(rows))]
    snapshot_spans(batch, rows, drafting, inputs)
    with routed(model, [seq.adapter_slot for seq in rows]):
        logits = batch.forward_rows(model, list(range(len(rows))), inputs)
    last = logits[mx.arange(len(rows)), mx.array([len(tokens) - 1 for tokens in inputs])]
    return logits[mx.array(drafting, dtype=mx.int32)], last


def append_known(model, batch: DecodeBatch, sampler: BatchSampler, rows: list[Sequence], appending: list[int], pending: mx.array) -> tuple[mx.array, mx.array]:
    """Forward the known tokens of some rows but the last of each, which becomes their
    pending input; returns the new pending inputs and the appended positions' logits."""
    firsts = host(pending)
    inputs = [[firsts[i], *rows[i].extra[:-1]] for i in appending]
    snapshot_spans(batch, rows, appending, [firsts[i : i + 1] for i in range(len(rows))])
    with routed(model, [rows[i].adapter_slot for i in appending]):
        sub_logits = batch.forward_rows(model, appending, inputs)
    for i in appending:
        firsts[i] = rows[i].extra[-1]
    # Penalties see appended tokens like sampled ones (an echo span's only once accepted).
    sampler.advance({i: rows[i].extra for i in appending if rows[i].verify is None and rows[i].draft is None})
    return mx.array(firsts, dtype=mx.uint32), sub_logits


def replay_accepted(model, batch: DecodeBatch, seq: Sequence, accepted: int) -> None:
    """After a checked span on a recurrent model: the state must have seen only the accepted
    prefix. Restore the state from before the span and forward that prefix again (its KV is
    rewritten unchanged); nothing to do when the whole span was accepted."""
    saved, forwarded = seq.snapshot, seq.replay
    seq.snapshot, seq.replay = None, []
    if saved is None or accepted + 1 == len(forwarded):  # the whole span: the state is right
        return
    tokens, rid = forwarded[: accepted + 1], seq.request_id
    batch.restore(rid, saved)
    batch.rewind(rid, len(tokens))
    with routed(model, [seq.adapter_slot]):
        batch.forward_rows(model, [batch.index(rid)], [tokens])


def snapshot_spans(batch: DecodeBatch, rows: list[Sequence], appending: list[int], inputs: list[list[int]]) -> None:
    """A recurrent state cannot be rewound: rows forwarding a span that may be cut keep their
    state to replay the accepted prefix."""
    if not batch.has_state:
        return
    for i in appending:
        seq = rows[i]
        if seq.verify is not None or seq.draft is not None:
            seq.snapshot, seq.replay = batch.snapshot(seq.request_id), [inputs[i][0], *seq.extra]


def grammar_mask(grammars, rows: list[Sequence]) -> mx.array | None:
    """Allowed-token bitmask rows from each grammar's state (all allowed elsewhere). A row
    whose matcher fails is marked failed and left unconstrained: it ends when read."""
    if not any(seq.matcher is not None for seq in rows):
        return None
    assert grammars is not None
    bitmask = np.full((len(rows), (grammars.vocab_size + 31) // 32), -1, dtype=np.int32)
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


def host(array: mx.array) -> list[Any]:
    """A device array's values as a Python list (the one host round trip of a step)."""
    return cast(list[Any], array.tolist())


def read_logprobs(result: SampleResult, tokens: list[int]) -> list[TokenLogprob] | None:
    if result.logprobs is None:
        return None
    chosen = host(result.logprobs)
    if result.top_ids is None or result.top_logprobs is None:
        return [TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(tokens, chosen)]
    top_ids, top_lps = host(result.top_ids), host(result.top_logprobs)
    out = []
    for t, lp, ids, lps in zip(tokens, chosen, top_ids, top_lps):
        top = sorted((TopLogprob(token_id=i, logprob=v) for i, v in zip(ids, lps)), key=lambda x: -x.logprob)
        out.append(TokenLogprob(token_id=t, logprob=lp, top=top))
    return out
