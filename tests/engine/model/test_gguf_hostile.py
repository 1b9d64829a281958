"""Hostile GGUF files: every header lie (counts, lengths, dims, offsets, types, alignment) is a
`ModelLoadError` naming it, in memory bounded by the file and not by what it claims; a path that
is not a regular file is refused without blocking; metadata of the wrong type for the
architecture or the tokenizer is refused typed; MLX's own GGUF reader is never handed the file."""

from __future__ import annotations

import ast
import os
import struct
import threading
import tracemalloc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.model.gguf import load_gguf
from engine.model.gguf.format import GGUFFile
from protocols.errors import ModelLoadError
from tests.support.config import builtin_dir
from tests.support.gguf_files import gguf_header, gguf_string, write_gguf

STR, ARR, U8, U32, U64, F32 = 8, 9, 0, 4, 10, 6
BIG = 1 << 63
MAX_U64 = (1 << 64) - 1
# Far below anything a claimed count or length would need: the refusal reads only the header.
PEAK_BYTES = 16 * 1024 * 1024


def _kv(key: str, kind: int, payload: bytes) -> tuple[str, int, bytes]:
    return (key, kind, payload)


def _tensor(name: str = "t", dims: tuple[int, ...] = (32,), kind: int = 0, offset: int = 0) -> tuple[str, tuple[int, ...], int, int]:
    return (name, dims, kind, offset)


def _string_past_end() -> bytes:
    # A value whose length is one byte more than the file holds after it.
    head = gguf_header(n_kv=1) + gguf_string("k") + struct.pack("<I", STR)
    return head + struct.pack("<Q", 9) + b"12345678"


