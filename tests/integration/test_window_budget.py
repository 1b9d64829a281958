"""A sliding-window layer holds only its window: a 4,096-token request is budgeted, held and
generated with 128-position rings for those layers, exactly as mlx-lm generates it."""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import msgspec
import pytest
from mlx_lm.utils import load

from engine.builtin import BUILTIN_MODELS, config_fields, ensure_model
from engine.step import LEN_STEP
from policies.layout import RING_MARGIN, leaves, request_bytes, token_bytes
from protocols import Finished, GenerateRequest, TokenDelta
from runtime import Runtime, env
from runtime.config import KvConfig
from tests.support.config import make_config
from tests.support.mlx_reference import greedy_ids

pytestmark = pytest.mark.slow

WINDOW = 128
PROMPT = 4088
NEW_TOKENS = 48


def _model():
    """tiny-gemma3 (layers 0, 1, 3 sliding, layer 2 global) with 128-token windows."""
    base = BUILTIN_MODELS["tiny-gemma3"]
    extra = {**dict(base.extra), "sliding_window": WINDOW}
    spec = dataclasses.replace(base, name="tiny-gemma3-w128", max_position_embeddings=8192, extra=config_fields(**extra))
    return ensure_model(spec, root=env.home())


async def test_a_long_request_reserves_only_the_window_of_its_sliding_layers():
    directory = _model()
    prompt = [random.Random(5).randrange(4, 1000) for _ in range(PROMPT)]
    total = PROMPT + NEW_TOKENS
    # (Padded rows: the held figures below are a row's; tests/integration/test_paged_kv.py has blocks.)
    config = msgspec.structs.replace(make_config(str(directory)), kv=KvConfig(block_size=0))
    async with Runtime.open(config) as rt:
        layers = rt.model_info.layers
    kinds = [layer.kind for _, layer in leaves(layers)]
    assert kinds == ["window", "window", "full", "window"] and all(layer.window == WINDOW for _, layer in leaves(layers) if layer.kind == "window")
    per_token = token_bytes(layers[2])
    windowed = request_bytes(layers, total)
    assert windowed == per_token * (total + 3 * (WINDOW + RING_MARGIN))
    # A budget that holds the request only if its sliding layers keep just their windows.
    budget = windowed + per_token * LEN_STEP  # the global layer's buffer grows by LEN_STEP positions
    assert budget < 4 * per_token * total

    config = msgspec.structs.replace(config, kv=KvConfig(budget_bytes=budget, prefix_cache_bytes=0, block_size=0))
    tokens: list[int] = []
    seen = []  # the KV figures while the request decodes (its whole prompt in the caches)
    finished = None
    async with Runtime.open(config) as rt:
        async for event in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=NEW_TOKENS, ignore_eos=True)):
            if isinstance(event, TokenDelta):
                tokens += event.token_ids
                seen.append((await rt.stats()).kv)
            elif isinstance(event, Finished):
                finished = event
    assert finished is not None and finished.finish_reason == "length"
    live = [kv for kv in seen if kv.live_requests == 1]  # the last figures may follow its release
    assert live
    for kv in live:
        assert kv.reserved_tokens == total and kv.reserved_bytes == windowed
        # Held, from the end of the prefill on: the global layer's KV and three rings.
        assert kv.physical_bytes <= budget, f"{kv.physical_bytes} bytes held, budget {budget}"

    model, _ = load(str(directory))
    model.set_dtype(mx.float32)
    expected = greedy_ids(model, prompt, NEW_TOKENS)
    assert tokens == expected
