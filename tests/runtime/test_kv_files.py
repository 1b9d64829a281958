"""The disk tier's files: format, checks on read, the start-up scan, the directory lock."""

from __future__ import annotations

import os
import stat
import threading

import numpy as np
import pytest

from policies.disk_index import DiskEntry, chunk_keys, whole_key
from protocols.errors import DiskCacheError, DiskCacheLockedError
from runtime.kv_files import DamagedEntryError, DiskCacheUnavailableError, DiskFiles, Identity, encode, parse_header

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
    found, removed, ignored = files.scan(whole=False)
    assert removed == ignored == 0 and {e.key for e in found} == {e.key for e in entries}
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
    found, removed, _ = files.scan(whole=False)
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
    # The link is neither served nor followed.
    with pytest.raises(DamagedEntryError):
        files.read(DiskEntry(key="f" * 64, num_bytes=0, end=4), TOKENS[:4])
    found, removed, ignored = files.scan(whole=False)
    assert {e.key for e in found} == {e.key for e in kept}
    assert removed == 4 and ignored == 0  # the link itself went, not the file it pointed to
    assert sorted(p.name for p in files.directory.iterdir()) == sorted([*(f"{e.key}.kv" for e in kept), "notes.txt"])


def test_a_whole_entry_keeps_its_tokens_and_a_chunk_directory_refuses_it(tmp_path):
    files = _open(tmp_path)
    key = whole_key(None, TOKENS)
    files.write(DiskEntry(key=key, num_bytes=0, end=8, tokens=tuple(TOKENS)), TOKENS, _arrays())
    (found,), removed, _ = files.scan(whole=True)
    assert found.tokens == tuple(TOKENS) and found.end == 8 and removed == 0
    assert files.scan(whole=False) == ([], 1, 0)  # the wrong kind for the model: removed


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


def test_links_fifos_and_leftovers_in_an_entrys_place_are_removed_and_a_directory_is_left_alone(tmp_path):
    files = _open(tmp_path)
    kept = _write_chain(files)
    outside = tmp_path / "outside.kv"
    outside.write_bytes(b"not ours to remove")
    os.symlink(outside, files.directory / f"{'a' * 64}.kv")
    os.symlink("/dev/zero", files.directory / f"{'b' * 64}.kv")
    os.mkfifo(files.directory / f"{'c' * 64}.kv")
    os.mkfifo(files.directory / ".x.kv.77.tmp")
    (files.directory / f"{'d' * 64}.kv").mkdir()
    found, removed, ignored = files.scan(whole=False)
    assert {e.key for e in found} == {e.key for e in kept} and removed == 4 and ignored == 1
    assert sorted(p.name for p in files.directory.iterdir()) == sorted([*(f"{e.key}.kv" for e in kept), f"{'d' * 64}.kv"])
    assert outside.read_bytes() == b"not ours to remove"


def test_a_directory_in_an_entrys_place_refuses_that_entry_only(tmp_path):
    files = _open(tmp_path)
    keys = chunk_keys(None, TOKENS, 4)
    files.path(keys[0]).mkdir()
    with pytest.raises(DamagedEntryError, match="directory"):  # (a ValueError: the tier skips it, writes go on)
        files.write(DiskEntry(key=keys[0], num_bytes=0, end=4), TOKENS[:4], _arrays())
    assert files.write(DiskEntry(key=keys[1], num_bytes=0, end=8, parent=keys[0]), TOKENS[4:], _arrays()) > 0
    assert not list(files.directory.glob("*.tmp"))


def test_a_fifo_at_a_temporary_name_never_blocks_opening_or_writing(tmp_path):
    files = _open(tmp_path)
    files.close()
    entry = DiskEntry(key=chunk_keys(None, TOKENS, 4)[0], num_bytes=0, end=4)
    fifos = [files.directory / f".probe-{os.getpid()}.tmp", files.directory / f".{entry.key}.kv.{os.getpid()}.tmp"]
    outcome: list[object] = []

    def open_and_write() -> None:
        for fifo in fifos:
            os.mkfifo(fifo)
        try:
            outcome.append(files.open())  # (its probe meets the first FIFO)
            files.write(entry, TOKENS[:4], _arrays())  # (and the entry the second one)
        except OSError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=open_and_write, daemon=True)
    worker.start()
    worker.join(timeout=20)
    if worker.is_alive():  # blocked on a FIFO with no reader: open each one to let it go, and fail
        for fifo in fifos:
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        worker.join(timeout=5)
        pytest.fail("opening a FIFO for writing blocked")
    files.close()
    assert outcome[0] is False or outcome[0] is True
    assert isinstance(outcome[-1], OSError) and not isinstance(outcome[-1], FileNotFoundError)  # that one write failed, in bounded time


def test_an_entry_is_only_ever_created_under_a_temporary_name(tmp_path, monkeypatch):
    """What a kill mid-write leaves is a temporary file (removed by the next scan), never a torn entry."""
    files = _open(tmp_path)
    created, real_open = [], os.open

    def recording_open(path, flags, *args, **kw):
        if flags & os.O_CREAT:
            created.append(os.fspath(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", recording_open)
    entries = _write_chain(files)
    assert len(created) == 2 and all(path.endswith(".tmp") for path in created)
    assert {p.name for p in files.directory.iterdir()} == {f"{e.key}.kv" for e in entries}


def test_a_directory_that_cannot_be_created_is_unavailable_not_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(DiskCacheUnavailableError, match="cannot be created"):
        DiskFiles(blocker / "cache", IDENTITY, max_file_bytes=1).open()
    # A file where the directory should be is a configuration error (as before).
    with pytest.raises(DiskCacheError, match="not a directory"):
        DiskFiles(blocker, IDENTITY, max_file_bytes=1).open()
