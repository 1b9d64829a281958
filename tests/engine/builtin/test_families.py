"""Every family of tests.support.families builds, loads with mlx-lm, has the caches
its architecture implies and generates greedily past its sliding windows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load

from engine.builtin.models import MANIFEST, MODEL_FILES
from engine.builtin.tokenizer import ENDOFTEXT, IM_END
from tests.support.families import EXPECTED_CACHES, FAMILIES, SLIDING_WINDOW, build

CACHE_KINDS = {"K": KVCache, "R": RotatingKVCache, "A": ArraysCache, "L": CacheList}
# A few hundred tokens of Python: longer than every sliding window.
PROMPT = "\n".join(f"def step_{i}(value, scale={i}):\n    return [item * scale for item in value if item % {i + 2}]" for i in range(24))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families-root")


def _no_eos(eos_ids: list[int]):
    def processor(_tokens: mx.array, logits: mx.array) -> mx.array:
        logits[:, eos_ids] = -float("inf")
        return logits

    return processor


def test_every_family_has_an_expected_cache_layout() -> None:
    assert set(EXPECTED_CACHES) == set(FAMILIES)
    assert all(name == spec.name for name, spec in FAMILIES.items())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_loads_and_generates(root: Path, name: str) -> None:
    spec = FAMILIES[name]
    directory = build(name, root)
    assert directory == root / "models" / spec.directory_name()
    assert all((directory / f).is_file() for f in MODEL_FILES)

    model, tokenizer, config = load(str(directory), return_config=True)

    assert config["model_type"] == spec.model_type
    if spec.layout == "text_config":
        # As in a real multimodal checkpoint: the language model's fields only there.
        assert "vocab_size" not in config and "hidden_size" not in config
        assert config["text_config"]["vocab_size"] == spec.vocab_size
    vocab = tokenizer.get_vocab()
    eos_ids = sorted(tokenizer.eos_token_ids)
    assert eos_ids == sorted({vocab[IM_END], vocab[ENDOFTEXT]})

    quantized = {path: m for path, m in model.named_modules() if hasattr(m, "bits")}
    if spec.quantize is None:
        assert not quantized
        assert "quantization" not in config
    else:
        bits, group_size = spec.quantize
        quantization = config["quantization"]
        assert (quantization["bits"], quantization["group_size"]) == (bits, group_size)
        assert config["quantization_config"] == quantization
        assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
        # Per-layer entries are the model's own quant_predicate (e.g. 8-bit MoE routers).
        for path, module in quantized.items():
            expected = quantization.get(path, {"bits": bits, "group_size": group_size})
            assert (module.bits, module.group_size) == (expected["bits"], expected["group_size"]), path

    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [CACHE_KINDS[kind] for kind in EXPECTED_CACHES[name]]
    assert all(c.max_size == SLIDING_WINDOW for c in cache if isinstance(c, RotatingKVCache))

    prompt = tokenizer.encode(PROMPT)
    assert len(prompt) > 4 * SLIDING_WINDOW
    responses = list(stream_generate(model, tokenizer, mx.array(prompt), max_tokens=8, prompt_cache=cache, logits_processors=[_no_eos(eos_ids)]))
    tokens = [r.token for r in responses]
    assert len(tokens) == 8
    assert all(0 <= t < spec.vocab_size for t in tokens)
    assert responses[-1].finish_reason == "length"
    assert all(c.offset > SLIDING_WINDOW for c in cache if isinstance(c, RotatingKVCache))


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_next", "qwen3_moe-4bit"])
def test_family_builds_are_deterministic(root: Path, tmp_path: Path, name: str) -> None:
    first = build(name, root)
    second = build(name, tmp_path)
    for filename in MODEL_FILES:
        assert hashlib.sha256((first / filename).read_bytes()).digest() == hashlib.sha256((second / filename).read_bytes()).digest(), filename


def test_manifest_records_the_family_spec(root: Path) -> None:
    spec = FAMILIES["qwen3_moe-4bit"]
    manifest: dict[str, Any] = json.loads((build("qwen3_moe-4bit", root) / MANIFEST).read_text())
    assert manifest["spec_digest"] == spec.digest()
    assert manifest["spec"]["quantize"] == [4, 64]
    assert manifest["spec"]["extra"]["num_experts"] == 4
    assert manifest["quantization"]["bits"] == 4
