"""No request or file can exhaust or starve the embedded runtime (issue 9), in process."""

from __future__ import annotations

import errno
import os
import random
import stat

import anyio
import msgspec
import pytest

from protocols import GenerateRequest, TokenDelta
from runtime import Runtime
from runtime import checkpoints as ck
from runtime.config import CheckpointConfig, LimitsConfig, SchedulerConfig
from runtime.errors import ConfigError, InvalidRequestError, RequestTooLargeError, RuntimeClosedError
from tests.support.config import make_config
from tests.support.events import collect
from tests.support.mlx_reference import greedy_tokens, load_reference


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _with(config, **sections):
    return msgspec.structs.replace(config, **sections)


# -- 5. huge prompts are refused by size, before tokenizing --------------------------------


async def test_a_prompt_too_large_for_the_context_is_refused_without_tokenizing(tiny_config, monkeypatch):
    async with Runtime.open(tiny_config) as rt:
        calls = []
        hf = rt.tokenizer._tokenizer  # mlx-lm's wrapper forwards encode to it
        real_encode = hf.encode
        monkeypatch.setattr(hf, "encode", lambda *a, **k: calls.append(1) or real_encode(*a, **k))
        for request in (
            GenerateRequest(prompt="word " * 1_500_000),
            GenerateRequest(messages=[{"role": "user", "content": "word " * 1_500_000}]),
        ):
            with pytest.raises(RequestTooLargeError) as info:
                async for _ in rt.generate(request):
                    pass
            assert info.value.field in ("prompt", "messages")
        assert calls == [], "a prompt that cannot fit was tokenized"
        # A prompt that fits is still served.
        outcome = await collect(rt.generate(GenerateRequest(prompt="def f(x):", max_tokens=3, ignore_eos=True)))
        assert outcome.last.finish_reason == "length"


# -- 6. stop strings are bounded, and many are matched at once ------------------------------


async def test_stop_strings_beyond_the_limits_are_refused(tiny_config):
    config = _with(tiny_config, limits=LimitsConfig(max_stop_strings=8, max_stop_bytes=64))
    async with Runtime.open(config) as rt:
        for stop in ([f"s{i}" for i in range(9)], ["x" * 65]):
            with pytest.raises(InvalidRequestError) as info:
                async for _ in rt.generate(GenerateRequest(prompt="x", stop=stop)):
                    pass
            assert info.value.field == "stop"


async def test_many_stop_strings_stop_exactly_where_one_would(tiny_config):
    prompt = _ids(20, 3)
    async with Runtime.open(tiny_config) as rt:
        free = await collect(rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=40, ignore_eos=True)))
        text = rt.tokenizer.decode(free.tokens)
        target = text[len(text) // 2 : len(text) // 2 + 3]
        decoys = [f"never-{i}-{target}" for i in range(60)]
        stopped = await collect(rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=40, ignore_eos=True, stop=[*decoys, target])))
    finished = stopped.last
    assert finished.finish_reason == "stop" and finished.stop_sequence == target
    streamed = "".join(e.text for e in stopped.events if isinstance(e, TokenDelta))
    assert streamed == text[: text.find(target)]


# -- 9. unread streams do not starve the embedding API -----------------------------------------


async def test_unread_streams_do_not_hold_batch_slots(tiny_config):
    """Regression: max_batch_size streams read once and left unread kept their slots forever."""
    config = _with(tiny_config, scheduler=SchedulerConfig(max_batch_size=2, prefill_chunk_size=16))
    model, tokenizer = load_reference("builtin:tiny")
    prompt = _ids(9, 5)
    async with Runtime.open(config) as rt:
        unread = [rt.generate(GenerateRequest(prompt_ids=_ids(10, 10 + i), max_tokens=1500, ignore_eos=True)).__aiter__() for i in range(2)]
        for stream in unread:
            await stream.__anext__()
        with anyio.fail_after(60):
            outcome = await collect(rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=20)))
        assert outcome.tokens == greedy_tokens(model, tokenizer, prompt, 20)
        for stream in unread:
            await stream.aclose()


async def test_reading_the_first_event_of_many_streams_in_one_task_completes(tiny_config):
    """Regression: reading the first event of 50 streams in turn deadlocked (8 slots, all paused)."""
    async with Runtime.open(tiny_config) as rt:
        streams = [rt.generate(GenerateRequest(prompt_ids=_ids(6, 100 + i), max_tokens=400, ignore_eos=True)).__aiter__() for i in range(50)]
        with anyio.fail_after(120):
            firsts = [await stream.__anext__() for stream in streams]
        assert all(isinstance(e, TokenDelta) and e.token_ids for e in firsts)
        for stream in streams:
            await stream.aclose()
        with anyio.fail_after(30):
            while (await rt.stats()).live_requests:
                await anyio.sleep(0.02)


async def test_a_caller_that_reads_nothing_is_cancelled_after_max_pause(tiny_config):
    config = _with(tiny_config, scheduler=SchedulerConfig(max_batch_size=8, prefill_chunk_size=16, max_pause_s=0.5))
    async with Runtime.open(config) as rt:
        stream = rt.generate(GenerateRequest(prompt_ids=_ids(8, 7), max_tokens=1500, ignore_eos=True)).__aiter__()
        await stream.__anext__()
        with anyio.fail_after(30):
            while (await rt.stats()).kv.live_requests:  # cancelled: its KV is released
                await anyio.sleep(0.05)
        rest = await collect(stream)
    assert rest.last.finish_reason == "cancelled"
    assert "max_pause_s" in rest.last.error and 0 < len(rest.tokens) < 1500


