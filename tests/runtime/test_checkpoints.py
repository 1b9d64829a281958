"""The checkpoint file format: atomic writes, and typed rejection of anything unusable."""

from __future__ import annotations

import errno
import hashlib
import os
import stat

import msgspec
import pytest

from engine.model.loader import model_digest, tokenizer_digest
from protocols.api import GenerateRequest
from runtime import checkpoints as ck
from runtime.errors import CheckpointNotFoundError, CorruptCheckpointError, ForeignCheckpointError, InvalidRequestError, UnsupportedCheckpointError

MODEL, TOKENIZER = "m" * 64, "t" * 64
MAX_BYTES = 1 << 20


def read(directory, request_id="r1", max_bytes=MAX_BYTES):
    return ck.read(directory, request_id, model_id=MODEL, tokenizer_id=TOKENIZER, max_bytes=max_bytes)


def raw_file(body: bytes, tensors: bytes = b"", magic: bytes = ck.MAGIC) -> bytes:
    """A checkpoint file around any header bytes, with a correct digest."""
    framed = len(body).to_bytes(4, "big") + body
    return magic + hashlib.sha256(framed + tensors).digest() + framed + tensors


def _header(tensors: bytes, **changes) -> ck.CheckpointHeader:
    fields = dict(
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
    )
    fields.update(changes)
    return ck.CheckpointHeader(**fields)


def _write(tmp_path, tensors: bytes = b"\x01\x02" * 100, **changes):
    return ck.write_atomic(tmp_path, "r1", ck.encode(_header(tensors, **changes), tensors))


def test_round_trip_and_no_temporary_files_left(tmp_path):
    path = _write(tmp_path)
    header, tensors = read(tmp_path)
    assert header.generated == [5, 6, 7, 8] and header.seed == 7 and tensors == b"\x01\x02" * 100
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        read(tmp_path)


@pytest.mark.parametrize("cut", [3, 10, 40, -1])
def test_truncated_checkpoints_are_corrupt(tmp_path, cut):
    path = _write(tmp_path)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(CorruptCheckpointError):
        read(tmp_path)


def test_altered_tensor_bytes_are_corrupt(tmp_path):
    path = _write(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        read(tmp_path)


def test_not_a_checkpoint_is_corrupt(tmp_path):
    ck.path_for(tmp_path, "r1").write_bytes(b"hello world, certainly not a checkpoint")
    with pytest.raises(CorruptCheckpointError):
        read(tmp_path)


@pytest.mark.parametrize("version", [b"1", b"2", b"3", b"4", b"6"])
def test_other_format_versions_are_unsupported(tmp_path, version):
    body = msgspec.json.encode(_header(b""))
    ck.path_for(tmp_path, "r1").write_bytes(raw_file(body, magic=b"MLXRTCK" + version))
    with pytest.raises(UnsupportedCheckpointError):
        read(tmp_path)


@pytest.mark.parametrize("field", ["model_id", "tokenizer_id"])
def test_foreign_model_or_tokenizer_is_rejected(tmp_path, field):
    _write(tmp_path, **{field: "x" * 64})
    with pytest.raises(ForeignCheckpointError):
        read(tmp_path)


def test_a_header_for_another_request_is_corrupt(tmp_path):
    tensors = b"abc"
    header = _header(tensors, request=GenerateRequest(prompt_ids=[1], request_id="other"))
    ck.write_atomic(tmp_path, "r1", ck.encode(header, tensors))
    with pytest.raises(CorruptCheckpointError):
        read(tmp_path)


@pytest.mark.parametrize(
    "body",
    [
        msgspec.json.encode({"model_id": 3}),
        b"[" * 100_000,  # regression: a RecursionError took the server down
        b"{" * 50_000 + b"}" * 50_000,
        b"\xff\xfe not json",
    ],
    ids=["wrong-types", "deep-brackets", "deep-objects", "not-json"],
)
def test_invalid_headers_with_a_valid_digest_are_corrupt(tmp_path, body):
    ck.path_for(tmp_path, "r1").write_bytes(raw_file(body))
    with pytest.raises(CorruptCheckpointError):
        read(tmp_path)


def test_an_altered_header_fails_the_checksum_before_it_is_parsed(tmp_path):
    path = _write(tmp_path)
    data = bytearray(path.read_bytes())
    start = len(ck.MAGIC) + 32 + 4
    data[start : start + 3] = b"[[["
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        read(tmp_path)


@pytest.mark.parametrize("request_id", ["../escape", "a/b", "", "x" * 300, "sp ace", "nul\x00", "../../etc/passwd"])
def test_unsafe_request_ids_cannot_name_files(tmp_path, request_id):
    with pytest.raises(InvalidRequestError) as info:
        ck.path_for(tmp_path, request_id)
    assert info.value.field == "request_id"


# -- what sits at the checkpoint's path (regressions: OOM, hang, crash) ----------------


def test_a_symlink_is_refused_without_being_followed(tmp_path):
    os.symlink("/dev/zero", ck.path_for(tmp_path, "r1"))
    with pytest.raises(CorruptCheckpointError, match="cannot be opened"):
        read(tmp_path, max_bytes=1 << 40)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(ck.path_for(tmp_path, "r1"))
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        read(tmp_path)


def test_a_directory_is_refused(tmp_path):
    ck.path_for(tmp_path, "r1").mkdir()
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        read(tmp_path)


def test_a_file_larger_than_the_model_allows_is_refused_unread(tmp_path):
    path = _write(tmp_path, tensors=b"\x00" * 4096)
    with pytest.raises(CorruptCheckpointError, match="more than"):
        read(tmp_path, max_bytes=path.stat().st_size - 1)


# -- writing --------------------------------------------------------------------------


def test_files_are_private(tmp_path):
    ck.prepare_directory(tmp_path / "ck")
    path = _write(tmp_path / "ck")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "ck").stat().st_mode) == 0o700


def test_a_failed_write_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    old = _write(tmp_path)
    before = old.read_bytes()
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, bytes(data[:10]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        _write(tmp_path, tensors=b"\x03" * 300)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == [old.name]
    assert old.read_bytes() == before


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_directory_others_can_write_is_refused(tmp_path, mode):
    directory = tmp_path / "ck"
    directory.mkdir()
    os.chmod(directory, mode)
    with pytest.raises(ck.CheckpointDirError, match="written by others"):
        ck.prepare_directory(directory)


def test_a_path_that_is_not_a_directory_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ck.CheckpointDirError):
        ck.prepare_directory(tmp_path / "file")
    with pytest.raises(ck.CheckpointDirError):
        ck.prepare_directory(tmp_path / "file" / "below")


def test_expiry_removes_old_files_only(tmp_path):
    old = _write(tmp_path)
    os.utime(old, (1000.0, 1000.0))
    fresh = ck.write_atomic(tmp_path, "r2", b"data")
    odd = ck.path_for(tmp_path, "odd")
    odd.mkdir()
    os.utime(odd, (1000.0, 1000.0))
    assert ck.expire(tmp_path, max_age_s=3600) == [old.name]
    assert not old.exists() and fresh.exists() and odd.is_dir()


def test_model_and_tokenizer_digests_change_with_content(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    model, tokenizer = model_digest(tmp_path), tokenizer_digest(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "tokenizer.json").write_text('{"b": 1}')
    assert model_digest(tmp_path) != model and tokenizer_digest(tmp_path) != tokenizer
