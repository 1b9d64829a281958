"""Quantized weights on the CPU backend (`model.cpu_dequantize`): dequantized at load into the
float32 layers mlx-lm's quantized ones stand for, or kept; either way mlx-lm's tokens."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import msgspec
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import load

from engine.model import weights
from engine.model.weights import apply_cpu_policy
from protocols import GenerateRequest, TokenDelta
from runtime import ConfigError, Runtime, env
from runtime.config import RuntimeConfig
from tests.support.config import make_config
from tests.support.families import build
from tests.support.mlx_reference import greedy_ids

QUANTIZED_FAMILIES = ["llama-4bit", "qwen3-8bit", "qwen3_moe-4bit"]
PROMPT = [5, 17, 300, 42, 9, 811, 77, 3, 150, 600, 21, 8]


def _quantized_layers(model) -> int:
    return sum(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding | QuantizedSwitchLinear) for _, m in model.named_modules())


def _logits(model) -> mx.array:
    out = model(mx.array([PROMPT]))
    mx.eval(out)
    return out


@pytest.mark.parametrize("family", QUANTIZED_FAMILIES)
def test_always_turns_every_quantized_layer_into_its_dequantized_float_layer(family):
    directory = build(family, env.home())
    model, _ = load(str(directory))
    reference = _logits(model)  # mlx-lm's own quantized forward
    count = _quantized_layers(model)
    assert count > 0

    report = apply_cpu_policy(model, "always")

    assert report.dequantized and report.quantized_modules == count and "dequantized" in report.reason
    assert _quantized_layers(model) == 0
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(model.parameters()))
    ours = _logits(model)
    # The same function: only the matmuls' float rounding differs.
    assert mx.abs(ours - reference).max().item() <= 1e-4 * max(1.0, mx.abs(reference).max().item())


def test_never_keeps_the_quantized_layers_and_mlx_lms_exact_logits():
    directory = build("llama-4bit", env.home())
    model, _ = load(str(directory))
    reference = _logits(model)
    report = apply_cpu_policy(model, "never")
    assert not report.dequantized and report.quantized_modules == _quantized_layers(model) > 0
    assert (report.bits, report.group_size) == (4, 32) and "never" in report.reason
    assert mx.array_equal(_logits(model), reference)


def test_auto_keeps_weights_that_would_not_fit(monkeypatch):
    directory = build("llama-4bit", env.home())
    model, _ = load(str(directory))
    monkeypatch.setattr(weights, "AUTO_MEMORY_SHARE", 1e-12)
    report = apply_cpu_policy(model, "auto")
    assert not report.dequantized and report.reason.startswith("kept: float32 weights need")
    assert _quantized_layers(model) == report.quantized_modules
    monkeypatch.setattr(weights, "AUTO_MEMORY_SHARE", 0.5)
    assert apply_cpu_policy(model, "auto").dequantized


def test_a_model_that_is_not_quantized_is_left_alone():
    model, _ = load(str(build("llama", env.home())))
    before = tree_flatten(model.parameters())
    report = apply_cpu_policy(model, "always")
    assert not report.dequantized and report.quantized_modules == 0
    assert all(a is b for (_, a), (_, b) in zip(before, tree_flatten(model.parameters())))


@pytest.mark.parametrize("policy", ["always", "never"])
async def test_the_runtime_reports_its_policy_and_generates_mlx_lms_tokens(policy):
    directory = build("qwen3_moe-4bit", env.home())
    config = make_config(str(directory))
    config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, cpu_dequantize=policy))
    tokens: list[int] = []
    async with Runtime.open(config) as rt:
        reported = rt.model_info.quantization
        async for event in rt.generate(GenerateRequest(prompt_ids=PROMPT, max_tokens=16, ignore_eos=True)):
            if isinstance(event, TokenDelta):
                tokens += event.token_ids
    assert reported.startswith("dequantized" if policy == "always" else "kept")
    model, _ = load(str(directory))
    model.set_dtype(mx.float32)
    expected = greedy_ids(model, PROMPT, 16)
    assert tokens == expected  # the conformance test excuses near-ties; none occur here


def test_an_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="cpu_dequantize"):
        RuntimeConfig.from_tree({"model": {"path": "builtin:tiny", "cpu_dequantize": "sometimes"}}, source="test")
