"""Signed files: the one layout checkpoints and disk-tier entries share, and files written in
that layout by hand (as the code before `runtime.signed_files` wrote them) still read."""

from __future__ import annotations

import hashlib
import json

import msgspec
import numpy as np
import pytest
import safetensors.numpy

from policies.disk_index import DiskEntry, chunk_keys
from protocols.api import GenerateRequest
from runtime import checkpoints as ck
from runtime import kv_files
from runtime.errors import CorruptCheckpointError, UnsupportedCheckpointError
from runtime.signed_files import AlteredFileError, ForeignFileError, OtherVersionError, SignedFormat, TruncatedFileError

FORMAT = SignedFormat(b"TESTFMT", 3)


def hand_written(magic: bytes, header: bytes, payload: bytes) -> bytes:
    """The layout spelled out: magic | sha256(length + header + payload) | length (u32 BE) | header | payload."""
    framed = len(header).to_bytes(4, "big") + header
    return magic + hashlib.sha256(framed + payload).digest() + framed + payload


def test_the_layout_is_magic_digest_frame_payload():
    data = b"".join(FORMAT.encode(b'{"a":1}', b"payload"))
    assert data == hand_written(b"TESTFMT3", b'{"a":1}', b"payload")
    assert FORMAT.open(data) == (b'{"a":1}', len(data) - len(b"payload"))
    assert FORMAT.header_size(data[: FORMAT.min_bytes]) == 7


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", ForeignFileError),
        (b"OTHERFMT" + bytes(40), ForeignFileError),
        (hand_written(b"TESTFMT4", b"{}", b"x"), OtherVersionError),
        (hand_written(b"TESTFMT3", b"{}", b"x")[:-1], AlteredFileError),
        (b"TESTFMT3" + hashlib.sha256(b"\x00\x00\x00\x09{}").digest() + b"\x00\x00\x00\x09{}", TruncatedFileError),
    ],
)
def test_each_unreadable_file_has_its_own_error(data, error):
    with pytest.raises(error):
        FORMAT.open(data)


def test_a_checkpoint_in_the_version_5_layout_reads_back_and_is_written_the_same():
    header = ck.CheckpointHeader(
        model_id="m",
        tokenizer_id="t",
        request=GenerateRequest(prompt_ids=[1, 2, 3], request_id="r1"),
        prompt_ids=[1, 2, 3],
        seed=7,
        max_tokens=9,
        stop_token_ids=[0],
        generated=[5],
        num_kv_tokens=3,
        created_at=1.0,
    )
    body = msgspec.json.encode(header)  # (the header's own encoding: the layout around it is what is checked)
    golden = hand_written(b"MLXRTCK5", body, b"tensors")
    assert ck.encode(header, b"tensors") == golden
    decoded, tensors = ck.decode(golden)
    assert decoded == header and tensors == b"tensors"
    with pytest.raises(UnsupportedCheckpointError, match="'4'"):
        ck.decode(hand_written(b"MLXRTCK4", body, b"tensors"))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        ck.decode(golden[:-1] + b"T")


def test_a_disk_tier_entry_in_the_version_1_layout_reads_back_and_is_written_the_same(tmp_path):
    identity = kv_files.Identity(model_id="model-a", tokenizer_id="tok-a", kv_format="float")
    files = kv_files.DiskFiles(tmp_path, identity, max_file_bytes=1 << 20)
    assert files.open()
    tokens = [10, 11, 12, 13]
    entry = DiskEntry(key=chunk_keys(None, tokens, 4)[0], num_bytes=0, end=4)
    arrays = {"0.keys": np.arange(16, dtype=np.float32).reshape(1, 2, 2, 4)}
    header = {
        "kind": "chunk",
        "key": entry.key,
        "model_id": "model-a",
        "tokenizer_id": "tok-a",
        "kv_format": "float",
        "namespace": None,
        "start": 0,
        "end": 4,
        "parent": None,
        "tokens": tokens,
        "created_at": 1.0,
    }
    tensors = safetensors.numpy.save(arrays)
    golden = hand_written(b"MLXRTKV1", json.dumps(header, separators=(",", ":")).encode(), tensors)
    files.path(entry.key).write_bytes(golden)
    assert np.array_equal(files.read(entry, tokens)["0.keys"], arrays["0.keys"])
    found, removed, _ = files.scan(whole=False)
    assert removed == 0 and [e.key for e in found] == [entry.key]
    assert b"".join(kv_files.encode(kv_files.EntryHeader(**header), tensors)) == golden  # type: ignore[arg-type]
    files.close()
