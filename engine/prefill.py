"""Prompt chunks into a request's own cache (MLX thread): one request's chunk, or the first
chunks of several prompts in one forward through mlx-lm's batch caches."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.kv.quantized import batch_prefill_caches, new_caches, quantized_caches
from engine.lora import routed
from engine.sequence import Sequence
from protocols.model import LayerLayout


def prefill_one(model, layout: list[LayerLayout], seq: Sequence, num_tokens: int) -> None:
    start, end = seq.num_prefilled, seq.num_prefilled + num_tokens
    if seq.cache is None:
        seq.cache = new_caches(model, layout)
    with routed(model, [seq.adapter_slot]):
        model(mx.array(seq.admit.prompt_ids[start:end])[None], cache=seq.cache)
    mx.eval([c.state for c in seq.cache])
    seq.num_prefilled = end


def prefill_together(model, layout: list[LayerLayout], trimmable: bool, chunks: list[tuple[Sequence, int]]) -> None:
    """First chunks of several prompts in one forward through mlx-lm's batch caches, each row
    then extracted as its own cache. Full-attention models pad on the left; sliding windows on
    the right, with each row's length passed to the caches (which roll the windows back into
    place), as mlx-lm's BatchGenerator does; recurrent ones never pad. With quantized KV and
    full attention only, each position is stored quantized (`BatchQuantizedKV`); otherwise only
    chunks that stay below `kv.quantized_start` come here (float), quantized once extracted."""
    tokens = [seq.admit.prompt_ids[:n] for seq, n in chunks]
    width = max(n for _, n in chunks)
    padding = [width - n for _, n in chunks]
    cache: list
    with routed(model, [seq.adapter_slot for seq, _ in chunks]):
        if trimmable:
            cache = batch_prefill_caches(layout, padding)
            model(mx.array([[0] * pad + t for pad, t in zip(padding, tokens)]), cache=cache)
        else:
            fresh = [make_prompt_cache(model) for _ in chunks]
            cache = [type(layer[0]).merge(list(layer)) for layer in zip(*fresh)]
            if max(padding):
                for c in cache:
                    c.prepare(lengths=[n for _, n in chunks], right_padding=padding)
            model(mx.array([t + [0] * pad for pad, t in zip(padding, tokens)]), cache=cache)
            if max(padding):
                for c in cache:
                    c.finalize()
    mx.eval([c.state for c in cache])
    for row, (seq, n) in enumerate(chunks):
        seq.cache = quantized_caches([c.extract(row) for c in cache], layout)
        seq.num_prefilled = n
