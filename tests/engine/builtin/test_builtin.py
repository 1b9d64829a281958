"""Tests for engine.builtin: deterministic, cached, loadable random-weight models."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as mx_nn
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from engine.builtin import (
    BUILTIN_MODELS,
    BuiltinSpec,
    UnknownBuiltinModelError,
    builtin_name,
    config_fields,
    ensure_builtin,
    ensure_model,
    parameter_count,
)
from engine.builtin.models import MANIFEST, MODEL_FILES, _hf_config
from engine.builtin.tokenizer import ADDED_TOKENS, CONTROL_TOKENS, ENDOFTEXT, IM_END
from runtime import env
from tests.support.mlx_reference import greedy_ids

TINY_MODELS = ("tiny", "tiny-qwen2")
# The other tiny built-ins and the caches make_prompt_cache gives them, one per layer.
TINY_FAMILY_CACHES = {
    "tiny-gemma3": (RotatingKVCache, RotatingKVCache, KVCache, RotatingKVCache),
    "tiny-qwen3next": (ArraysCache, ArraysCache, ArraysCache, KVCache),
    "tiny-lfm2": (ArraysCache, ArraysCache, KVCache, ArraysCache),
}
# Digests of the first built-in models: their directories (and bytes) must not change.
LEGACY_DIGESTS = {
    "tiny": "49c0e6f2404f",
    "tiny-qwen2": "6f25a7a33dd2",
    "bench": "25bef16d0201",
    "bench-qwen2": "8b08e3ac6380",
}
REPO_ROOT = Path(__file__).resolve().parents[3]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class Built:
    """Tiny models built once into a shared root, with the progress messages seen."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.messages: dict[str, list[str]] = {}
        self.dirs: dict[str, Path] = {}
        for name in TINY_MODELS:
            self.messages[name] = []
            self.dirs[name] = ensure_builtin(name, root=root, progress=self.messages[name].append)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return Built(tmp_path_factory.mktemp("builtin-root"))


@pytest.fixture(scope="module")
def hf_tokenizer(built: Built):
    return AutoTokenizer.from_pretrained(built.dirs["tiny"])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_models_load_with_mlx_lm(built: Built, name: str) -> None:
    directory = built.dirs[name]
    spec = BUILTIN_MODELS[name]
    assert directory.parent == built.root / "models"
    assert directory.name == f"{name}-{spec.digest()[:12]}"
    assert all((directory / f).is_file() for f in MODEL_FILES)

    model, tokenizer, config = load(str(directory), return_config=True)

    assert config["model_type"] == spec.model_type
    assert model.args.vocab_size == spec.vocab_size
    assert model.args.tie_word_embeddings == spec.tie_word_embeddings
    vocab = tokenizer.get_vocab()
    assert len(vocab) <= spec.vocab_size
    assert tokenizer.eos_token_ids == {vocab[IM_END], vocab[ENDOFTEXT]}
    assert tokenizer.bos_token is None
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, spec.vocab_size)
    assert logits.dtype == mx.float32


def test_manifest_records_spec_and_file_digests(built: Built) -> None:
    directory = built.dirs["tiny"]
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["spec_digest"] == BUILTIN_MODELS["tiny"].digest()
    assert manifest["spec"]["hidden_size"] == BUILTIN_MODELS["tiny"].hidden_size
    assert manifest["tokenizer_sha256"] == _sha256(directory / "tokenizer.json")
    assert manifest["weights_sha256"] == _sha256(directory / "model.safetensors")


@pytest.mark.parametrize("name", TINY_MODELS)
def test_builds_into_two_roots_are_identical(built: Built, tmp_path: Path, name: str) -> None:
    other = ensure_builtin(name, root=tmp_path)
    for filename in MODEL_FILES:
        assert _sha256(other / filename) == _sha256(built.dirs[name] / filename), filename


def test_second_call_does_not_rebuild(built: Built) -> None:
    directory = built.dirs["tiny"]
    mtimes = {f: (directory / f).stat().st_mtime_ns for f in MODEL_FILES}
    messages: list[str] = []
    again = ensure_builtin("tiny", root=built.root, progress=messages.append)
    assert again == directory
    assert messages == []
    assert {f: (directory / f).stat().st_mtime_ns for f in MODEL_FILES} == mtimes


def test_models_sharing_a_tokenizer_train_it_once(built: Built) -> None:
    assert any("training tokenizer" in m for m in built.messages["tiny"])
    assert not any("training tokenizer" in m for m in built.messages["tiny-qwen2"])
    assert any("writing weights" in m for m in built.messages["tiny-qwen2"])
    tokenizer_files = [built.dirs[name] / "tokenizer.json" for name in TINY_MODELS]
    assert _sha256(tokenizer_files[0]) == _sha256(tokenizer_files[1])


