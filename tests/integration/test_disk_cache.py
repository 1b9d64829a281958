"""The prefix cache's disk tier (`kv.disk_cache_dir`): warm after a restart, exact, and safe.

Each runtime here is a restart: the first one computes a prompt cold and writes its prefix
through to disk (its close waits for the writes), the next one is a new process's view of
the same directory (a fresh index rebuilt from the files).
"""

from __future__ import annotations

import errno
import json
import random
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta
from protocols.errors import DiskCacheLockedError
from protocols.kv import DiskStats
from runtime import Runtime, kv_files
from runtime.config import GenerationConfig, KvConfig, LoggingConfig, RuntimeConfig, SchedulerConfig, TracingConfig
from tests.support.mlx_reference import greedy_tokens, load_reference

CHUNK = 64
PROMPT = 300  # four whole chunks (256 tokens) and a tail
MAX_TOKENS = 12


def _config(cache_dir, model: str = "builtin:tiny", **kv) -> RuntimeConfig:
    options = {"disk_cache_dir": str(cache_dir), "disk_chunk_tokens": CHUNK, "disk_min_tokens": CHUNK, **kv}
    return RuntimeConfig.for_model(
        model,
        scheduler=SchedulerConfig(max_batch_size=8, prefill_chunk_size=64),
        kv=KvConfig(**options),
        generation=GenerationConfig(seed=0),
        logging=LoggingConfig(level="warning", format="json"),
    )


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


async def _run(rt: Runtime, prompt: list[int], **kw) -> tuple[list[int], Finished]:
    tokens, finished = [], None
    async for event in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, **kw)):
        if isinstance(event, TokenDelta):
            tokens += event.token_ids
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    return tokens, finished


async def _cold_then_restarted(config: RuntimeConfig, prompt: list[int], **kw) -> tuple[tuple[list[int], Finished], tuple[list[int], Finished], DiskStats]:
    async with Runtime.open(config) as rt:
        cold = await _run(rt, prompt, **kw)
    async with Runtime.open(config) as rt:
        warm = await _run(rt, prompt, **kw)
        stats = (await rt.stats()).kv.disk
        page = {s.name: s.value for family in text_string_to_metric_families(rt.metrics.render().decode()) for s in family.samples}
    assert stats is not None
    # /metrics reports what the stats do.
    assert page["mlxrt:kv_disk_hits_total"] == stats.hits and page["mlxrt:kv_disk_tokens_loaded_total"] == stats.tokens_loaded
    assert page["mlxrt:kv_disk_bytes"] == stats.bytes > 0 and page["mlxrt:kv_disk_entries"] == stats.entries
    return cold, warm, stats


@pytest.mark.parametrize(
    ("model", "kv", "cached"),
    [
        ("builtin:tiny", {}, 4 * CHUNK),
        ("builtin:tiny", {"block_size": 16}, 4 * CHUNK),  # paged: read straight into blocks
        ("builtin:tiny-kv", {"bits": 8}, 4 * CHUNK),  # quantized KV, in its packed form
        pytest.param("builtin:tiny-kv", {"bits": 4, "quantized_start": 100}, 4 * CHUNK, marks=pytest.mark.slow),  # and a float head
        ("builtin:tiny-gemma3", {}, PROMPT - 1),  # sliding windows: whole, where they were saved
        pytest.param("builtin:tiny-lfm2", {}, PROMPT - 1, marks=pytest.mark.slow),  # recurrent state: likewise
    ],
)
async def test_a_restarted_runtime_answers_a_seen_prompt_from_disk_with_the_same_tokens(tmp_path, model, kv, cached):
    prompt = _ids(PROMPT, 1)
    (cold, fin_cold), (warm, fin_warm), disk = await _cold_then_restarted(_config(tmp_path, model, **kv), prompt)
    assert fin_cold.usage.cached_tokens == 0
    assert fin_warm.usage.cached_tokens == cached
    assert warm == cold and fin_warm.finish_reason == fin_cold.finish_reason
    assert disk.hits == 1 and disk.tokens_loaded == cached and disk.removed_damaged == 0
    if model == "builtin:tiny" and not kv.get("bits"):
        reference, tokenizer = load_reference(model)
        assert warm == greedy_tokens(reference, tokenizer, prompt, MAX_TOKENS)