# -- 10 and 11. the checkpoint directory -------------------------------------------------------


def _checkpointed(config, directory, every: int = 0):
    return _with(config, checkpoints=CheckpointConfig(dir=str(directory), every_tokens=every))


async def test_an_unusable_checkpoint_directory_refuses_to_start_when_checkpoints_are_on(tiny_config, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ConfigError, match="every_tokens"):
        async with Runtime.open(_checkpointed(tiny_config, tmp_path / "file" / "ck", every=8)):
            pass


@pytest.mark.parametrize("problem", ["not-a-directory", "open-to-others"])
async def test_without_a_usable_directory_checkpoints_are_off_and_say_so(tiny_config, tmp_path, problem):
    if problem == "not-a-directory":
        (tmp_path / "file").write_text("x")
        directory = tmp_path / "file" / "ck"
    else:
        directory = tmp_path / "shared"
        directory.mkdir()
        os.chmod(directory, 0o777)
    async with Runtime.open(_checkpointed(tiny_config, directory)) as rt:
        assert not (await rt.stats()).kv.checkpoints_available
        with pytest.raises(InvalidRequestError) as info:
            async for _ in rt.generate(GenerateRequest(prompt="x", request_id="c1", checkpoint_every=4)):
                pass
        assert info.value.field == "checkpoint_every" and "unavailable" in str(info.value)
        outcome = await collect(rt.generate(GenerateRequest(prompt="x", max_tokens=3, ignore_eos=True)))
        assert outcome.last.finish_reason == "length"
    if problem == "open-to-others":
        assert list(directory.iterdir()) == []


async def test_checkpoint_files_are_private(tiny_config, tmp_path):
    directory = tmp_path / "ck"
    request = GenerateRequest(prompt_ids=_ids(12, 9), max_tokens=600, ignore_eos=True, request_id="private", checkpoint_every=4)
    async with Runtime.open(_checkpointed(tiny_config, directory)) as rt:
        stream = rt.generate(request).__aiter__()
        with anyio.fail_after(30):
            while not ck.path_for(directory, "private").exists():
                await stream.__anext__()
        mode = stat.S_IMODE(ck.path_for(directory, "private").stat().st_mode)
        await stream.aclose()
    assert mode == 0o600 and stat.S_IMODE(directory.stat().st_mode) == 0o700


async def test_failed_checkpoint_writes_are_reported_and_leave_nothing_behind(tiny_config, tmp_path, monkeypatch):
    directory = tmp_path / "ck"
    real_write = os.write

    def full_disk(fd, data):
        if os.fstat(fd).st_size or not stat.S_ISREG(os.fstat(fd).st_mode):
            return real_write(fd, data)
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    request = GenerateRequest(prompt_ids=_ids(12, 9), max_tokens=24, ignore_eos=True, request_id="full", checkpoint_every=4)
    async with Runtime.open(_checkpointed(tiny_config, directory)) as rt:
        monkeypatch.setattr(os, "write", full_disk)
        outcome = await collect(rt.generate(request))
        stats = (await rt.stats()).kv
        monkeypatch.undo()
    report = outcome.last.checkpoint
    assert report is not None and report.failed >= 1 and report.written == 0 and "No space left" in report.error
    assert stats.checkpoints_failed >= 1
    assert [p.name for p in directory.iterdir()] == [], "a partial checkpoint file was left behind"


async def test_written_checkpoints_are_counted(tiny_config, tmp_path):
    request = GenerateRequest(prompt_ids=_ids(12, 9), max_tokens=24, ignore_eos=True, request_id="counted", checkpoint_every=4)
    async with Runtime.open(_checkpointed(tiny_config, tmp_path / "ck")) as rt:
        outcome = await collect(rt.generate(request))
        # The report holds the writes confirmed when the request ended (on a busy machine the
        # last ones may still be on their way); the store counts each one as it lands.
        with anyio.fail_after(30):
            while (stats := (await rt.stats()).kv).checkpoints_written < 1:
                await anyio.sleep(0.02)
    report = outcome.last.checkpoint
    assert report is not None and report.failed == 0 and report.error is None
    assert report.written <= stats.checkpoints_written and stats.checkpoints_failed == 0


# -- 12. smaller ---------------------------------------------------------------------------------


async def test_stats_after_close_is_a_typed_error(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        pass
    with pytest.raises(RuntimeClosedError):
        await rt.stats()


async def test_every_seed_is_a_64_bit_unsigned_integer(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        for seed in (-1, 1 << 64):
            with pytest.raises(InvalidRequestError) as info:
                async for _ in rt.generate(GenerateRequest(prompt="x", sampling=msgspec.structs.replace(GenerateRequest().sampling, seed=seed))):
                    pass
            assert info.value.field == "sampling.seed"


def test_tiny_config_fixture_is_what_these_tests_assume(tiny_config):
    assert tiny_config == make_config()
