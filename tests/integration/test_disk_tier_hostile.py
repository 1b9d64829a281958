"""The disk tier against hostile or broken directories: answers never change, reads never block.

Each test seeds a directory with a cold runtime (its close waits for the writes), breaks it
the way a tamperer, a crash or a full disk would, and runs the prompt again on a restarted
runtime: the answer equals a runtime's without a disk tier, and the read ends in bounded time.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import anyio
import msgspec
import pytest

from protocols import Finished, GenerateRequest, TokenDelta
from protocols.errors import DiskCacheLockedError
from protocols.kv import DiskStats
from runtime import Runtime, kv_files
from runtime.config import GenerationConfig, KvConfig, LoggingConfig, RuntimeConfig, SchedulerConfig

CHUNK: Literal[64] = 64
PROMPT = 300  # four whole chunks (256 tokens) and a tail
MAX_TOKENS = 12
# Far more than a run takes (well under a second): a blocked read fails the test instead of hanging it.
DEADLINE_S = 60


def _config(cache_dir: Path | None) -> RuntimeConfig:
    kv = KvConfig(disk_cache_dir=str(cache_dir), disk_chunk_tokens=CHUNK, disk_min_tokens=CHUNK) if cache_dir is not None else KvConfig()
    return RuntimeConfig.for_model(
        "builtin:tiny",
        scheduler=SchedulerConfig(max_batch_size=8, prefill_chunk_size=64),
        kv=kv,
        generation=GenerationConfig(seed=0),
        logging=LoggingConfig(level="warning", format="json"),
    )


def _prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 for i in range(PROMPT)]


async def _run(rt: Runtime, prompt: list[int]) -> tuple[list[int], Finished]:
    tokens, finished = [], None
    with anyio.fail_after(DEADLINE_S):
        async for event in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)):
            if isinstance(event, TokenDelta):
                tokens += event.token_ids
            elif isinstance(event, Finished):
                finished = event
    assert finished is not None and finished.finish_reason == "length"
    return tokens, finished


async def _cold(prompt: list[int]) -> list[int]:
    async with Runtime.open(_config(None)) as rt:
        return (await _run(rt, prompt))[0]


async def _disk(rt: Runtime) -> DiskStats:
    disk = (await rt.stats()).kv.disk
    assert disk is not None
    return disk


async def _seed(root: Path, prompt: list[int]) -> list[Path]:
    """Write `prompt`'s four chunks under `root`; returns their files in position order."""
    with anyio.fail_after(DEADLINE_S):
        async with Runtime.open(_config(root)) as rt:
            await _run(rt, prompt)
            directory = Path((await _disk(rt)).directory)
    files = sorted(directory.glob("*.kv"), key=lambda path: kv_files.parse_header(path.read_bytes(), path.name)[0].start)
    assert len(files) == 4
    return files


