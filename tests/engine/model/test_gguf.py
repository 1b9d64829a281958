"""The GGUF loader alone: header checks, hostile files, tensor conversion, name mapping, the
tokenizer rebuilt from metadata, and refusals. Files are written by the tests (tests/support)."""

from __future__ import annotations

import dataclasses
import json
import random
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from mlx_lm.utils import load as mlx_lm_load

from engine.builtin import BUILTIN_MODELS, config_fields, ensure_model
from engine.model.gguf import load_gguf
from engine.model.gguf.arch import architecture, check_shapes, expected_shapes, model_config, weight_name
from engine.model.gguf.format import GGUFFile
from engine.model.gguf.tensors import read_affine, read_float, unpermute_rows
from engine.model.gguf.tokenizer import tokenizer_digest
from engine.model.weights import apply_cpu_policy
from protocols.errors import ModelLoadError
from runtime import env
from tests.support.config import builtin_dir
from tests.support.gguf_files import permute, write_gguf

IDS = [[5, 17, 300, 42, 99, 7, 1000, 3, 1019, 250]]


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return builtin_dir("tiny")


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(tiny_dir, root / f"tiny-{q}.gguf", qtype=q) for q in ("Q8_0", "Q4_0", "Q4_1", "F16")}


def _load(path: Path, tmp_path: Path, keep: bool = False):
    return load_gguf(path, cache_root=tmp_path, keeps_quantized=lambda _: "kept" if keep else None)


def _logits(model, ids=IDS) -> np.ndarray:
    model.set_dtype(mx.float32)
    return np.array(model(mx.array(ids)).astype(mx.float32))


# --- tensors -------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_affine_blocks_equal_mlx_own_gguf_reader(files, qtype):
    """Our unpacking of Q4_0/Q4_1/Q8_0 blocks gives MLX's own reader's triples, bit for bit."""
    theirs = mx.load(str(files[qtype]))
    with GGUFFile.open(files[qtype]) as file:
        for name, info in file.tensors.items():
            if info.qtype.name != qtype:
                continue
            weight, scales, biases, bits = read_affine(file, info)
            assert bits == (8 if qtype == "Q8_0" else 4)
            assert mx.array_equal(weight, theirs[name]), name
            assert mx.array_equal(scales, theirs[name.removesuffix(".weight") + ".scales"]), name
            assert mx.array_equal(biases, theirs[name.removesuffix(".weight") + ".biases"]), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_affine_triples_dequantize_to_the_reference_values(files, qtype):
    with GGUFFile.open(files[qtype]) as file:
        info = file.tensors["blk.0.ffn_up.weight"]
        weight, scales, biases, bits = read_affine(file, info)
        ours = mx.dequantize(weight, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits)
        reference = dequantize(file.raw(info.name), info.qtype)
    np.testing.assert_allclose(np.array(ours), reference, rtol=0, atol=1e-6)


def test_unpermute_undoes_llama_cpp_permutation_of_rows_and_packed_rows():
    rng = np.random.default_rng(0)
    for heads, kv_heads in ((4, 4), (4, 2), (9, 3)):
        q = rng.standard_normal((heads * 16, 64)).astype(np.float32)
        k = rng.standard_normal((kv_heads * 16, 64)).astype(np.float32)
        assert np.array_equal(np.array(unpermute_rows(mx.array(permute(q, heads, heads)), heads)), q)
        assert np.array_equal(np.array(unpermute_rows(mx.array(permute(k, heads, kv_heads)), kv_heads)), k)
        assert not np.array_equal(permute(q, heads, heads), q)
    packed = mx.array(rng.integers(0, 2**32, (8 * 16, 8), dtype=np.uint32))
    rows = np.array(packed)
    assert np.array_equal(np.array(unpermute_rows(mx.array(permute(rows, 8, 8)), 8)), rows)


