"""The disk tier's files: format, checks on read, the start-up scan, the directory lock."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from policies.disk_index import DiskEntry, chunk_keys, whole_key
from protocols.errors import DiskCacheError, DiskCacheLockedError
from runtime.kv_files import DamagedEntryError, DiskFiles, Identity, encode, parse_header

IDENTITY = Identity(model_id="model-a", tokenizer_id="tok-a", kv_format="float")
TOKENS = list(range(10, 18))


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"0.keys": rng.standard_normal((1, 2, 4, 8)).astype(np.float32), "0.values": rng.standard_normal((1, 2, 4, 8)).astype(np.float32)}


def _open(root, identity: Identity = IDENTITY) -> DiskFiles:
    files = DiskFiles(root, identity, max_file_bytes=1 << 20)
    assert files.open()
    return files


def _write_chain(files: DiskFiles) -> list[DiskEntry]:
    keys = chunk_keys(None, TOKENS, 4)
    entries = [DiskEntry(key=keys[0], num_bytes=0, end=4), DiskEntry(key=keys[1], num_bytes=0, end=8, parent=keys[0])]
    for i, entry in enumerate(entries):
        assert files.write(entry, TOKENS[entry.end - 4 : entry.end], _arrays(i)) > 0
    return entries


def test_an_entry_reads_back_exactly_and_the_scan_finds_it(tmp_path):
    files = _open(tmp_path)
    entries = _write_chain(files)
    tensors = files.read(entries[1], TOKENS[4:])
    assert all(np.array_equal(tensors[name], array) for name, array in _arrays(1).items())
    found, removed = files.scan(whole=False)
    assert removed == 0 and {e.key for e in found} == {e.key for e in entries}
    assert {e.key: e.parent for e in found}[entries[1].key] == entries[0].key
    path = files.path(entries[0].key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(files.directory.stat().st_mode) == 0o700
    files.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_file_is_never_read(tmp_path, damage):
    files = _open(tmp_path)
    entry = _write_chain(files)[0]
    path = files.path(entry.key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x40  # a bit in the tensors: only the digest can tell
    path.write_bytes(bytes(data[: len(data) // 2] if damage == "truncate" else b"" if damage == "empty" else data))
    with pytest.raises(DamagedEntryError):
        files.read(entry, TOKENS[:4])


def test_a_file_for_other_tokens_or_another_name_is_refused(tmp_path):
    files = _open(tmp_path)
    first, second = _write_chain(files)
    with pytest.raises(DamagedEntryError, match="another entry"):
        files.read(first, [0, 0, 0, 0])
    # A file renamed to another key: its header says otherwise.
    os.replace(files.path(second.key), files.path("c" * 64))
    with pytest.raises(DamagedEntryError):
        files.read(DiskEntry(key="c" * 64, num_bytes=0, end=8, parent=first.key), TOKENS[4:])
    found, removed = files.scan(whole=False)
    assert removed == 1 and [e.key for e in found] == [first.key] and not files.path("c" * 64).exists()


def test_the_scan_removes_foreign_damaged_and_leftover_files(tmp_path):
    other = DiskFiles(tmp_path, Identity("model-b", "tok-a", "float"), max_file_bytes=1 << 20)
    assert other.open()
    stray = _write_chain(other)[0]
    other.close()
    files = _open(tmp_path)
    kept = _write_chain(files)
    # Another model's file moved into this model's directory, a damaged header, a leftover.
    os.replace(other.path(stray.key), files.directory / f"{'d' * 64}.kv")
    (files.directory / f"{'e' * 64}.kv").write_bytes(b"MLXRTKV1" + b"\0" * 40)
    (files.directory / ".x.kv.123.tmp").write_bytes(b"partial")
    (files.directory / "notes.txt").write_text("left alone")
    os.symlink(files.path(kept[0].key), files.directory / f"{'f' * 64}.kv")
    found, removed = files.scan(whole=False)
    assert {e.key for e in found} == {e.key for e in kept}
    assert removed == 3
    assert sorted(p.name for p in files.directory.iterdir()) == sorted([*(f"{e.key}.kv" for e in kept), f"{'f' * 64}.kv", "notes.txt"])
    # The link is neither served nor followed.
    with pytest.raises(DamagedEntryError):
        files.read(DiskEntry(key="f" * 64, num_bytes=0, end=4), TOKENS[:4])


def test_a_whole_entry_keeps_its_tokens_and_a_chunk_directory_refuses_it(tmp_path):
    files = _open(tmp_path)
    key = whole_key(None, TOKENS)
    files.write(DiskEntry(key=key, num_bytes=0, end=8, tokens=tuple(TOKENS)), TOKENS, _arrays())
    (found,), removed = files.scan(whole=True)
    assert found.tokens == tuple(TOKENS) and found.end == 8 and removed == 0
    assert files.scan(whole=False) == ([], 1)  # the wrong kind for the model: removed


def test_one_server_per_directory_and_model(tmp_path):
    files = _open(tmp_path)
    with pytest.raises(DiskCacheLockedError):
        DiskFiles(tmp_path, IDENTITY, max_file_bytes=1).open()
    # Another model, or another KV format, has a directory of its own.
    assert DiskFiles(tmp_path, Identity("model-a", "tok-a", "int8/g64/start0"), max_file_bytes=1).open()
    files.close()
    again = DiskFiles(tmp_path, IDENTITY, max_file_bytes=1)
    assert again.open()
    again.close()


def test_a_directory_others_can_write_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    with pytest.raises(DiskCacheError, match="written by others"):
        DiskFiles(root, IDENTITY, max_file_bytes=1).open()


@pytest.mark.parametrize(
    "tensors",
    [
        b"",
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json",
        b"\x40\x00\x00\x00\x00\x00\x00\x00" + b'{"0.keys":{"dtype":"F32","shape":[1,2,4,8],"data_offsets":[0,256]}}',
    ],
)
def test_tensors_that_do_not_parse_are_damaged_even_with_a_good_digest(tmp_path, tensors):
    files = _open(tmp_path)
    entry = _write_chain(files)[0]
    path = files.path(entry.key)
    header, _ = parse_header(path.read_bytes(), path.name)
    path.write_bytes(b"".join(encode(header, tensors)))  # digest recomputed: only the tensors are wrong
    with pytest.raises(DamagedEntryError, match="unreadable tensors"):
        files.read(entry, TOKENS[:4])