def _events(err: str, name: str) -> list[dict]:
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == name]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _replace_with(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


def _huge(path: Path) -> Path:
    huge = path.with_name("huge.bin")  # (not a .kv name: the scan leaves it alone)
    with open(huge, "wb") as f:
        f.truncate(8 << 30)  # sparse: no disk used
    return huge


# Each breaks the third of four chunk files; `other` is the third chunk of another prompt.
DAMAGE: dict[str, Callable[[Path, Path], object]] = {
    "payload_flipped": lambda path, other: _flip(path, -3),
    "header_flipped": lambda path, other: _flip(path, len(kv_files.MAGIC) + 32 + 4 + 12),
    "digest_flipped": lambda path, other: _flip(path, len(kv_files.MAGIC) + 1),
    "truncated": lambda path, other: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    "zero_length": lambda path, other: path.write_bytes(b""),
    "symlink_to_another_chunk": lambda path, other: _replace_with(path, lambda p: p.symlink_to(p.with_name(sorted(p.parent.glob("*.kv"))[0].name))),
    "symlink_to_dev_zero": lambda path, other: _replace_with(path, lambda p: p.symlink_to("/dev/zero")),
    "symlink_to_huge_file": lambda path, other: _replace_with(path, lambda p: p.symlink_to(_huge(p))),
    "huge_sparse_file": lambda path, other: os.truncate(path, 8 << 30),
    "fifo": lambda path, other: _replace_with(path, lambda p: os.mkfifo(p, 0o600)),
    "directory": lambda path, other: _replace_with(path, lambda p: p.mkdir(mode=0o700)),
    "swapped_with_another_prefix": lambda path, other: path.write_bytes(other.read_bytes()),
}


@pytest.mark.parametrize("when", ["at_rest", "while_running"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_a_broken_chunk_file_never_changes_the_answer_nor_blocks_the_read(tmp_path, capsys, damage, when):
    prompt = _prompt(1)
    cold = await _cold(prompt)
    files = await _seed(tmp_path / "cache", prompt)
    other = (await _seed(tmp_path / "other", _prompt(2)))[2]
    victim = files[2]
    if when == "at_rest":  # the restart's scan meets it
        DAMAGE[damage](victim, other)
    with anyio.fail_after(DEADLINE_S):
        async with Runtime.open(_config(tmp_path / "cache")) as rt:
            if when == "while_running":  # indexed whole at start: the read meets it
                DAMAGE[damage](victim, other)
            warm, finished = await _run(rt, prompt)
            disk = await _disk(rt)
            # The refusal is counted or logged, and the tier goes on writing (the request wrote its chunks again).
            await _run(rt, _prompt(3))
            after = await _disk(rt)
    assert warm == cold
    assert finished.usage.cached_tokens == 2 * CHUNK  # the two chunks before it still served
    assert disk.removed_damaged >= 1 or _events(capsys.readouterr().err, "disk_files_ignored")
    assert after.writable and after.write_failures == 0 and after.error is None
    if damage != "directory":  # (a directory in its place is left alone)
        async with Runtime.open(_config(tmp_path / "cache")) as rt:
            again, finished = await _run(rt, prompt)
        assert again == cold and finished.usage.cached_tokens == 4 * CHUNK


async def test_a_header_nested_too_deep_is_damaged_not_a_crash(tmp_path):
    """A file with a good digest whose tensors' header nests JSON past the recursion limit."""
    prompt = _prompt(4)
    cold = await _cold(prompt)
    victim = (await _seed(tmp_path, prompt))[1]
    header, _ = kv_files.parse_header(victim.read_bytes(), victim.name)
    nested = b"[" * 200_000 + b"]" * 200_000
    victim.write_bytes(b"".join(kv_files.encode(header, len(nested).to_bytes(8, "little") + nested)))
    async with Runtime.open(_config(tmp_path)) as rt:
        warm, finished = await _run(rt, prompt)
        disk = await _disk(rt)
    assert warm == cold and finished.usage.cached_tokens == CHUNK and disk.removed_damaged == 3


async def test_a_second_runtime_on_a_locked_directory_is_refused_naming_it_and_the_first_serves_on(tmp_path):
    prompt = _prompt(5)
    cold = await _cold(prompt)
    async with Runtime.open(_config(tmp_path)) as first:
        with pytest.raises(DiskCacheLockedError, match=str(tmp_path)):
            async with Runtime.open(_config(tmp_path)):
                pass
        assert (await _run(first, prompt))[0] == cold
    # Another process holding the lock: refused as well (flock is per open file, across processes).
    (subdirectory,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    command = (
        f"import fcntl, os, sys; fd = os.open({str(subdirectory)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"
    )
    with subprocess.Popen([sys.executable, "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as holder:  # (closes its pipes)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            with pytest.raises(DiskCacheLockedError, match=str(tmp_path)):
                async with Runtime.open(_config(tmp_path)):
                    pass
        finally:
            holder.kill()
    # Its lock went with it: the directory serves the next runtime warm.
    async with Runtime.open(_config(tmp_path)) as rt:
        warm, finished = await _run(rt, prompt)
    assert warm == cold and finished.usage.cached_tokens == 4 * CHUNK


async def test_a_directory_that_cannot_be_created_degrades_to_ram_only_with_one_warning(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    prompt = _prompt(6)
    async with Runtime.open(_config(blocker / "cache")) as rt:
        first, _ = await _run(rt, prompt)
        again, finished = await _run(rt, prompt)
        kv = (await rt.stats()).kv
    assert first == again == await _cold(prompt)
    assert kv.disk is None and finished.usage.cached_tokens == PROMPT - 1  # the RAM tier serves
    (warning,) = _events(capsys.readouterr().err, "disk_cache_unavailable")
    assert warning["level"] == "warning" and str(blocker) in warning["directory"]


async def test_a_directory_that_refuses_writes_at_start_is_read_only_with_one_warning(tmp_path, capsys, monkeypatch):
    prompt = _prompt(7)
    cold = await _cold(prompt)
    await _seed(tmp_path, prompt)
    real_open = os.open

    def refusing_open(path, flags, *args, **kw):  # (root writes anywhere: refuse at the seam instead)
        if flags & os.O_CREAT and str(path).startswith(str(tmp_path)):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", refusing_open)
    async with Runtime.open(_config(tmp_path)) as rt:
        warm, finished = await _run(rt, prompt)
        other, _ = await _run(rt, _prompt(8))
        disk = await _disk(rt)
    assert warm == cold and finished.usage.cached_tokens == 4 * CHUNK
    assert other == await _cold(_prompt(8))
    assert not disk.writable and disk.writes == 0 and disk.write_failures == 0
    (warning,) = _events(capsys.readouterr().err, "disk_cache_read_only")
    assert warning["level"] == "warning"


async def test_a_disk_filling_up_mid_write_leaves_no_partial_file_and_ram_serves_on(tmp_path, capsys, monkeypatch):
    real_write = os.write
    room = {"bytes": 1000}  # then the disk is full

    def filling_write(fd, data):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if not path.startswith(str(tmp_path)) or ".probe-" in path:
            return real_write(fd, data)
        if room["bytes"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        done = real_write(fd, bytes(data[: room["bytes"]]))
        room["bytes"] -= done
        return done

    monkeypatch.setattr(os, "write", filling_write)
    prompt = _prompt(9)
    async with Runtime.open(_config(tmp_path)) as rt:
        first, _ = await _run(rt, prompt)
        again, finished = await _run(rt, prompt)
        await _run(rt, _prompt(10))
        disk = await _disk(rt)
    assert first == again == await _cold(prompt) and finished.usage.cached_tokens == PROMPT - 1
    assert disk.write_failures == 1 and not disk.writable and "No space" in (disk.error or "") and disk.entries == 0
    assert [path.name for path in Path(disk.directory).iterdir()] == []  # no temporary file, no partial entry
    (warning,) = _events(capsys.readouterr().err, "disk_write_failed")
    assert warning["level"] == "warning"


async def test_an_io_error_on_read_serves_the_prompt_cold(tmp_path, capsys, monkeypatch):
    prompt = _prompt(11)
    cold = await _cold(prompt)
    await _seed(tmp_path, prompt)

    def failing_readv(fd, buffers):
        raise OSError(errno.EIO, "Input/output error")

    async with Runtime.open(_config(tmp_path)) as rt:
        monkeypatch.setattr(os, "readv", failing_readv)  # (after the scan: only reads of whole files use readv)
        warm, finished = await _run(rt, prompt)
        monkeypatch.undo()
        again, _ = await _run(rt, prompt)
    assert warm == again == cold and finished.usage.cached_tokens == 0
    (warning,) = _events(capsys.readouterr().err, "disk_entry_damaged")
    assert "Input/output error" in warning["error"]


async def test_what_a_kill_mid_write_leaves_is_never_read_as_valid(tmp_path):
    """A leftover temporary file and a final file cut short (a torn write after a power loss)."""
    prompt = _prompt(12)
    cold = await _cold(prompt)
    files = await _seed(tmp_path, prompt)
    leftover = files[3].with_name(f".{files[3].name}.4242.tmp")
    leftover.write_bytes(files[3].read_bytes()[:100])
    files[2].write_bytes(files[2].read_bytes()[: files[2].stat().st_size - 1000])
    async with Runtime.open(_config(tmp_path)) as rt:
        warm, finished = await _run(rt, prompt)
    assert warm == cold and finished.usage.cached_tokens == 2 * CHUNK
    assert not leftover.exists()


@pytest.mark.slow
async def test_a_server_killed_mid_write_leaves_a_directory_the_next_one_serves_exactly(tmp_path):
    prompt = _prompt(13)
    child = textwrap.dedent(
        f"""
        import os, signal, anyio
        import tests.integration.test_disk_tier_hostile as t
        from runtime import Runtime
        real_write = os.write
        started = set()
        def killing_write(fd, data):
            path = os.readlink(f"/proc/self/fd/{{fd}}")
            if path.endswith(".tmp") and ".probe-" not in path:
                started.add(path)
                if len(started) == 3:  # the third entry file, half written
                    real_write(fd, bytes(data)[: len(data) // 2])
                    os.kill(os.getpid(), signal.SIGKILL)
            return real_write(fd, data)
        os.write = killing_write
        async def main():
            async with Runtime.open(t._config({str(tmp_path)!r})) as rt:
                await t._run(rt, {prompt!r})
        anyio.run(main)
        """
    )
    root = Path(__file__).resolve().parents[2]
    with anyio.fail_after(DEADLINE_S):
        done = await anyio.run_process([sys.executable, "-c", child], cwd=root, check=False)
    assert done.returncode == -signal.SIGKILL
    assert list(tmp_path.rglob("*.tmp"))  # it died mid-write
    async with Runtime.open(_config(tmp_path)) as rt:
        warm, finished = await _run(rt, prompt)
        disk = await _disk(rt)
    assert warm == await _cold(prompt)
    assert finished.usage.cached_tokens == 2 * CHUNK and disk.hits == 1  # the two files written before the kill
    assert not list(tmp_path.rglob("*.tmp"))


async def test_a_chunk_relabelled_with_a_later_chunks_key_is_never_served_at_that_position(tmp_path):
    """The first chunk's file renamed to the third's key, its header rewritten and its digest
    recomputed: its name, header and digest agree, but it holds positions 0:64, not 128:192."""
    prompt = _prompt(14)
    cold = await _cold(prompt)
    files = await _seed(tmp_path, prompt)
    first, _ = kv_files.parse_header(files[0].read_bytes(), files[0].name)
    third, _ = kv_files.parse_header(files[2].read_bytes(), files[2].name)
    data = files[0].read_bytes()
    _, end = kv_files.parse_header(data, files[0].name)
    relabelled = msgspec.structs.replace(first, key=third.key)
    files[2].write_bytes(b"".join(kv_files.encode(relabelled, data[end:])))
    async with Runtime.open(_config(tmp_path)) as rt:
        warm, finished = await _run(rt, prompt)
    assert warm == cold and finished.usage.cached_tokens == 2 * CHUNK
