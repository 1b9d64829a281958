"""The step profiler (`mlxrt bench --profile`): its pieces add up to the profiled step, both
stacks are measured on one model, and nothing stays patched afterwards."""

from __future__ import annotations

import math

import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine.kv.slots import FullSlots
from engine.sampler import BatchSampler
from tests.support.config import make_config
from tools.profile import CATEGORIES, ProfileOptions, format_profile, run_profile


def _patchable() -> list:
    """What the profiler patches while it runs (an mlx-lm llama's pieces, the caches, the sampler)."""
    return [
        llama.Model.__call__,
        llama.Attention.__call__,
        llama.MLP.__call__,
        nn.RMSNorm.__call__,
        KVCache.update_and_fetch,
        BatchKVCache.update_and_fetch,
        FullSlots.update_and_fetch,
        BatchSampler.sample,
        llama.create_attention_mask,
    ]


@pytest.mark.slow
async def test_the_pieces_add_up_to_the_profiled_step_and_nothing_stays_patched():
    originals = _patchable()
    options = ProfileOptions(concurrency=(1, 3), prompt_tokens=12, steps=6, warm=2)
    results = await run_profile(make_config("builtin:tiny"), options)

    for stack in ("mlxrt", "mlx_lm"):
        for key in ("c1", "c3"):
            figures = results[stack][key]
            pieces = figures["pieces_ms"]
            assert set(pieces) == set(CATEGORIES)
            assert figures["step_ms"] > 0 and figures["profiled_ms"] > 0
            # Exclusive time: every moment of a profiled step is charged to exactly one piece.
            assert math.isclose(sum(pieces.values()), figures["profiled_ms"], rel_tol=0.05, abs_tol=0.05), (stack, key, figures)
            # The model's own pieces were found and timed in both stacks.
            for piece in ("attention", "mlp", "norm", "sdpa", "kv write", "sampling"):
                assert pieces[piece] > 0, (stack, key, piece)
    assert results["model"]["layers"] > 0
    table = format_profile(results)
    assert "c3: ms per decode step, mlxrt vs mlx-lm BatchGenerator" in table and "kv write" in table
    assert _patchable() == originals
    # (The engine routes attention through its own `attend` from its build on; not a profiler wrapper.)
    assert "Patches" not in llama.scaled_dot_product_attention.__qualname__
