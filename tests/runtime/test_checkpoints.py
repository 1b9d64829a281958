"""The checkpoint file format: atomic writes, and typed rejection of anything unusable."""

from __future__ import annotations

import hashlib
import os

import msgspec
import pytest

from protocols.api import GenerateRequest
from runtime import checkpoints as ck

MODEL, TOKENIZER = "m" * 64, "t" * 64


def _header(tensors: bytes, **changes) -> ck.CheckpointHeader:
    fields = dict(
        format_version=ck.FORMAT_VERSION,
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        request=GenerateRequest(prompt_ids=[1, 2, 3], request_id="r1", checkpoint_every=4),
        prompt_ids=[1, 2, 3],
        seed=7,
        max_tokens=20,
        stop_token_ids=[0],
        generated=[5, 6, 7, 8],
        num_kv_tokens=6,
        created_at=1.0,
        tensors_sha256=hashlib.sha256(tensors).hexdigest(),
    )
    fields.update(changes)
    return ck.CheckpointHeader(**fields)


def _write(tmp_path, tensors: bytes = b"\x01\x02" * 100, **changes):
    return ck.write_atomic(tmp_path, "r1", ck.encode(_header(tensors, **changes), tensors))


def test_round_trip_and_no_temporary_files_left(tmp_path):
    path = _write(tmp_path)
    header, tensors = ck.read(tmp_path, "r1", model_id=MODEL, tokenizer_id=TOKENIZER)
    assert header.generated == [5, 6, 7, 8] and header.seed == 7 and tensors == b"\x01\x02" * 100
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_missing_checkpoint(tmp_path):
    with pytest.raises(ck.CheckpointNotFoundError):
        ck.read(tmp_path, "r1", model_id=MODEL, tokenizer_id=TOKENIZER)


@pytest.mark.parametrize("cut", [3, 10, 40, -1])
def test_truncated_checkpoints_are_corrupt(tmp_path, cut):
    path = _write(tmp_path)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(ck.CorruptCheckpointError):
        ck.read(tmp_path, "r1", model_id=MODEL, tokenizer_id=TOKENIZER)


def test_altered_tensor_bytes_are_corrupt(tmp_path):
    path = _write(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ck.CorruptCheckpointError, match="checksum"):
        ck.read(tmp_path, "r1", model_id=MODEL, tokenizer_id=TOKENIZER)


def test_not_a_checkpoint_is_corrupt(tmp_path):
    ck.path_for(tmp_path, "r1").write_bytes(b"hello world, certainly not a checkpoint")
    with pytest.raises(ck.CorruptCheckpointError):
        ck.read(tmp_path, "r1", model_id=MODEL, tokenizer_id=TOKENIZER)


def test_other_format_version_is_unsupported(tmp_path):
    _write(tmp_path, format_version=ck.FORMAT_VERSION + 1)
    with pytest.raises(ck.UnsupportedCheckpointError):
        ck.read(tmp_path, "r1", model_id=MODEL, tokenizer_id=TOKENIZER)


@pytest.mark.parametrize("field", ["model_id", "tokenizer_id"])
def test_foreign_model_or_tokenizer_is_rejected(tmp_path, field):
    _write(tmp_path, **{field: "x" * 64})
    with pytest.raises(ck.ForeignCheckpointError):
        ck.read(tmp_path, "r1", model_id=MODEL, tokenizer_id=TOKENIZER)


def test_a_header_for_another_request_is_corrupt(tmp_path):
    tensors = b"abc"
    header = _header(tensors, request=GenerateRequest(prompt_ids=[1], request_id="other"))
    ck.write_atomic(tmp_path, "r1", ck.encode(header, tensors))
    with pytest.raises(ck.CorruptCheckpointError):
        ck.read(tmp_path, "r1", model_id=MODEL, tokenizer_id=TOKENIZER)


def test_invalid_header_fields_are_corrupt(tmp_path):
    body = msgspec.json.encode({"format_version": ck.FORMAT_VERSION, "model_id": 3})
    ck.path_for(tmp_path, "r1").write_bytes(ck.MAGIC + len(body).to_bytes(4, "big") + body)
    with pytest.raises(ck.CorruptCheckpointError):
        ck.read(tmp_path, "r1", model_id=MODEL, tokenizer_id=TOKENIZER)


@pytest.mark.parametrize("request_id", ["../escape", "a/b", "", "x" * 300, "sp ace"])
def test_unsafe_request_ids_cannot_name_files(tmp_path, request_id):
    with pytest.raises(ck.CheckpointError):
        ck.path_for(tmp_path, request_id)


def test_expiry_removes_old_files_only(tmp_path):
    old = _write(tmp_path)
    os.utime(old, (1000.0, 1000.0))
    fresh = ck.write_atomic(tmp_path, "r2", b"data")
    assert ck.expire(tmp_path, max_age_s=3600) == [old.name]
    assert not old.exists() and fresh.exists()


def test_model_and_tokenizer_digests_change_with_content(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    model, tokenizer = ck.model_digest(tmp_path), ck.tokenizer_digest(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "tokenizer.json").write_text('{"b": 1}')
    assert ck.model_digest(tmp_path) != model and ck.tokenizer_digest(tmp_path) != tokenizer
