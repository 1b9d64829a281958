"""Adapter files read off the MLX thread (`engine.lora.read_adapter_files`): the size bound
checked before reading, the safetensors parse, the digest; and the bank loading an evicted
adapter only from files staged for the step."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from engine.lora import HEADER_ALLOWANCE, AdapterBank, max_adapter_bytes, read_adapter_files, read_staged
from policies.adapters import adapter_digest
from protocols.errors import AdapterLoadError
from tests.support.config import builtin_dir
from tests.support.mlx_reference import load_reference
from tests.support.spies import record_opens
from tools.lora_adapters import make_lora_adapter

MAX_RANK = 64


@pytest.fixture(scope="module")
def model():
    return load_reference("builtin:tiny")[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_lora_adapter(builtin_dir("tiny"), root / name, rank=4, num_layers=1, seed=i) for i, name in enumerate("ABC")}


def test_the_bound_is_a_max_rank_float32_adapter_on_every_linear_layer(model, tmp_path):
    # builtin:tiny: 2 blocks of q (64->64), k, v (64->32), o (64->64), gate, up (64->128), down (128->64).
    per_block = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64)
    bound = max_adapter_bytes(model, MAX_RANK)
    assert bound == MAX_RANK * 2 * per_block * 4 + HEADER_ALLOWANCE
    # mlx-lm's own adapter of that rank on every linear layer of every block fits, and is the bound's tensors.
    largest = make_lora_adapter(builtin_dir("tiny"), tmp_path / "largest", rank=MAX_RANK, num_layers=2)
    files = read_adapter_files("largest", largest, bound)
    assert sum(t.nbytes for t in files.tensors.values()) == bound - HEADER_ALLOWANCE
    assert (largest / "adapters.safetensors").stat().st_size <= bound


def test_a_weights_file_over_the_bound_is_refused_on_its_size(made, tmp_path, monkeypatch):
    huge = shutil.copytree(made["A"], tmp_path / "huge")
    weights = huge / "adapters.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(3 * 2**30)  # sparse: no disk, but a read and a hash would take seconds
    opened = record_opens(monkeypatch)
    with pytest.raises(AdapterLoadError) as refused:
        read_adapter_files("huge", huge, 10_000)
    assert weights.resolve() not in opened  # refused on its size, never read
    assert str(weights) in str(refused.value) and "3,221,225,472 bytes" in str(refused.value) and "10,000" in str(refused.value)
    # One byte over is over; the file's own size is not.
    size = (made["A"] / "adapters.safetensors").stat().st_size
    with pytest.raises(AdapterLoadError, match="over the"):
        read_adapter_files("A", made["A"], size - 1)
    assert read_adapter_files("A", made["A"], size).digest == adapter_digest(made["A"])
    assert (made["A"] / "adapters.safetensors").resolve() in opened  # (a file read is seen)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_tensors_read_as_mlx_loads_them_in_float32(made, tmp_path, dtype):
    directory = shutil.copytree(made["A"], tmp_path / "cast")
    stored = {k: v.astype(dtype) for k, v in mx.load(str(directory / "adapters.safetensors")).items()}
    mx.save_safetensors(str(directory / "adapters.safetensors"), stored)
    files = read_adapter_files("cast", directory, 1 << 20)
    assert files.digest == adapter_digest(directory) and (files.rank, files.scale) == (4, 20.0)
    assert set(files.tensors) == set(stored)
    for key, value in stored.items():
        assert files.tensors[key].dtype == np.float32
        assert np.array_equal(files.tensors[key], np.array(value.astype(mx.float32)))


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        (b"\x01", "no header"),
        ((1000).to_bytes(8, "little") + b"{}", "no header"),
        (len(b"[1]").to_bytes(8, "little") + b"[1]", "not a JSON object"),
        (b"", "no header"),
    ],
)
def test_a_weights_file_that_is_not_safetensors_is_refused(made, tmp_path, weights, expected):
    directory = shutil.copytree(made["A"], tmp_path / "bad")
    (directory / "adapters.safetensors").write_bytes(weights)
    with pytest.raises(AdapterLoadError, match=expected):
        read_adapter_files("bad", directory, 1 << 20)


def _raw_safetensors(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ({"x.lora_a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, "F64"),
        ({"x.lora_a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, "do not fit"),
        ({"x.lora_a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}, "do not fit"),
        ({"x.lora_a": {"dtype": "F32", "shape": "4"}}, "no shape"),
        ({"__metadata__": {"format": "mlx"}}, "no LoRA weights"),
    ],
)
def test_a_header_that_does_not_fit_its_data_is_refused(made, tmp_path, header, expected):
    directory = shutil.copytree(made["A"], tmp_path / "header")
    (directory / "adapters.safetensors").write_bytes(_raw_safetensors(header, bytes(16)))
    with pytest.raises(AdapterLoadError, match=expected):
        read_adapter_files("header", directory, 1 << 20)


def test_an_oversized_config_file_is_refused(made, tmp_path):
    directory = shutil.copytree(made["A"], tmp_path / "config")
    with open(directory / "adapter_config.json", "r+b") as f:
        f.truncate(2 << 20)
    with pytest.raises(AdapterLoadError, match=r"adapter_config\.json is 2,097,152 bytes"):
        read_adapter_files("config", directory, 1 << 20)


def _bank(made, max_resident: int) -> AdapterBank:
    model = load_reference("builtin:tiny")[0]  # a fresh model: the bank wraps its layers
    bank = AdapterBank(model, max_resident, MAX_RANK)
    for name in "ABC":
        bank.register(read_adapter_files(name, made[name], bank.max_file_bytes))
    return bank


def test_an_evicted_adapter_loads_from_staged_files_only(made, tmp_path):
    bank = _bank(made, max_resident=1)  # C is resident, A and B evicted
    digest = bank.info("A").digest
    with pytest.raises(AdapterLoadError, match="not read before the step"):
        bank.acquire("A", digest)
    wanted = bank.reserve(["A"])
    assert wanted == [("A", str(made["A"]))]
    with bank.staged(read_staged(wanted, bank.max_file_bytes)):
        slot = bank.acquire("A", digest)
        assert bank.acquire("A", digest) == slot, "a second request of the step shares the slot"
    assert bank.info("A").resident and bank.info("A").users == 2 and not bank.info("C").resident
    assert bank.reserve(["A"]) == [], "a resident adapter needs no files"


def test_a_staged_read_that_failed_fails_the_requests_that_need_it(made, tmp_path):
    own = shutil.copytree(made["A"], tmp_path / "A")
    model = load_reference("builtin:tiny")[0]
    bank = AdapterBank(model, 1, MAX_RANK)
    bank.register(read_adapter_files("A", own, bank.max_file_bytes))
    bank.register(read_adapter_files("B", made["B"], bank.max_file_bytes))  # A is evicted
    digest = bank.info("A").digest
    config = json.loads((own / "adapter_config.json").read_text())
    (own / "adapter_config.json").write_text(json.dumps(config | {"num_layers": 2}))
    staged = read_staged(bank.reserve(["A"]), bank.max_file_bytes)
    with bank.staged(staged), pytest.raises(AdapterLoadError, match="changed since it was loaded"):
        bank.acquire("A", digest)
    shutil.rmtree(own)
    with bank.staged(read_staged(bank.reserve(["A"]), bank.max_file_bytes)):
        for _ in range(2):  # every request that needs it gets the reason
            with pytest.raises(AdapterLoadError, match=r"needs adapter_config\.json"):
                bank.acquire("A", digest)
    assert bank.info("B").resident


def test_adapters_a_step_names_are_not_evicted_by_its_loads(made):
    bank = _bank(made, max_resident=2)  # B and C resident (B least recently used), A evicted
    assert [a.name for a in bank.infos() if a.resident] == ["B", "C"]
    digests = {name: bank.info(name).digest for name in "ABC"}
    wanted = bank.reserve(["A", "B"])
    with bank.staged(read_staged(wanted, bank.max_file_bytes)):
        bank.acquire("A", digests["A"])  # evicts C, not B (least recently used, but named by the step)
        bank.acquire("B", digests["B"])
    assert {a.name: a.resident for a in bank.infos()} == {"A": True, "B": True, "C": False}
