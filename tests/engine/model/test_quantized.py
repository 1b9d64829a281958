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

from engine import native
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
    """Without mlxrt's quantized kernels, "auto" dequantizes what fits half the memory."""
    monkeypatch.setattr(weights, "kernels_loaded", lambda: False)
    directory = build("llama-4bit", env.home())
    model, _ = load(str(directory))
    monkeypatch.setattr(weights, "AUTO_MEMORY_SHARE", 1e-12)
    report = apply_cpu_policy(model, "auto")
    assert not report.dequantized and report.reason.startswith("kept: float32 weights need")
    assert _quantized_layers(model) == report.quantized_modules
    monkeypatch.setattr(weights, "AUTO_MEMORY_SHARE", 0.5)
    assert apply_cpu_policy(model, "auto").dequantized


@pytest.mark.parametrize("family", QUANTIZED_FAMILIES)
def test_auto_keeps_the_layers_the_kernels_serve_and_dequantizes_the_rest(family):
    """With the kernels loaded, "auto" keeps linear and embedding layers of 4 or 8 bits quantized
    (whatever their size); a model with expert layers, which the kernels do not compute, is
    dequantized as before."""
    if native.load() is None:
        pytest.skip("mlxrt's CPU kernels are off on this machine")
    model, _ = load(str(build(family, env.home())))
    count = _quantized_layers(model)
    report = apply_cpu_policy(model, "auto")
    if family.startswith("qwen3_moe"):
        assert report.dequantized and _quantized_layers(model) == 0
    else:
        assert not report.dequantized and report.reason == weights.KERNELS_REASON and _quantized_layers(model) == count > 0


@pytest.mark.parametrize("family", QUANTIZED_FAMILIES)
def test_a_kept_model_counts_the_weights_its_layers_pack(family):
    model, _ = load(str(build(family, env.home())))
    kept = weights.parameter_count(model)
    apply_cpu_policy(model, "always")
    assert kept == weights.parameter_count(model) == sum(v.size for _, v in tree_flatten(model.parameters()))


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


@pytest.mark.parametrize("family", ["llama-4bit", "qwen3-8bit"])
async def test_kept_for_the_kernels_the_runtime_generates_mlx_lms_tokens_alone_and_batched(family):
    """The default policy on a 4- and an 8-bit model: their layers stay quantized and the step's
    products are mlxrt's kernel; each of four requests at once, and one alone, gets mlx-lm's
    greedy tokens from its own quantized forward."""
    import anyio

    directory = build(family, env.home())
    prompts = [PROMPT, PROMPT[:5], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3, PROMPT[3:] + PROMPT]
    results: dict[int, list[int]] = {}
    async with Runtime.open(make_config(str(directory))) as rt:
        assert rt.model_info.quantization == weights.KERNELS_REASON or native.loaded() is None

        async def one(i: int) -> None:
            tokens: list[int] = []
            async for event in rt.generate(GenerateRequest(prompt_ids=prompts[i], max_tokens=16, ignore_eos=True)):
                if isinstance(event, TokenDelta):
                    tokens += event.token_ids
            results[i] = tokens

        await one(0)
        alone = results.pop(0)
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    model, _ = load(str(directory))
    model.set_dtype(mx.float32)
    assert alone == greedy_ids(model, PROMPT, 16)
    for i, prompt in enumerate(prompts):
        assert results[i] == greedy_ids(model, prompt, 16), f"request {i}"


def test_an_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="cpu_dequantize"):
        RuntimeConfig.from_tree({"model": {"path": "builtin:tiny", "cpu_dequantize": "sometimes"}}, source="test")


def _tiny_llama(tied: bool) -> nn.Module:
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=tied,
    )  # fmt: skip
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_step_reads_every_weight_once_and_one_row_of_an_untied_table(tied):
    model = _tiny_llama(tied)
    everything = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    table = model.model.embed_tokens.weight.nbytes
    expected = everything if tied else everything - table + table // 512
    assert weights.decode_weight_bytes(model) == expected
    nn.quantize(model, group_size=32, bits=4)
    quantized = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    table = sum(v.nbytes for _, v in tree_flatten(model.model.embed_tokens.parameters()))
    assert weights.decode_weight_bytes(model) == (quantized if tied else quantized - table + table // 512) < expected


def test_a_mixture_of_experts_has_no_fixed_count_of_weight_bytes():
    model, _ = load(str(build("qwen3_moe-4bit", env.home())))
    assert weights.decode_weight_bytes(model) == 0
    dense, _ = load(str(build("llama-4bit", env.home())))
    assert weights.decode_weight_bytes(dense) > 0