async def test_seeded_sampling_from_a_disk_hit_equals_the_cold_run(tmp_path):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    (cold, _), (warm, fin_warm), disk = await _cold_then_restarted(_config(tmp_path), _ids(PROMPT, 2), sampling=sampling)
    assert fin_warm.usage.cached_tokens == 4 * CHUNK and disk.hits == 1
    assert warm == cold


async def test_a_shared_system_prompt_is_stored_once_and_seeds_other_questions(tmp_path):
    system = _ids(2 * CHUNK, 3)
    config = _config(tmp_path)
    async with Runtime.open(config) as rt:
        for seed in range(4):
            await _run(rt, system + _ids(100, 10 + seed))
    async with Runtime.open(config) as rt:
        disk = (await rt.stats()).kv.disk
        # Each request kept 128 + 100 + 11 positions: the system prompt's two chunks (stored
        # once) and one chunk of its own; the 47-position tails are never stored.
        assert disk.entries == 2 + 4
        tokens, finished = await _run(rt, system + _ids(30, 99))
    assert finished.usage.cached_tokens == 2 * CHUNK
    reference, tokenizer = load_reference("builtin:tiny")
    assert tokens == greedy_tokens(reference, tokenizer, system + _ids(30, 99), MAX_TOKENS)


async def test_a_damaged_file_is_removed_and_the_request_is_served_as_if_cold(tmp_path):
    prompt = _ids(PROMPT, 4)
    config = _config(tmp_path)
    async with Runtime.open(config) as rt:
        cold, _ = await _run(rt, prompt)
        directory = (await rt.stats()).kv.disk.directory
    # Damage the third chunk's tensors (its header still reads: the scan keeps it).
    third = _chunk_files(directory)[2]
    damaged = bytearray(third.read_bytes())
    damaged[-3] ^= 0xFF
    third.write_bytes(bytes(damaged))
    async with Runtime.open(config) as rt:
        warm, finished = await _run(rt, prompt)
        disk = (await rt.stats()).kv.disk
    assert warm == cold
    assert finished.usage.cached_tokens == 2 * CHUNK  # the two chunks before it still served
    assert disk.removed_damaged == 2  # it, and the chunk after it
    # The request's own entry wrote them again, whole.
    assert third.read_bytes() != bytes(damaged)
    async with Runtime.open(config) as rt:
        again, finished = await _run(rt, prompt)
    assert again == cold and finished.usage.cached_tokens == 4 * CHUNK


def _chunk_files(directory: str) -> list[Path]:
    """A directory's chunk files in position order (one prompt's chain)."""
    files = list(Path(directory).glob("*.kv"))
    return sorted(files, key=lambda path: kv_files.parse_header(path.read_bytes(), path.name)[0].start)


async def test_a_full_disk_degrades_to_ram_only_and_no_request_fails(tmp_path, monkeypatch):
    def full(self, entry, tokens, arrays):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_files.DiskFiles, "write", full)
    async with Runtime.open(_config(tmp_path)) as rt:
        first, fin_first = await _run(rt, _ids(PROMPT, 5))
        again, fin_again = await _run(rt, _ids(PROMPT, 5))
        stats = (await rt.stats()).kv
    assert fin_first.finish_reason == fin_again.finish_reason == "length" and first == again
    assert fin_again.usage.cached_tokens == PROMPT - 1  # the RAM tier still serves
    assert stats.disk.write_failures == 1 and not stats.disk.writable and "No space" in stats.disk.error
    assert stats.disk.entries == 0


