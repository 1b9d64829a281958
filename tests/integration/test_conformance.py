"""Every model family we claim generates greedily what mlx-lm generates.

For each tiny random model of `tests.support.families` (built with mlx-lm's own classes:
full attention, sliding windows, MLA, MoE, gated-delta, convolution and SSM hybrids,
quantized weights), the runtime's greedy tokens equal `mlx_lm.generate.generate_step`'s:
alone, in a batch of 8 with prompts of 10 to 600 tokens (past the 32-token windows), from a
prefix-cache hit, and after a checkpoint and a resume in a fresh runtime. A difference is
excused only at a near-tie: where mlx-lm's own top two logits are within 1e-3.
"""

from __future__ import annotations

import random

import anyio
import mlx.core as mx
import msgspec
import pytest
from mlx_lm.utils import load

from protocols import Finished, GenerateRequest, TokenDelta
from runtime import Runtime, env
from runtime.checkpoints import path_for
from runtime.config import CheckpointConfig, RuntimeConfig
from tests.support.config import make_config
from tests.support.families import FAMILIES, build
from tests.support.mlx_reference import greedy_steps

pytestmark = pytest.mark.slow

NEAR_TIE = 1e-3
NEW_TOKENS = 12
BATCH_PROMPTS = [10, 25, 60, 120, 250, 400, 600, 33]
RESUME_TOKENS = 160


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(length)]


def _reference(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy tokens and, at each, the gap between its top two logits."""
    tokens, margins = [], []
    for token, logprobs in greedy_steps(model, prompt, n):
        top = mx.sort(logprobs)[-2:].tolist()
        tokens.append(token)
        margins.append(top[1] - top[0])
    return tokens, margins


def _assert_matches(ours: list[int], reference: tuple[list[int], list[float]], what: str) -> None:
    expected, margins = reference
    for j, (a, b) in enumerate(zip(ours, expected)):
        if a != b:
            assert margins[j] < NEAR_TIE, f"{what}: token {j} is {a}, mlx-lm's {b} (its top-2 margin {margins[j]:.2e})"
            return
    assert len(ours) == len(expected), f"{what}: {len(ours)} tokens, mlx-lm {len(expected)}"


async def _generate(rt: Runtime, request: GenerateRequest) -> tuple[list[int], Finished]:
    tokens, finished = [], None
    async for event in rt.generate(request):
        if isinstance(event, TokenDelta):
            tokens += event.token_ids
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None and finished.finish_reason == "length", finished
    return tokens, finished


def _config(directory, checkpoints=None) -> RuntimeConfig:
    config = make_config(str(directory))
    return msgspec.structs.replace(config, checkpoints=CheckpointConfig(dir=str(checkpoints))) if checkpoints else config


@pytest.fixture(scope="module")
def built():
    return {}


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_family_generates_what_mlx_lm_generates(family, tmp_path, built):
    directory = build(family, env.home())
    model, _ = load(str(directory))
    model.set_dtype(mx.float32)
    prompts = [_prompt(n, seed=i) for i, n in enumerate(BATCH_PROMPTS)]
    references = [_reference(model, p, NEW_TOKENS) for p in prompts]

    def request(i: int, **fields) -> GenerateRequest:
        return GenerateRequest(prompt_ids=prompts[i], max_tokens=NEW_TOKENS, ignore_eos=True, **fields)

    async with Runtime.open(_config(directory)) as rt:
        alone, _ = await _generate(rt, request(2))
        _assert_matches(alone, references[2], f"{family} alone")

        results: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            results[i] = (await _generate(rt, request(i)))[0]

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        for i, n in enumerate(BATCH_PROMPTS):
            _assert_matches(results[i], references[i], f"{family} in a batch of 8, prompt of {n}")

        # The 400-token prompt again: its KV (or state) comes from the prefix cache.
        hit, finished = await _generate(rt, request(5))
        assert finished.usage.cached_tokens > 0, f"{family}: no prefix-cache hit"
        _assert_matches(hit, references[5], f"{family} from a prefix-cache hit")

    # A checkpoint, a shutdown under the open stream, and a resume in a fresh runtime.
    resume_prompt = prompts[3]
    reference = _reference(model, resume_prompt, RESUME_TOKENS)
    interrupted = GenerateRequest(prompt_ids=resume_prompt, max_tokens=RESUME_TOKENS, ignore_eos=True, request_id=f"ck-{family}", checkpoint_every=4)
    checkpoint_dir = tmp_path / "checkpoints"
    async with Runtime.open(_config(directory, checkpoint_dir)) as rt:
        stream = rt.generate(interrupted).__aiter__()
        seen = 0
        while seen < 8:
            event = await stream.__anext__()
            seen += len(event.token_ids) if isinstance(event, TokenDelta) else 0
        # The caller stops reading: the request pauses once its events fill the stream's buffer
        # (long before its end, however slow the machine), keeping its checkpoints on disk.
        with anyio.fail_after(60):
            while not path_for(checkpoint_dir, interrupted.request_id).exists():
                await anyio.sleep(0.02)
    async with Runtime.open(_config(directory, checkpoint_dir)) as rt:
        tokens = []
        async for event in rt.resume(interrupted.request_id):
            if isinstance(event, TokenDelta):
                tokens += event.token_ids
    _assert_matches(tokens, reference, f"{family} after a checkpoint and a resume")


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "cohere2", "qwen3_next"])
async def test_first_chunks_longer_than_the_windows_prefill_together_exactly(family):
    """Chunks of 80 tokens, past the 32-token windows: several prompts' first chunks share one
    forward (right-padded for windows, by equal length for recurrent layers)."""
    directory = build(family, env.home())
    model, _ = load(str(directory))
    model.set_dtype(mx.float32)
    lengths = [10, 50, 81, 81, 120, 200, 81, 300]
    prompts = [_prompt(n, seed=100 + i) for i, n in enumerate(lengths)]
    config = make_config(str(directory), prefill_chunk_size=80)
    results: dict[int, list[int]] = {}
    async with Runtime.open(config) as rt:

        async def one(i: int) -> None:
            request = GenerateRequest(prompt_ids=prompts[i], max_tokens=NEW_TOKENS, ignore_eos=True)
            results[i] = (await _generate(rt, request))[0]

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    for i, n in enumerate(lengths):
        _assert_matches(results[i], _reference(model, prompts[i], NEW_TOKENS), f"{family}, prompt of {n} in chunks of 80")