def test_k_quant_tensors_are_dequantized_exactly_or_requantized(tmp_path):
    """A Q6_K tensor (256-element blocks) reads as the gguf package's float32 dequantization."""
    path = tmp_path / "k.gguf"
    _write_raw(path, {"a.weight": _k_quant_blocks(GGMLQuantizationType.Q6_K, rows=4, blocks=2)})
    with GGUFFile.open(path) as file:
        info = file.tensors["a.weight"]
        assert info.shape == (4, 512)
        values = read_float(file, info)
        assert values.dtype == mx.float32
        np.testing.assert_array_equal(np.array(values), dequantize(file.raw("a.weight"), info.qtype))


# --- mapping and the whole load --------------------------------------------------------------


def test_weight_names_map_onto_mlx_lm_paths():
    assert weight_name("token_embd.weight") == "model.embed_tokens.weight"
    assert weight_name("output.weight") == "lm_head.weight"
    assert weight_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert weight_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert weight_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ssm_a"):
        weight_name("blk.0.ssm_a")


def test_config_comes_from_metadata_and_tensors(files, tiny_dir):
    original = json.loads((tiny_dir / "config.json").read_text())
    with GGUFFile.open(files["Q8_0"]) as file:
        arch = architecture(file)
        config = model_config(file, arch)
        check_shapes(file, expected_shapes(config, arch, file))
    assert arch.permutes_qk and config["model_type"] == "llama"
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert config[key] == original[key], key
    assert config["rope_theta"] == pytest.approx(original["rope_theta"])
    assert config["rms_norm_eps"] == pytest.approx(original["rms_norm_eps"])


@pytest.mark.parametrize("qtype,atol", [("F16", 0.02), ("Q8_0", 0.5), ("Q4_0", 4.0)])
def test_loaded_model_computes_the_original_model_up_to_quantization(files, tiny_dir, tmp_path, qtype, atol):
    """Q/K un-permuted and names mapped: the GGUF model is the mlx-lm model (F16 differs only by
    rounding); its affine blocks load as quantized layers, which dequantize to the same function."""
    original, _ = mlx_lm_load(str(tiny_dir))
    reference = _logits(original)
    quantized, dequantized = _load(files[qtype], tmp_path).model, _load(files[qtype], tmp_path).model
    assert np.abs(_logits(quantized) - reference).max() < atol
    dequantized.set_dtype(mx.float32)  # as the loader does first: float16 scales would round the weights
    assert (qtype == "F16") == (apply_cpu_policy(dequantized, "always").quantized_modules == 0)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in dequantized.named_modules())
    np.testing.assert_allclose(_logits(dequantized), _logits(quantized), atol=1e-4)


