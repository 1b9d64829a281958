"""`engine/kv`'s seams: the KV code depends on a request protocol, not on the engine's request
state, and the kinds outside the batch share one trim."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx.core as mx

from engine.kv.offsets import OffsetCache
from engine.kv.paged import PagedKV
from engine.kv.quantized import QuantizedKV
from protocols.model import LayerLayout

KV_PACKAGE = Path(__file__).resolve().parents[3] / "engine" / "kv"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, wherever the import is written (lazy, TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_kv_module_imports_the_request_state():
    importers = sorted(path.name for path in KV_PACKAGE.glob("*.py") if any(name.startswith("engine.sequence") for name in imported_modules(path)))
    assert importers == []


def test_the_paged_and_quantized_caches_share_one_trim():
    assert PagedKV.trim is QuantizedKV.trim is OffsetCache.trim
    assert PagedKV.make_mask is QuantizedKV.make_mask is OffsetCache.make_mask


def test_a_trimmed_quantized_cache_forgets_positions_and_its_mask_follows():
    layer = LayerLayout(kind="full", heads=2, key_dim=64, value_dim=64, dtype="float32", kv_bits=8, kv_group_size=64)
    cache = QuantizedKV(layer)
    cache.update_and_fetch(mx.ones((1, 2, 5, 64)), mx.ones((1, 2, 5, 64)))
    assert cache.is_trimmable() and cache.trim(3) == 3 and cache.offset == 2
    assert cache.trim(9) == 2 and cache.offset == 0
    mask = cache.make_mask(4, return_array=True)
    assert mask.shape == (4, 4)
