"""Decode batches built by hand for the engine's tests: each prompt's KV prefilled by mlx-lm's own
forward into a `DecodeBatch` (slot rows, `slot_batch`; or rows over a block pool whose blocks are
split, `paged_batch`), and one op-by-op decode step over such a batch (`op_step`): what the engine's
compiled steps and fused appends are compared with."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.batch import DecodeBatch
from engine.kv.pool import BlockPool


def slot_batch(model, geometry, prompts: list[list[int]]):
    """A decode batch holding each prompt's KV but its last token (as the engine joins rows)."""
    batch = DecodeBatch(geometry)
    for i, prompt in enumerate(prompts):
        cache = make_prompt_cache(model)
        model(mx.array(prompt[:-1])[None], cache=cache)
        batch.add_row(f"r{i}", cache, len(prompt) - 1)
    return batch


def op_step(model, batch, tokens: list[int]):
    """The last position's logits of one token per row, forwarded op by op over the batch's layers."""
    batch.begin_step([1] * len(tokens))
    logits = model(mx.array(tokens, dtype=mx.uint32)[:, None], cache=batch.layers)[:, -1, :]
    batch.end_step()
    return logits


def paged_batch(model, layout, prompts: list[list[int]]):
    """A paged decode batch (its own pool) holding each prompt's KV but its last token, each
    row's blocks split by a block held elsewhere (so no row's positions run contiguously)."""
    pool = BlockPool(layout)
    batch = DecodeBatch(layout, pool)
    for i, prompt in enumerate(prompts):
        table = pool.allocate(2)
        pool.allocate(1)  # (held by no row: the table's next blocks come after it)
        cache = make_prompt_cache(model)
        model(mx.array(prompt[:-1])[None], cache=cache)
        batch.add_row(f"r{i}", cache, len(prompt) - 1, table=table)
    return batch