def test_llama3_frequency_factors_rotate_as_mlx_lm_llama3_rope(tmp_path):
    """A file with `rope_freqs` (Llama 3.1+) computes what mlx-lm's Llama3RoPE computes from the
    original config, over positions past every scaled wavelength."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    spec = dataclasses.replace(BUILTIN_MODELS["tiny"], name="tiny-llama3-rope", extra=config_fields(rope_scaling=scaling))
    directory = ensure_model(spec, root=env.home())
    path = write_gguf(directory, tmp_path / "llama3.gguf", qtype="F32")
    ids = [np.random.default_rng(2).integers(0, 1000, 300).tolist()]
    reference = _logits(mlx_lm_load(str(directory))[0], ids)
    np.testing.assert_allclose(_logits(_load(path, tmp_path).model, ids), reference, atol=2e-4)
    plain = write_gguf(directory, tmp_path / "plain.gguf", qtype="F32", without_rope_factors=True)
    assert np.abs(_logits(_load(plain, tmp_path).model, ids) - reference).max() > 1e-2


def test_k_quant_model_loads_dequantized_or_requantized_with_a_note(tmp_path):
    """Tensors of types MLX cannot hold: float32 (exact), or 8-bit affine when kept quantized."""
    spec_dir = builtin_dir("tiny")
    path = tmp_path / "tiny-k.gguf"
    # Rows of 64 elements cannot hold K-quants' 256-element blocks: Q5_0 (32) is such a type too.
    up = (_q5_0(np.random.default_rng(1), rows=128, cols=64), GGMLQuantizationType.Q5_0)
    write_gguf(spec_dir, path, qtype="F32", drop=("model.layers.0.mlp.up_proj.weight",), tensors={"blk.0.ffn_up.weight": up})
    exact = _load(path, tmp_path)
    assert exact.notes and "Q5_0" in exact.notes[0] and "float32" in exact.notes[0]
    with GGUFFile.open(path) as file:
        expected = dequantize(file.raw("blk.0.ffn_up.weight"), GGMLQuantizationType.Q5_0)
    np.testing.assert_array_equal(np.array(exact.model.model.layers[0].mlp.up_proj.weight), expected)
    requantized = _load(path, tmp_path, keep=True)
    assert "requantized" in requantized.notes[0]
    np.testing.assert_allclose(_logits(requantized.model), _logits(exact.model), atol=0.05)


def test_digests_cover_the_file_and_the_tokenizer(files, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(files["Q8_0"].read_bytes())
    with GGUFFile.open(files["Q8_0"]) as a, GGUFFile.open(copy) as b:
        assert a.digest() == b.digest() and tokenizer_digest(a) == tokenizer_digest(b)
        end = b.tensors["blk.1.ffn_down.weight"].offset + b.tensors["blk.1.ffn_down.weight"].nbytes - 1
    data = bytearray(copy.read_bytes())
    data[end] ^= 0x55
    copy.write_bytes(bytes(data))
    with GGUFFile.open(files["Q8_0"]) as a, GGUFFile.open(copy) as b:
        assert a.digest() != b.digest() and tokenizer_digest(a) == tokenizer_digest(b)
    with GGUFFile.open(files["Q8_0"]) as a, GGUFFile.open(files["Q4_0"]) as c:
        assert a.digest() != c.digest()


# --- the tokenizer -----------------------------------------------------------------------------


def test_tokenizer_from_metadata_encodes_and_renders_like_the_original(files, tiny_dir, tmp_path):
    original = mlx_lm_load(str(tiny_dir))[1]
    ours = _load(files["Q8_0"], tmp_path).tokenizer
    texts = [
        "def parse(path):\n    return open(path).read()  # 12345",
        "  leading spaces, tabs\t\tand émojis 🙂 ünïcödé",
        "<|im_start|>user\nhi<|im_end|><tool_call>{}</tool_call><think>x</think>",
        Path(__file__).read_text()[:4000],
    ]
    for text in texts:
        assert ours.encode(text) == original.encode(text), text[:40]
        assert ours.decode(original.encode(text)) == original.decode(original.encode(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == original.apply_chat_template(messages, add_generation_prompt=True)
    assert ours.eos_token_ids == original.eos_token_ids & {ours.convert_tokens_to_ids("<|im_end|>")}
    assert type(ours._detokenizer) is type(original._detokenizer)


def test_digit_splitting_follows_the_pre_tokenizer(tiny_dir, tmp_path):
    """`smollm` splits every digit apart (llama.cpp's \\p{N} pre-split); `gpt2` keeps runs."""
    gpt2 = _load(write_gguf(tiny_dir, tmp_path / "gpt2.gguf", pre="gpt2"), tmp_path).tokenizer
    smollm = _load(write_gguf(tiny_dir, tmp_path / "smollm.gguf", pre="smollm"), tmp_path).tokenizer
    text = "x = 1234567 + 890"
    digits = [t for t in smollm.convert_ids_to_tokens(smollm.encode(text)) if any(c.isdigit() for c in t)]
    assert all(len(t.lstrip("Ġ")) == 1 for t in digits) and len(digits) == 10
    assert smollm.decode(smollm.encode(text)) == text == gpt2.decode(gpt2.encode(text))


# --- refusals ----------------------------------------------------------------------------------


def test_unknown_architecture_and_pre_tokenizer_are_refused_by_name(tiny_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        _load(write_gguf(tiny_dir, tmp_path / "a.gguf", architecture="gpt2"), tmp_path)
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'new-pre'"):
        _load(write_gguf(tiny_dir, tmp_path / "b.gguf", pre="new-pre"), tmp_path)


@pytest.mark.parametrize(
    "metadata,match",
    [
        ({"llama.attention.head_count": None}, "llama.attention.head_count' is missing"),
        ({"llama.attention.head_count": 3}, "do not group|shape"),
        ({"llama.block_count": 3}, "says 3 blocks"),
        ({"llama.block_count": 1 << 39}, "blocks"),
        ({"llama.embedding_length": 1 << 39}, "shape"),
        ({"llama.rope.dimension_count": 8}, "part of each head"),
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "rope scaling 'yarn'"),
        ({"llama.attention.head_count": "four"}, "expected one int"),
        ({"tokenizer.ggml.eos_token_id": 5000}, "not a token id"),
    ],
)
def test_inconsistent_metadata_is_refused_naming_it(tiny_dir, tmp_path, metadata, match):
    with pytest.raises(ModelLoadError, match=match):
        _load(write_gguf(tiny_dir, tmp_path / "m.gguf", metadata=metadata), tmp_path)


def test_missing_or_extra_tensors_are_refused(tiny_dir, tmp_path):
    with pytest.raises(ModelLoadError, match=r"missing: blk\.1\.ffn_gate\.weight"):
        _load(write_gguf(tiny_dir, tmp_path / "a.gguf", drop=("model.layers.1.mlp.gate_proj.weight",)), tmp_path)
    extra = {"blk.0.ssm_a": (np.zeros((4, 4), np.float32), GGMLQuantizationType.F32)}
    with pytest.raises(ModelLoadError, match=r"does not use: blk\.0\.ssm_a"):
        _load(write_gguf(tiny_dir, tmp_path / "b.gguf", tensors=extra), tmp_path)
    ints = {"rope_freqs.weight": (np.zeros((8,), np.int32), GGMLQuantizationType.I32)}
    with pytest.raises(ModelLoadError, match="I32"):
        _load(write_gguf(tiny_dir, tmp_path / "c.gguf", tensors=ints), tmp_path)


def test_truncated_files_are_refused_at_any_cut(files, tmp_path):
    data = files["Q8_0"].read_bytes()
    with GGUFFile.open(files["Q8_0"]) as file:
        header = file.data_offset
    rng = random.Random(3)
    cuts = [0, 3, 4, 8, 23, 24, 31, header - 1, header, len(data) - 1, *rng.sample(range(24, header), 40)]
    for cut in cuts:
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError):
            GGUFFile.open(path).close()