HOSTILE = {
    "empty file": (b"", "0 bytes"),
    "only the magic": (b"GGUF", "4 bytes"),
    "a header cut short": (gguf_header()[:23], "23 bytes"),
    "version 0": (gguf_header(version=0), "version 0"),
    "version 4": (gguf_header(version=4), "version 4"),
    "version 2**32-1": (gguf_header(version=(1 << 32) - 1), "version"),
    "2**63 tensors": (gguf_header(n_tensors=BIG), "tensor count"),
    "2**64-1 tensors": (gguf_header(n_tensors=MAX_U64), "tensor count"),
    "2**63 metadata pairs": (gguf_header(n_kv=BIG), "metadata count"),
    "a key of 2**63 bytes": (gguf_header(n_kv=1) + gguf_string("k", BIG) + bytes(64), "metadata key"),
    "a string of 2**63 bytes": (gguf_header(kvs=(_kv("k", STR, gguf_string("v", BIG)),)), "value of 'k'"),
    "a string one byte past the end": (_string_past_end(), "value of 'k'"),
    "an array of 2**63 bytes": (gguf_header(kvs=(_kv("k", ARR, struct.pack("<IQ", U8, BIG)),)), "array 'k'"),
    "an array of 2**63 strings": (gguf_header(kvs=(_kv("k", ARR, struct.pack("<IQ", STR, BIG)),)), "array 'k'"),
    "an array of 2**64-1 u64": (gguf_header(kvs=(_kv("k", ARR, struct.pack("<IQ", U64, MAX_U64)),)), "array 'k'"),
    "an array element of 2**63 bytes": (gguf_header(kvs=(_kv("k", ARR, struct.pack("<IQ", STR, 1) + gguf_string("", BIG)),)), "element of 'k'"),
    "arrays of arrays, deeply": (gguf_header(kvs=(_kv("k", ARR, struct.pack("<IQ", ARR, 1) * 10_000),)), "array of arrays"),
    "an array of an unknown type": (gguf_header(kvs=(_kv("k", ARR, struct.pack("<IQ", 99, 1)),)), "unknown type 99"),
    "an unknown value type": (gguf_header(kvs=(_kv("k", 1 << 31, bytes(8)),)), "unknown value type"),
    "a metadata key twice": (gguf_header(kvs=(_kv("k", U32, bytes(4)), _kv("k", U32, bytes(4)))), "appears twice"),
    "a tensor name of 2**63 bytes": (gguf_header(n_tensors=1) + gguf_string("t", BIG) + bytes(64), "tensor name"),
    "a tensor of 0 dims": (gguf_header(tensors=(_tensor(dims=()),)) + bytes(64), "0 dimensions"),
    "a tensor of 5 dims": (gguf_header(tensors=(_tensor(dims=(32, 1, 1, 1, 1)),)), "5 dimensions"),
    "a tensor of 2**32-1 dims": (gguf_header(n_tensors=1) + gguf_string("t") + struct.pack("<I", (1 << 32) - 1) + bytes(64), "dimensions"),
    "a zero dim": (gguf_header(tensors=(_tensor(dims=(32, 0)),)), "dimensions"),
    "a dim negative as int64": (gguf_header(tensors=(_tensor(dims=(32, BIG)),)), "dimensions"),
    "a dim of 2**64-1": (gguf_header(tensors=(_tensor(dims=(MAX_U64,)),)), "dimensions"),
    "dims whose product overflows int64": (gguf_header(tensors=(_tensor(dims=(1 << 32, 1 << 32, 1 << 32)),)), "dimensions"),
    "an unknown ggml type": (gguf_header(tensors=(_tensor(kind=(1 << 32) - 1),)), "unknown tensor type"),
    "a tensor name twice": (gguf_header(tensors=(_tensor("a"), _tensor("a", offset=128))) + bytes(512), "appears twice"),
    "an offset past the end": (gguf_header(tensors=(_tensor(offset=1 << 40),)) + bytes(256), "outside"),
    "an offset that wraps around": (gguf_header(tensors=(_tensor(offset=MAX_U64 - 31),)) + bytes(256), "outside"),
    "an unaligned offset": (gguf_header(tensors=(_tensor(offset=4),)) + bytes(256), "unaligned"),
    "a tensor past the end": (gguf_header(tensors=(_tensor(dims=(64, 64)),)) + bytes(256), "outside"),
    "overlapping tensors": (gguf_header(tensors=(_tensor("a", (64,)), _tensor("b", (64,), offset=128))) + bytes(1024), "overlap"),
    "alignment 0": (gguf_header(kvs=(_kv("general.alignment", U32, struct.pack("<I", 0)),)) + bytes(64), "alignment"),
    "alignment 48": (gguf_header(kvs=(_kv("general.alignment", U32, struct.pack("<I", 48)),)) + bytes(64), "alignment"),
    "alignment 2**62": (gguf_header(kvs=(_kv("general.alignment", U64, struct.pack("<Q", 1 << 62)),)) + bytes(64), "alignment"),
    "alignment a float": (gguf_header(kvs=(_kv("general.alignment", F32, struct.pack("<f", 32.0)),)) + bytes(64), "alignment"),
    "alignment a string": (gguf_header(kvs=(_kv("general.alignment", STR, gguf_string("32")),)) + bytes(64), "alignment"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_header_is_refused_naming_the_lie_in_bounded_memory(tmp_path, name):
    data, match = HOSTILE[name]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(ModelLoadError, match=match):
            GGUFFile.open(path).close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"{name}: {peak} bytes allocated to refuse a {len(data)}-byte file"


def test_a_fifo_named_like_a_model_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def opening() -> None:
        try:
            GGUFFile.open(fifo).close()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=opening, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # blocked in open(): a writer end releases it, then the test fails
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("opening a FIFO blocked until a writer came")
    assert isinstance(outcome[0], ModelLoadError) and "not a regular file" in str(outcome[0])
    with pytest.raises(ModelLoadError, match=r"not a regular file|cannot read"):
        GGUFFile.open(tmp_path)


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return builtin_dir("tiny")


def _load(path: Path, cache: Path):
    return load_gguf(path, cache_root=cache, keeps_quantized=lambda _: None)


@pytest.mark.parametrize(
    "metadata, match",
    [
        ({"tokenizer.ggml.merges": [1, 2, 3]}, "merges is ndarray"),
        ({"tokenizer.ggml.merges": 7}, "merges is int"),
        ({"tokenizer.ggml.pre": ["gpt2", "x"]}, "pre-tokenizer"),
        ({"tokenizer.ggml.token_type": 3}, "token_type is int"),
        ({"tokenizer.ggml.token_type": ["control"]}, "token_type is list"),
        ({"tokenizer.ggml.eos_token_id": True}, "eos_token_id = True"),
        ({"tokenizer.ggml.merges": ["Ġ t", "zz yy"]}, "does not make a tokenizer"),
        ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, "not a finite number"),
        ({"llama.rope.freq_base": 0.0}, "must be positive"),
        ({"llama.rope.freq_base": float("-inf")}, "not a finite number"),
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": float("inf")}, "not a finite number"),
        (
            {
                "llama.attention.head_count": 64,
                "llama.attention.head_count_kv": 32,
                "llama.attention.key_length": 1,
                "llama.attention.value_length": 1,
                "llama.rope.dimension_count": 1,
            },
            "head size 1 is odd",
        ),
    ],
)
def test_metadata_of_the_wrong_type_or_value_is_refused_typed(tiny_dir, tmp_path, metadata, match):
    path = write_gguf(tiny_dir, tmp_path / "m.gguf", qtype="F32", metadata=metadata)
    with pytest.raises(ModelLoadError, match=match):
        _load(path, tmp_path / "cache")


def test_a_byte_level_vocabulary_that_is_not_utf8_is_refused_typed(tiny_dir, tmp_path):
    path = write_gguf(tiny_dir, tmp_path / "m.gguf", qtype="F32")
    data = bytearray(path.read_bytes())
    # The first token's first byte made 0xff (never UTF-8): the reader keeps it as a surrogate.
    at = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4 + 8 + 8
    data[at] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.tokens\[0\] is not UTF-8"):
        _load(path, tmp_path / "cache")


def test_mlx_own_gguf_reader_is_never_given_the_file(tiny_dir, tmp_path, monkeypatch):
    """MLX's C++ reader trusts the header; the loader reads it in Python only (a hostile file
    must never reach code that could crash the server)."""
    calls: list[tuple] = []

    def spy(*args: object, **kw: object) -> None:
        calls.append(args)
        raise AssertionError("mx.load was called")

    monkeypatch.setattr(mx, "load", spy)
    path = write_gguf(tiny_dir, tmp_path / "m.gguf", qtype="Q8_0")
    loaded = _load(path, tmp_path / "cache")
    assert np.isfinite(np.array(loaded.model(mx.array([[1, 2, 3]])))).all()
    for name in ("a string of 2**63 bytes", "overlapping tensors", "dims whose product overflows int64"):
        (tmp_path / "hostile.gguf").write_bytes(HOSTILE[name][0])
        with pytest.raises(ModelLoadError):
            _load(tmp_path / "hostile.gguf", tmp_path / "cache")
    assert calls == []


def test_no_serving_module_calls_mlx_own_file_reader():
    """`mx.load` on a GGUF whose header claims 2**63 tensors segfaults, and on one claiming
    2**32-1 dims aborts (mlx 0.32.4, its gguflib): a file read by the server goes through
    `GGUFFile`'s checks first, never straight to MLX's C++ reader."""
    root = Path(__file__).resolve().parents[3]
    calls = []
    for package in ("engine", "runtime", "actors", "net", "policies"):
        for source in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(source.read_text(), str(source))):
                func = node.func if isinstance(node, ast.Call) else None
                if isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name) and func.value.id in ("mx", "core"):
                    calls.append(f"{source.relative_to(root)}:{func.lineno}")
    assert calls == []
