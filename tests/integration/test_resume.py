"""Durable decode checkpoints and exact resume, in process."""

from __future__ import annotations

import json
import random

import anyio
import pytest

from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta
from runtime import InvalidRequestError, Runtime
from runtime.checkpoints import CheckpointNotFoundError, CorruptCheckpointError, path_for
from runtime.config import CheckpointConfig, GenerationConfig, LoggingConfig, RuntimeConfig, SchedulerConfig

# Long enough that a request cannot end before its first checkpoint reaches the disk, even on a
# loaded machine (the writer is asynchronous; an ended request's checkpoint is deleted).
MAX_TOKENS = 400


def _config(directory) -> RuntimeConfig:
    return RuntimeConfig.for_model(
        "builtin:tiny",
        scheduler=SchedulerConfig(max_batch_size=8, prefill_chunk_size=16),
        checkpoints=CheckpointConfig(dir=str(directory)),
        generation=GenerationConfig(seed=0),
        logging=LoggingConfig(level="warning", format="json"),
    )


def _request(rid: str, sampling: SamplingParams) -> GenerateRequest:
    prompt = [random.Random(3).randrange(1000) for _ in range(21)]
    return GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, request_id=rid, checkpoint_every=8, sampling=sampling)


async def _tokens(events) -> tuple[list[list[int]], Finished]:
    deltas, finished = [], None
    async for event in events:
        if isinstance(event, TokenDelta):
            deltas.append(event.token_ids)
        elif isinstance(event, Finished):
            finished = event
    return deltas, finished


SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=42)}


async def test_a_client_cancel_deletes_the_checkpoint(tmp_path):
    left_with_a_checkpoint = False
    async with Runtime.open(_config(tmp_path)) as rt:
        async for event in rt.generate(_request("gone", SamplingParams())):
            if isinstance(event, TokenDelta) and path_for(tmp_path, "gone").exists():
                left_with_a_checkpoint = True
                break  # leaving the stream cancels the request
        assert left_with_a_checkpoint, "the request ended before its first checkpoint reached the disk"
        with anyio.fail_after(5):
            while path_for(tmp_path, "gone").exists():
                await anyio.sleep(0.01)


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=pytest.mark.slow if kind == "seeded" else ()) for kind in SAMPLINGS])
async def test_shutdown_keeps_the_checkpoint_and_resume_continues_exactly(tmp_path, kind):
    sampling = SAMPLINGS[kind]
    async with Runtime.open(_config(tmp_path / "a")) as rt:
        deltas, _ = await _tokens(rt.generate(_request("r", sampling)))
    uninterrupted = [t for d in deltas for t in d]

    directory = tmp_path / "b"
    async with Runtime.open(_config(directory)) as rt:
        # Stream until a checkpoint exists, then shut the runtime down under the open stream.
        stream = rt.generate(_request("r", sampling)).__aiter__()
        seen = 0
        while seen < 20:
            event = await stream.__anext__()
            seen += len(event.token_ids) if isinstance(event, TokenDelta) else 0
        await _checkpointed(directory, "r")
    assert path_for(directory, "r").exists(), "a shutdown keeps the checkpoint"

    async with Runtime.open(_config(directory)) as rt:
        deltas, finished = await _tokens(rt.resume("r"))
        with anyio.fail_after(5):  # a finished request's checkpoint is deleted
            while path_for(directory, "r").exists():
                await anyio.sleep(0.01)
    replayed = deltas[0]
    assert len(replayed) >= 16 and replayed == uninterrupted[: len(replayed)]
    assert [t for d in deltas for t in d] == uninterrupted
    assert finished.finish_reason == "length" and finished.usage.completion_tokens == MAX_TOKENS
    # The checkpoint brought the prompt's KV and the output's; only the prompt's counts as cached.
    assert finished.usage.cached_tokens == finished.usage.prompt_tokens


async def test_resume_errors_are_typed(tmp_path):
    async with Runtime.open(_config(tmp_path)) as rt:
        with pytest.raises(CheckpointNotFoundError):
            async for _ in rt.resume("nobody"):
                pass
        path_for(tmp_path, "broken").write_bytes(b"MLXRTCK1\x00\x00\x00\xffgarbage")
        with pytest.raises(CorruptCheckpointError):
            async for _ in rt.resume("broken"):
                pass
        with pytest.raises(InvalidRequestError) as info:
            async for _ in rt.generate(GenerateRequest(prompt_ids=[1, 2], checkpoint_every=4)):
                pass
        assert info.value.field == "request_id"
        # The runtime keeps serving.
        _, finished = await _tokens(rt.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=4)))
        assert finished.finish_reason in ("length", "stop")


@pytest.mark.slow
async def test_bfloat16_models_checkpoint_and_resume_exactly(tmp_path):
    from msgspec.structs import replace

    def config(directory):
        base = _config(directory)
        return replace(base, model=replace(base.model, dtype="bfloat16"))

    async with Runtime.open(config(tmp_path / "a")) as rt:
        assert rt.model_info.dtype == "bfloat16"
        deltas, _ = await _tokens(rt.generate(_request("r", SamplingParams())))
    uninterrupted = [t for d in deltas for t in d]
    directory = tmp_path / "b"
    async with Runtime.open(config(directory)) as rt:
        stream = rt.generate(_request("r", SamplingParams())).__aiter__()
        while not path_for(directory, "r").exists():
            await stream.__anext__()
    async with Runtime.open(config(directory)) as rt:
        deltas, finished = await _tokens(rt.resume("r"))
    assert [t for d in deltas for t in d] == uninterrupted and finished.finish_reason == "length"


SCHEMA = {
    "type": "object",
    "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 40}},
    "required": ["values"],
}


async def _interrupted(directory, request: GenerateRequest, min_tokens: int = 12) -> None:
    """Stream until a checkpoint exists past `min_tokens`, then shut down under the open stream."""
    async with Runtime.open(_config(directory)) as rt:
        stream = rt.generate(request).__aiter__()
        seen = 0
        while seen < min_tokens:
            event = await stream.__anext__()
            seen += len(event.token_ids) if isinstance(event, TokenDelta) else 0
        await _checkpointed(directory, request.request_id)


async def _checkpointed(directory, request_id: str) -> None:
    """The caller has stopped reading: its request pauses once its events fill the stream's
    buffer (long before its end, however slow the machine) and its checkpoint stays on disk."""
    with anyio.fail_after(60):
        while not path_for(directory, request_id).exists():
            await anyio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("jump_forward", [False, True])
async def test_a_resumed_request_keeps_its_grammar(tmp_path, jump_forward):
    """The seeds' rule: a resume replays the output through a fresh matcher, never runs unconstrained."""
    request = GenerateRequest(
        prompt_ids=[5, 6, 7, 8, 9],
        max_tokens=200,
        request_id="json",
        checkpoint_every=4,
        jump_forward=jump_forward,
        response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
    )
    async with Runtime.open(_config(tmp_path / "a")) as rt:
        deltas, uninterrupted_end = await _tokens(rt.generate(request))
    uninterrupted = [t for d in deltas for t in d]
    await _interrupted(tmp_path / "b", request)
    async with Runtime.open(_config(tmp_path / "b")) as rt:
        deltas, finished = await _tokens(rt.resume("json"))
        text = rt.tokenizer.decode([t for d in deltas for t in d])
    assert [t for d in deltas for t in d] == uninterrupted
    assert finished.finish_reason == uninterrupted_end.finish_reason
    if finished.finish_reason == "stop":
        assert len(json.loads(text)["values"]) >= 40