def test_incomplete_directory_is_rebuilt(tmp_path: Path) -> None:
    directory = ensure_builtin("tiny", root=tmp_path)
    expected = _sha256(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    assert ensure_builtin("tiny", root=tmp_path) == directory
    assert _sha256(directory / "model.safetensors") == expected
    assert not list(directory.parent.glob(".*tmp-*"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_encode_decode_round_trips_any_text(built: Built, hf_tokenizer, text: str) -> None:
    assume(not any(token in text for token in ADDED_TOKENS))
    raw = Tokenizer.from_file(str(built.dirs["tiny"] / "tokenizer.json"))
    ids = raw.encode(text).ids
    assert raw.decode(ids, skip_special_tokens=False) == text
    assert hf_tokenizer.decode(hf_tokenizer.encode(text)) == text


def test_added_tokens_encode_to_single_ids(hf_tokenizer) -> None:
    vocab_size = BUILTIN_MODELS["tiny"].vocab_size
    ids = [hf_tokenizer.encode(token, add_special_tokens=False) for token in ADDED_TOKENS]
    assert all(len(single) == 1 for single in ids)
    flat = [single[0] for single in ids]
    assert len(set(flat)) == len(ADDED_TOKENS)
    assert all(i < vocab_size for i in flat)
    assert hf_tokenizer.encode("hello world") == hf_tokenizer.encode("hello world", add_special_tokens=False)
    assert set(CONTROL_TOKENS) <= set(hf_tokenizer.all_special_tokens)
    assert hf_tokenizer.eos_token == IM_END


def test_markup_tokens_survive_skip_special_tokens(hf_tokenizer) -> None:
    text = "<|im_start|>assistant\n<think>hm</think><tool_call>{}</tool_call><|im_end|>"
    decoded = hf_tokenizer.decode(hf_tokenizer.encode(text), skip_special_tokens=True)
    assert decoded == "assistant\n<think>hm</think><tool_call>{}</tool_call>"


def test_chat_template_renders_tools_and_tool_calls(hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "tool", "content": '{"temp_c": 19}'},
    ]
    rendered = hf_tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>" in rendered
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n'
        "</tool_call><|im_end|>\n"
    ) in rendered
    assert ('<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response>\n<tool_response>\n{"temp_c": 19}\n</tool_response><|im_end|>\n') in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def test_chat_template_without_tools_or_system(hf_tokenizer) -> None:
    rendered = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        tokenize=False,
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"


def test_greedy_generation_is_not_degenerate(built: Built) -> None:
    model, _ = load(str(built.dirs["tiny"]))
    prompt = np.random.default_rng(7).integers(0, 1000, 16).tolist()
    tokens = greedy_ids(model, prompt, 24)
    assert len(tokens) == 24
    assert len(set(tokens)) >= 3


def test_the_copying_circuit_copies_its_context(built: Built) -> None:
    """`tiny-copy` (engine.builtin.copying) writes a document it was shown again, greedy,
    and after a token that leaves the copy it comes back to the document."""
    model, _ = load(str(ensure_builtin("tiny-copy", root=built.root)))
    rng = np.random.default_rng(3)
    document = [int(t) for t in rng.choice(np.arange(20, 1000), 80, replace=False)]

    assert greedy_ids(model, document + document[:4], 60) == document[4:64]
    # An edit: a token the document does not hold, then the copy again from after it.
    assert greedy_ids(model, document + document[:10] + [5], 40) == document[11:51]


def test_the_runtime_root_comes_from_mlxrt_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXRT_HOME", str(tmp_path))
    directory = ensure_builtin("tiny", root=env.home())
    assert directory.parent == tmp_path / "models"
    assert (directory / MANIFEST).is_file()
    monkeypatch.delenv("MLXRT_HOME")
    assert env.home() == Path.home() / ".cache" / "mlxrt"


@pytest.mark.slow
def test_concurrent_builders_both_get_a_valid_directory(built: Built, tmp_path: Path) -> None:
    script = "import sys; from engine.builtin import ensure_builtin; print(ensure_builtin('tiny', root=sys.argv[1], progress=lambda m: print('progress:', m)))"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO_ROOT,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err for _, err in outputs]
    paths = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(paths) == 1
    directory = Path(paths.pop())
    assert all((directory / f).is_file() for f in MODEL_FILES)
    assert sum("building builtin model" in out for out, _ in outputs) == 1
    # Another process (fresh hash seeds, fresh MLX) must produce the same bytes.
    for filename in ("tokenizer.json", "model.safetensors"):
        assert _sha256(directory / filename) == _sha256(built.dirs["tiny"] / filename)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [directory.name, directory.name + ".lock"]