def _header(*, version=3, n_tensors=0, kvs=(), tensors=(), n_kv=None, magic=b"GGUF") -> bytes:
    def string(s: str | bytes) -> bytes:
        raw = s.encode() if isinstance(s, str) else s
        return struct.pack("<Q", len(raw)) + raw

    out = magic + struct.pack("<IQQ", version, n_tensors, len(kvs) if n_kv is None else n_kv)
    for key, kind, payload in kvs:
        out += string(key) + struct.pack("<I", kind) + payload
    for name, dims, kind, offset in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind, offset)
    return out


_STR = 8
_ARCH = ("general.architecture", _STR, struct.pack("<Q", 5) + b"llama")


@pytest.mark.parametrize(
    "data,match",
    [
        (b"GGML" + bytes(40), "bad magic"),
        (_header(version=1), "version 1"),
        (b"GGUF" + struct.pack(">I", 3) + bytes(16), "big-endian"),
        (_header(n_tensors=1 << 60), "tensor count"),
        (_header(n_kv=1 << 60), "metadata count"),
        (_header(kvs=[("k", _STR, struct.pack("<Q", 1 << 50))]), "value of 'k'"),
        (_header(kvs=[("k", 9, struct.pack("<IQ", 6, 1 << 58))]), "array 'k'"),
        (_header(kvs=[("k", 9, struct.pack("<IQ", 9, 1))]), "array of arrays"),
        (_header(kvs=[("k", 42, b"\0" * 8)]), "unknown value type 42"),
        (_header(kvs=[_ARCH, _ARCH]), "appears twice"),
        (_header(n_tensors=1, tensors=[("t", (32,) * 5, 0, 0)]), "5 dimensions"),
        (_header(n_tensors=1, tensors=[("t", (32,), 99, 0)]), "unknown tensor type 99"),
        (_header(n_tensors=1, tensors=[("t", (1 << 30, 1 << 30), 0, 0)]), "dimensions"),
        (_header(n_tensors=1, tensors=[("t", (16,), 2, 0)]), "not a multiple of its block"),
        (_header(n_tensors=1, tensors=[("t", (1 << 20,), 0, 0)]) + bytes(64), "outside"),
        (_header(n_tensors=1, tensors=[("t", (4,), 0, 3)]) + bytes(64), "unaligned"),
        (_header(n_tensors=2, tensors=[("a", (16,), 0, 0), ("b", (16,), 0, 32)]) + bytes(256), "overlap"),
        (_header(kvs=[("general.alignment", 4, struct.pack("<I", 3))]) + bytes(64), "alignment"),
    ],
)
def test_hostile_headers_are_refused_without_reading_past_the_file(tmp_path, data, match):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data.ljust(24, b"\0"))
    with pytest.raises(ModelLoadError, match=match):
        GGUFFile.open(path).close()