async def test_a_read_only_directory_serves_what_it_holds_and_writes_nothing(tmp_path, monkeypatch):
    prompt = _ids(PROMPT, 6)
    config = _config(tmp_path)
    async with Runtime.open(config) as rt:
        cold, _ = await _run(rt, prompt)
    # (Root writes anywhere, so a read-only directory is what the probe reports.)
    monkeypatch.setattr(kv_files.private_files, "prepare_directory", lambda directory, writable=True: False)
    async with Runtime.open(config) as rt:
        warm, finished = await _run(rt, prompt)
        await _run(rt, _ids(PROMPT, 7))
        disk = (await rt.stats()).kv.disk
    assert warm == cold and finished.usage.cached_tokens == 4 * CHUNK
    assert not disk.writable and disk.writes == 0 and "read-only" in disk.error and disk.entries == 4


async def test_two_runtimes_of_one_model_cannot_share_a_directory(tmp_path):
    async with Runtime.open(_config(tmp_path)) as rt:
        with pytest.raises(DiskCacheLockedError):
            async with Runtime.open(_config(tmp_path)):
                pass
        # Another model beside it: a directory of its own.
        async with Runtime.open(_config(tmp_path, "builtin:tiny-qwen2")) as other:
            await _run(other, _ids(PROMPT, 8))
        await _run(rt, _ids(PROMPT, 8))


@pytest.mark.slow
async def test_the_disk_holds_at_most_its_bytes(tmp_path):
    config = _config(tmp_path)
    async with Runtime.open(config) as rt:
        await _run(rt, _ids(PROMPT, 9))
    async with Runtime.open(config) as rt:  # (its writes are done once the first one closed)
        one_prompt = (await rt.stats()).kv.disk.bytes
    assert one_prompt > 0
    capped = _config(tmp_path / "capped", disk_cache_bytes=int(one_prompt * 1.5))
    async with Runtime.open(capped) as rt:
        for seed in range(4):  # the last prompt is the most recent on disk
            await _run(rt, _ids(PROMPT, 20 + seed))
    async with Runtime.open(capped) as rt:
        rebuilt = (await rt.stats()).kv.disk
        _, finished = await _run(rt, _ids(PROMPT, 23))
    # Four prompts' chunks were written; the least recent went as each write passed the cap.
    assert rebuilt.bytes <= one_prompt * 1.5 and rebuilt.entries <= 6  # of 16 written
    assert finished.usage.cached_tokens == 4 * CHUNK


async def test_a_disk_read_is_a_span_of_its_request(tmp_path):
    span_log = tmp_path / "spans.jsonl"
    config = msgspec.structs.replace(_config(tmp_path / "cache"), tracing=TracingConfig(span_log=str(span_log)))
    prompt = _ids(PROMPT, 11)
    await _cold_then_restarted(config, prompt, request_id="seen-before")
    lines = [json.loads(line) for line in span_log.read_text().splitlines()]
    (read,) = [line for line in lines if line["name"] == "disk_read"]
    assert read["request_id"] == "seen-before" and read["parent"] == "request"
    assert read["attributes"]["tokens"] == 4 * CHUNK and read["attributes"]["files"] == 4 and read["duration_s"] > 0


@pytest.mark.server
async def test_a_restarted_http_server_answers_a_long_system_prompt_warm_through_the_openai_client(tmp_path):
    from tests.support.http_serving import serving

    tools_prompt = "You call tools. " + "def compute(y): return y + 1  # a tool the model may call\n" * 24
    messages = [{"role": "system", "content": tools_prompt}, {"role": "user", "content": "What is compute(2)?"}]
    answers = []
    for _ in range(2):  # a server, then a new one on the same directory
        async with serving(_config(tmp_path)) as served:
            client = served.client()
            answers.append(await client.chat.completions.create(model=served.model, messages=messages, max_tokens=12, temperature=0))
            await client.close()
    cold, warm = answers
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= CHUNK and cached % CHUNK == 0 and warm.usage.prompt_tokens - cached < CHUNK
    assert warm.choices[0].message.content == cold.choices[0].message.content