def test_unknown_name_lists_known_models(tmp_path: Path) -> None:
    with pytest.raises(UnknownBuiltinModelError, match="tiny-qwen2") as excinfo:
        ensure_builtin("no-such-model", root=tmp_path)
    assert isinstance(excinfo.value, ValueError)
    assert "no-such-model" in str(excinfo.value)
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("builtin:tiny", "tiny"),
        ("builtin:bench-qwen2", "bench-qwen2"),
        ("builtin:", None),
        ("tiny", None),
        ("/models/builtin:tiny", None),
        ("mlx-community/SmolLM-135M", None),
    ],
)
def test_builtin_name(path: str, expected: str | None) -> None:
    assert builtin_name(path) == expected


def test_spec_digest_tracks_every_field() -> None:
    spec = BUILTIN_MODELS["tiny"]
    assert spec.digest() == BUILTIN_MODELS["tiny"].digest()
    assert dataclasses.replace(spec, seed=spec.seed + 1).digest() != spec.digest()
    assert dataclasses.replace(spec, rope_theta=500000.0).digest() != spec.digest()
    assert dataclasses.replace(spec, extra=config_fields(attention_bias=True)).digest() != spec.digest()
    assert dataclasses.replace(spec, quantize=(4, 64)).digest() != spec.digest()
    assert dataclasses.replace(spec, quantize=(4, 64)).digest() != dataclasses.replace(spec, quantize=(4, 32)).digest()
    assert dataclasses.replace(spec, omit_weights=("lm_head",)).digest() != spec.digest()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 5  # type: ignore[misc]


def test_first_models_keep_their_digests() -> None:
    assert {name: BUILTIN_MODELS[name].digest()[:12] for name in LEGACY_DIGESTS} == LEGACY_DIGESTS


def test_extra_fields_are_frozen_and_order_free() -> None:
    tiny = BUILTIN_MODELS["tiny"]
    one = dataclasses.replace(tiny, extra=config_fields(rope_scaling={"rope_type": "linear", "factor": 2.0}, layer_types=["full_attention"] * 2))
    two = dataclasses.replace(tiny, extra=(("layer_types", ["full_attention"] * 2), ("rope_scaling", {"factor": 2.0, "rope_type": "linear"})))
    assert one == two
    assert hash(one) == hash(two)
    assert one.digest() == two.digest()
    config = _hf_config(one, eos_ids=[0], pad_id=0)
    assert config["rope_scaling"] == {"factor": 2.0, "rope_type": "linear"}
    assert config["layer_types"] == ["full_attention", "full_attention"]


def test_text_config_layout_nests_the_language_model() -> None:
    spec = dataclasses.replace(
        BUILTIN_MODELS["tiny"],
        model_type="mistral3",
        layout="text_config",
        extra=config_fields(text_config={"model_type": "mistral"}),
    )
    config = _hf_config(spec, eos_ids=[7], pad_id=8)
    assert set(config) == {"architectures", "model_type", "eos_token_id", "pad_token_id", "torch_dtype", "text_config"}
    assert config["model_type"] == "mistral3"
    assert config["text_config"]["model_type"] == "mistral"
    assert config["text_config"]["vocab_size"] == spec.vocab_size
    assert config["text_config"]["hidden_size"] == spec.hidden_size


def test_invalid_spec_is_rejected() -> None:
    with pytest.raises(ValueError, match="vocab"):
        dataclasses.replace(BUILTIN_MODELS["tiny"], vocab_size=512)
    with pytest.raises(ValueError, match="model_type"):
        dataclasses.replace(BUILTIN_MODELS["tiny"], model_type="no_such_architecture")
    with pytest.raises(ValueError, match="quantization"):
        dataclasses.replace(BUILTIN_MODELS["tiny"], quantize=(7, 64))
    with pytest.raises(ValueError, match="layout"):
        dataclasses.replace(BUILTIN_MODELS["tiny"], layout="nested")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("bench", 100e6, 130e6),
        ("bench-qwen2", 90e6, 110e6),
        ("bench-gemma3", 100e6, 130e6),
        ("bench-lfm2", 100e6, 130e6),
        ("bench-4bit", 100e6, 130e6),
        ("bench-1b", 1.0e9, 1.1e9),
        ("bench-3b", 2.8e9, 3.0e9),
    ],
)
def test_bench_specs_have_the_intended_size(name: str, low: float, high: float) -> None:
    """Counts parameters of the (lazily initialised, never evaluated) model only."""
    spec: BuiltinSpec = BUILTIN_MODELS[name]
    count = parameter_count(spec)
    assert low <= count <= high
    if spec.omit_weights == ():
        module = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
        model = module.Model(module.ModelArgs.from_dict(_hf_config(spec, eos_ids=[0], pad_id=0)))
        assert count == sum(p.size for _, p in tree_flatten(model.parameters()))