def test_random_header_damage_is_refused_typed_or_read(files, tmp_path):
    """Bytes flipped anywhere in the header: the file opens and maps, or is refused with a
    `ModelLoadError` — never another exception, a hang or an allocation the file cannot back."""
    data = files["Q4_0"].read_bytes()
    with GGUFFile.open(files["Q4_0"]) as file:
        header = file.data_offset
    rng = random.Random(11)
    refused = 0
    for _ in range(300):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(header)] = rng.randrange(256)
        path = tmp_path / "damaged.gguf"
        path.write_bytes(bytes(damaged))
        try:
            with GGUFFile.open(path) as file:
                arch = architecture(file)
                check_shapes(file, expected_shapes(model_config(file, arch), arch, file))
        except ModelLoadError:
            refused += 1
    assert refused > 0


# --- helpers -----------------------------------------------------------------------------------


def _write_raw(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _k_quant_blocks(kind: GGMLQuantizationType, rows: int, blocks: int) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Valid random Q6_K blocks: random quants and sub-scales, a small float16 scale last."""
    size = GGML_QUANT_SIZES[kind][1]
    raw = np.random.default_rng(0).integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    raw[..., -2:] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return raw.reshape(rows, blocks * size), kind


def _q5_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Valid random Q5_0 blocks (32 elements: a float16 scale, 4 bytes of high bits, 16 of nibbles)."""
    raw = rng.integers(0, 256, (rows, cols // 32, 22), dtype=np.uint8)
    raw[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw.reshape(rows, cols // 32 * 22)


def test_a_sentencepiece_vocabulary_goes_through_transformers_and_encodes_like_sentencepiece(tiny_dir, tmp_path):
    """`tokenizer.ggml.model = "llama"` (Llama 2, Mistral): a BPE sentencepiece model with byte
    fallback, written as llama.cpp's converter writes it, encodes ordinary text as sentencepiece does."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(p for p in Path(json.__file__).parent.joinpath("decoder.py").read_text().split("\n") if p.strip()) * 3)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=600, model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    kinds = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i) else 1 for i in range(sp.vocab_size())]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.vocab_size())],
        "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(sp.vocab_size())],
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.merges": None,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.padding_token_id": None,
        "tokenizer.ggml.add_bos_token": True,
    }
    path = write_gguf(tiny_dir, tmp_path / "spm.gguf", qtype="F32", metadata=metadata)
    tokenizer = _load(path, tmp_path).tokenizer
    for text in ("def decode(self, s):", "Return the Python representation of a JSON string.", "raise ValueError(errmsg)"):
        assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text)], text
        assert tokenizer.decode(sp.encode(text)) == text
