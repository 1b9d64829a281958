"""Prompt chunks into a request's own cache (MLX thread): one request's chunk, or the first
chunks of several prompts in one forward through mlx-lm's batch caches.

Only the KV is evaluated, so no logits are computed for prompt positions, unless a request
asks for its prompt's log-probabilities (`AdmitRequest.prompt_logprobs`): then its chunk's
logits are read too, each position scoring the prompt token after it."""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.forward import host
from engine.kv.quantized import batch_prefill_caches, new_caches, quantized_caches
from engine.lora import routed
from engine.sequence import Sequence
from protocols.api import TokenLogprob, TopLogprob
from protocols.model import LayerLayout

# A unit budget no tower reaches: the rest of it in one unit.
WHOLE_TOWER = 1 << 40


def prefill_one(model, layout: list[LayerLayout], seq: Sequence, num_tokens: int) -> None:
    start, end = seq.num_prefilled, seq.num_prefilled + num_tokens
    if seq.cache is None:
        seq.cache = new_caches(model, layout)
    inputs = mx.array(seq.admit.prompt_ids[start:end])[None]
    extra = {}
    if (embeds := _vision_embeds(model, seq, start, end)) is not None:
        extra["input_embeddings"] = embeds
    if seq.vision_positions is not None:
        extra["positions"] = seq.vision_positions[:, :, start:end]
    started = time.perf_counter()
    with routed(model, [seq.adapter_slot]):
        logits = model(inputs, cache=seq.cache, **extra)
    mx.eval([c.state for c in seq.cache])
    _note_time(model, num_tokens, started)
    _score_prompt(seq, logits[0], start, end)
    seq.num_prefilled = end


def _note_time(model, num_tokens: int, started: float) -> None:
    """A vision model sizes its tower's units by how long prefill chunks take (`note_prefill`)."""
    if (note := getattr(model, "note_prefill", None)) is not None:
        note(num_tokens, time.perf_counter() - started)


def encode_unit(model, seq: Sequence, budget_tokens: int) -> bool:
    """One unit of an image prompt's vision tower, worth about `budget_tokens` prompt tokens
    of compute (`PrefillWork.encode`); True while units remain. Nothing to do (a prefix hit
    past the images, a tower already run) is no unit."""
    vision = seq.admit.vision
    if seq.vision_embeds is not None or vision is None or not vision.needs_tower(seq.admit.prompt_ids, seq.num_prefilled):
        return False
    if seq.tower is None:
        seq.tower = model.start_tower(seq.admit.prompt_ids, vision.arrays)
    if seq.tower.advance(budget_tokens):
        seq.vision_embeds, seq.tower = seq.tower.embeds, None
        return False
    return True


def _vision_embeds(model, seq: Sequence, start: int, end: int) -> mx.array | None:
    """An image prompt's input embeddings for positions start:end, from its tower's units
    (`encode_unit`; run whole here if a chunk comes first); None once prefill has passed the
    last image position (a prefix hit past the images never runs it: the KV holds them)."""
    vision = seq.admit.vision
    if vision is None:
        return None
    image_end = vision.image_end(seq.admit.prompt_ids)
    if start >= image_end:
        return None
    if seq.vision_embeds is None:
        encode_unit(model, seq, budget_tokens=WHOLE_TOWER)
    # A copy: some models scale their input embeddings in place.
    chunk = mx.array(seq.vision_embeds[:, start:end])
    if end >= image_end:
        seq.vision_embeds = None  # no image positions left to prefill
    return chunk


def _score_prompt(seq: Sequence, logits: mx.array, start: int, end: int) -> None:
    """The log-probabilities of prompt tokens start + 1 .. end from the logits of positions
    start .. end - 1 (the prompt's last token is never prefilled: token `end` exists)."""
    k = seq.admit.prompt_logprobs
    if k is None:
        return
    logits = logits.astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    scored = seq.admit.prompt_ids[start + 1 : end + 1]
    chosen = mx.take_along_axis(lp, mx.array(scored)[:, None], axis=-1)[:, 0]
    ranks = host((lp > chosen[:, None]).sum(axis=-1) + 1)
    if not k:
        seq.prompt_logprobs += [TokenLogprob(token_id=t, logprob=v, rank=r) for t, v, r in zip(scored, host(chosen), ranks)]
        return
    top_ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    top_lps = mx.take_along_axis(lp, top_ids, axis=-1)
    for t, v, r, ids, lps in zip(scored, host(chosen), ranks, host(top_ids), host(top_lps)):
        top = sorted((TopLogprob(token_id=i, logprob=x) for i, x in zip(ids, lps)), key=lambda x: -x.logprob)
        seq.prompt_logprobs.append(TokenLogprob(token_id=t, logprob=v, top=top, rank=r))


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
    started = time.perf_counter()
    with routed(model, [seq.adapter_slot for seq, _ in chunks]):
        if trimmable:
            cache = batch_prefill_caches(layout, padding)
            logits = model(mx.array([[0] * pad + t for pad, t in zip(padding, tokens)]), cache=cache)
        else:
            fresh = [make_prompt_cache(model) for _ in chunks]
            cache = [type(layer[0]).merge(list(layer)) for layer in zip(*fresh)]
            if max(padding):
                for c in cache:
                    c.prepare(lengths=[n for _, n in chunks], right_padding=padding)
            logits = model(mx.array([t + [0] * pad for pad, t in zip(padding, tokens)]), cache=cache)
            if max(padding):
                for c in cache:
                    c.finalize()
    mx.eval([c.state for c in cache])
    _note_time(model, width * len(chunks), started)
    for row, (seq, n) in enumerate(chunks):
        seq.cache = quantized_caches([c.extract(row) for c in cache], layout)
        first = padding[row] if trimmable else 0  # left padding, or right
        _score_prompt(seq, logits[row, first : first + n], 0, n)
        seq.num_prefilled = n