def test_bench_4bit_is_bench_quantized() -> None:
    bench, quantized = BUILTIN_MODELS["bench"], BUILTIN_MODELS["bench-4bit"]
    assert dataclasses.replace(quantized, name="bench", quantize=None) == bench
    assert quantized.quantize == (4, 64)
    assert _hf_config(quantized, eos_ids=[0], pad_id=0) == _hf_config(bench, eos_ids=[0], pad_id=0)


@pytest.mark.parametrize("name", sorted(TINY_FAMILY_CACHES))
def test_tiny_family_models_load_and_generate(built: Built, name: str) -> None:
    spec = BUILTIN_MODELS[name]
    directory = ensure_builtin(name, root=built.root)
    model, tokenizer, config = load(str(directory), return_config=True)
    assert config["model_type"] == spec.model_type
    cache = make_prompt_cache(model)
    assert tuple(type(c) for c in cache) == TINY_FAMILY_CACHES[name]
    prompt = mx.array(np.random.default_rng(7).integers(0, 1000, 64))
    eos = sorted(tokenizer.eos_token_ids)

    def no_eos(_tokens: mx.array, logits: mx.array) -> mx.array:
        logits[:, eos] = -float("inf")
        return logits

    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=16, prompt_cache=cache, logits_processors=[no_eos]))
    assert len(responses) == 16
    # Past the sliding window (16 tokens for tiny-gemma3).
    assert all(c.offset > c.max_size for c in cache if isinstance(c, RotatingKVCache))


@pytest.mark.parametrize("family", ["tiny", "qwen3_moe"])
def test_quantized_specs_are_built_matrix_by_matrix_as_the_whole_model_quantized(built: Built, family: str) -> None:
    """A quantized spec draws and quantizes one matrix at a time (a 3B model's float weights would
    not fit in memory): the same bytes as loading every float weight into the model and quantizing
    it (`_quantize`, mlx-lm's `quantize_model`), every kind of layer (experts too) with its own settings."""
    from mlx.utils import tree_flatten

    from engine.builtin.models import _init_param, _instantiate, _quantize, _scaled
    from tests.support.families import FAMILIES

    base = BUILTIN_MODELS["tiny"] if family == "tiny" else FAMILIES[family]
    spec = dataclasses.replace(base, name=f"{family}-4bit-streamed", quantize=(4, 32))
    directory = ensure_model(spec, root=built.root)
    config = json.loads((directory / "config.json").read_text())
    model = _instantiate(spec, {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")})
    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    rng = np.random.default_rng(spec.seed)
    model.load_weights([(name, mx.array(_scaled(spec, name, _init_param(rng, name, shapes[name])))) for name in sorted(shapes)])
    assert _quantize(model, 4, 32) == config["quantization"]
    whole = dict(tree_flatten(model.parameters()))
    streamed = mx.load(str(directory / "model.safetensors"))
    assert set(streamed) == set(whole)
    assert all(streamed[name].dtype == whole[name].dtype and mx.array_equal(streamed[name], whole[name]) for name in whole)


def test_quantized_copy_holds_the_same_weights(built: Built) -> None:
    """A quantized spec starts from its unquantized twin's weights (same seed)."""
    tiny = BUILTIN_MODELS["tiny"]
    directory = ensure_model(dataclasses.replace(tiny, name="tiny-4bit", quantize=(4, 32)), root=built.root)
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert config["quantization_config"] == config["quantization"]
    original = mx.load(str(built.dirs["tiny"] / "model.safetensors"))
    quantized = mx.load(str(directory / "model.safetensors"))
    assert {name for name in quantized if name.endswith(".scales")}
    for name, weight in original.items():
        prefix = name.removesuffix(".weight")
        if f"{prefix}.scales" not in quantized:
            assert mx.array_equal(quantized[name], weight), name
            continue
        restored = mx.dequantize(quantized[name], quantized[f"{prefix}.scales"], quantized[f"{prefix}.biases"], group_size=32, bits=4)
        assert restored.shape == weight.shape
        # Affine 4-bit: within a step, (max - min) / 15 of a group (mlx rounds its
        # zero point too, so not always within half a step).
        step = (weight.reshape(-1, 32).max(axis=1) - weight.reshape(-1, 32).min(axis=1)) / 15
        error = mx.abs(restored - weight).reshape(-1, 32).max(axis=1)
        assert bool(mx.all(error <= step + 1e-5)), name
    model, _ = load(str(directory))
    assert isinstance(model.model.layers[0].self_attn.q_proj, mx_nn.QuantizedLinear)
