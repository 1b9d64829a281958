"""Denoising requests (diffusion language models through mlx-vlm): answers equal mlx-vlm's own
`stream_diffusion_generate` alone, together and beside autoregressive requests on the same MLX
thread; cancellation frees a request between denoising steps; what the denoising rule does not
define is refused by name."""

from __future__ import annotations

import itertools
import json
import shutil

import anyio
import msgspec
import pytest

from protocols import DenoisingOptions, GenerateRequest, SamplingParams
from protocols.api import DenoiseProgress, Finished, TokenDelta
from protocols.errors import InvalidRequestError, ModelLoadError, RequestTooLargeError
from runtime import Runtime
from runtime.config import KvConfig, PoolModelConfig
from runtime.pool import ModelPool
from tests.support.config import builtin_dir, make_config
from tests.support.diffusion import BLOCK_MODEL, DIFFUSION_MODEL, DiffusionReference
from tests.support.events import collect, collect_all


@pytest.fixture(scope="module")
def reference() -> DiffusionReference:
    return DiffusionReference()


@pytest.fixture(scope="module")
def blocks() -> DiffusionReference:
    return DiffusionReference(BLOCK_MODEL)


def _prompt(reference: DiffusionReference, i: int) -> list[int]:
    return reference.prompt_ids([{"role": "user", "content": f"Tell me story number {i} about the sea and the wind."}])


def _request(prompt: list[int], max_tokens: int, seed: int, temperature: float = 0.0, **kw) -> GenerateRequest:
    return GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(temperature=temperature, seed=seed), **kw)


async def test_denoised_answers_equal_mlx_vlms_loop_alone_and_together(reference):
    # Greedy and seeded sampling; several canvases (16 positions each); the prompt prefilled in
    # 16-token chunks; an end token inside a canvas ends the answer there.
    prompts = [_prompt(reference, i) for i in range(4)]
    greedy = reference.generate(prompts[0], 40, seed=3)
    stop = greedy[21]  # (a token of the second canvas)
    steps = reference.last_steps
    expected = [
        greedy[: greedy.index(stop)],
        reference.generate(prompts[1], 33, seed=4, temperature=0.7),
        reference.generate(prompts[2], 36, seed=5),
        reference.generate(prompts[3], 12, seed=6, temperature=1.0, max_denoising_steps=5),
    ]
    requests = [
        _request(prompts[0], 40, 3, stop_token_ids=[stop]),
        _request(prompts[1], 33, 4, 0.7),
        _request(prompts[2], 36, 5),
        _request(prompts[3], 12, 6, 1.0, denoising=DenoisingOptions(max_steps=5)),
    ]
    async with Runtime.open(make_config(DIFFUSION_MODEL)) as rt:
        alone = await collect(rt.generate(requests[0]))
        together = await collect_all(rt.generate, requests)
        stats = await rt.stats()
    assert alone.tokens == expected[0] and alone.last.finish_reason == "stop"
    assert [o.tokens for o in together] == expected
    assert [o.last.finish_reason for o in together] == ["stop", "length", "length", "length"]
    assert together[1].last.usage.completion_tokens == 33
    # Steps per answer as mlx-vlm's loop counts them (40 tokens: 3 canvases).
    assert (await _alone_steps(prompts[0])) == steps
    assert stats.live_requests == 0 and stats.kv.live_tokens == 0


async def _alone_steps(prompt: list[int]) -> int | None:
    async with Runtime.open(make_config(DIFFUSION_MODEL)) as rt:
        return (await collect(rt.generate(_request(prompt, 40, 3)))).last.denoising_steps


async def test_denoising_and_decoding_requests_share_the_device(reference):
    ar = [GenerateRequest(prompt_ids=[(5 * i + j) % 900 + 7 for j in range(9 + i)], max_tokens=24, ignore_eos=True) for i in range(4)]
    async with Runtime.open(make_config()) as alone:
        decoded = [o.tokens for o in await collect_all(alone.generate, ar)]
    prompts = [_prompt(reference, i) for i in range(4)]
    denoised = [reference.generate(p, 32, seed=20 + i) for i, p in enumerate(prompts)]
    config = msgspec.structs.replace(make_config(), models=[PoolModelConfig(name="diffusion", path=DIFFUSION_MODEL)])
    requests = [*ar, *(_request(p, 32, 20 + i, model="diffusion") for i, p in enumerate(prompts))]
    async with ModelPool.open(config) as pool:
        outcomes = await collect_all(pool.generate, requests)
    assert [o.tokens for o in outcomes[:4]] == decoded
    assert [o.tokens for o in outcomes[4:]] == denoised


async def test_block_diffusion_answers_equal_llada2s_own_loop_alone_together_and_beside_decoding(blocks):
    # LLaDA2-MoE: blocks of 32 positions from position 0, so each prompt's tail shares its first
    # block with the answer (a 32-token prompt: none); greedy and seeded; steps and threshold
    # overrides (the random model's tokens have probabilities near 0.0045: at that threshold a
    # step unmasks several positions, at the default one each); a stop token cutting the answer
    # inside a block; 4 AR requests beside them in one pool.
    prompts = [blocks.prompt_ids([{"role": "user", "content": f"Story {i}:" + " about the sea" * (4 * i)}]) for i in range(3)]
    prompts.append(blocks.prompt_ids([{"role": "user", "content": "abc " * 20}])[:32])
    assert len({len(p) for p in prompts}) == 4 and max(map(len, prompts)) > 32 and len(prompts[3]) == 32
    greedy = blocks.generate_blocks(prompts[0], 70, seed=1, threshold=0.0045)
    stop = greedy[45]  # (in the second block)
    expected = [
        greedy[: greedy.index(stop)],
        blocks.generate_blocks(prompts[1], 33, seed=2, temperature=0.8, threshold=0.0045),
        blocks.generate_blocks(prompts[2], 40, seed=3, steps=6),
        blocks.generate_blocks(prompts[3], 20, seed=4, temperature=1.0),
    ]
    requests = [
        _request(prompts[0], 70, 1, stop_token_ids=[stop], denoising=DenoisingOptions(threshold=0.0045)),
        _request(prompts[1], 33, 2, 0.8, denoising=DenoisingOptions(threshold=0.0045)),
        _request(prompts[2], 40, 3, denoising=DenoisingOptions(max_steps=6)),
        _request(prompts[3], 20, 4, 1.0),
    ]
    ar = [GenerateRequest(prompt_ids=[(7 * i + j) % 900 + 7 for j in range(9 + i)], max_tokens=24, ignore_eos=True) for i in range(4)]
    async with Runtime.open(make_config()) as alone:
        decoded = [o.tokens for o in await collect_all(alone.generate, ar)]
    async with Runtime.open(make_config(BLOCK_MODEL)) as rt:
        assert rt.model_info.denoising and rt.model_info.denoises_blocks and rt.model_info.canvas_length == 32
        with pytest.raises(InvalidRequestError) as refused:
            await collect(rt.generate(_request(prompts[0], 8, 1, denoising=DenoisingOptions(min_canvas_length=8))))
        assert refused.value.field == "denoising.min_canvas_length"
        one = await collect(rt.generate(requests[2]))
        together = await collect_all(rt.generate, requests)
        stats = await rt.stats()
    assert one.tokens == expected[2] and one.last.denoising_steps is not None and one.last.denoising_steps > 0
    assert together[0].last.denoising_steps < 70 - 32  # (several positions unmasked per step)
    assert [o.tokens for o in together] == expected
    assert [o.last.finish_reason for o in together] == ["stop", "length", "length", "length"]
    assert stats.live_requests == 0 and stats.kv.live_tokens == 0
    config = msgspec.structs.replace(make_config(), models=[PoolModelConfig(name="blocks", path=BLOCK_MODEL)])
    async with ModelPool.open(config) as pool:
        outcomes = await collect_all(pool.generate, [*ar, *(msgspec.structs.replace(r, model="blocks") for r in requests)])
    assert [o.tokens for o in outcomes[:4]] == decoded
    assert [o.tokens for o in outcomes[4:]] == expected


@pytest.mark.parametrize("model", [DIFFUSION_MODEL, BLOCK_MODEL], ids=["canvas", "blocks"])
async def test_report_progress_streams_each_denoising_step(model):
    """With `report_progress`, a denoising request's events carry one `DenoiseProgress` per
    denoising step: steps counted up within a canvas (or block), revealed positions never
    fewer than the step before, all revealed at the step a canvas ends, whose tokens follow."""
    prompt = DiffusionReference(model).prompt_ids([{"role": "user", "content": "Tell me about the sea."}])
    request = _request(prompt, 40, 7, report_progress=True)
    async with Runtime.open(make_config(model)) as rt:
        outcome = await collect(rt.generate(request))
        quiet = await collect(rt.generate(msgspec.structs.replace(request, report_progress=False)))
    progress = [e for e in outcome.events if isinstance(e, DenoiseProgress)]
    assert len(progress) == outcome.last.denoising_steps and not any(isinstance(e, DenoiseProgress) for e in quiet.events)
    assert quiet.tokens == outcome.tokens
    canvases: dict[int, list[DenoiseProgress]] = {}
    for event in progress:
        canvases.setdefault(event.canvas, []).append(event)
    assert sorted(canvases) == list(range(1, len(canvases) + 1)) and len(canvases) >= 2
    for steps in canvases.values():
        assert [e.step for e in steps] == list(range(1, len(steps) + 1))
        assert all(a.revealed <= b.revealed for a, b in itertools.pairwise(steps))
        assert steps[-1].revealed == steps[-1].positions
    # Each canvas's last step comes before its tokens.
    kinds = [type(e).__name__ for e in outcome.events if isinstance(e, (DenoiseProgress, TokenDelta)) and not (isinstance(e, TokenDelta) and not e.token_ids)]
    assert kinds[0] == "DenoiseProgress" and kinds[-1] == "TokenDelta"


async def test_a_diffusion_family_not_served_is_refused_at_load_by_name(tmp_path):
    directory = tmp_path / "nemotron"
    shutil.copytree(builtin_dir(BLOCK_MODEL.removeprefix("builtin:")), directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "nemotron_labs_diffusion"}))
    with pytest.raises(ModelLoadError, match=r"nemotron_labs_diffusion.*diffusion_gemma, llada2_moe"):
        async with Runtime.open(make_config(str(directory))):
            pass


async def test_cancelling_a_denoising_request_frees_it_between_steps(reference):
    prompt = _prompt(reference, 9)
    async with Runtime.open(make_config(DIFFUSION_MODEL)) as rt:
        finished = None
        async for event in rt.generate(_request(prompt, 400, 1, request_id="victim")):
            if isinstance(event, TokenDelta):
                await rt.cancel("victim")  # after its first canvas: mid-denoise of the next
            elif isinstance(event, Finished):
                finished = event
        with anyio.fail_after(10):
            while (stats := await rt.stats()).live_requests or stats.kv.live_tokens:
                await anyio.sleep(0.01)
        after = await collect(rt.generate(_request(prompt, 20, 2)))
    assert finished is not None and finished.finish_reason == "cancelled"
    assert 0 < finished.usage.completion_tokens < 400
    assert after.tokens == reference.generate(prompt, 20, seed=2)


async def test_the_kv_budget_counts_a_denoising_requests_encoder_cache(reference):
    # The tiny model's cache: 256 bytes a token on its global layer and as much on its windowed one (its
    # 8-position ring, with the margin the ledger counts, holds every token of these requests).
    prompt = _prompt(reference, 3)
    config = msgspec.structs.replace(make_config(DIFFUSION_MODEL), kv=KvConfig(budget_bytes=30_000, prefix_cache_bytes=0))
    async with Runtime.open(config) as rt:
        assert rt.model_info.kv_bytes_per_token == 256
        with pytest.raises(RequestTooLargeError):
            await collect(rt.generate(_request(prompt, 200, 1)))
        fits = await collect(rt.generate(_request(prompt, 16, 1)))
    assert fits.tokens == reference.generate(prompt, 16, seed=1)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"sampling": SamplingParams(top_p=0.5)}, "sampling"),
        ({"sampling": SamplingParams(repetition_penalty=1.2)}, "sampling"),
        ({"checkpoint_every": 8, "request_id": "kept"}, "checkpoint_every"),
        ({"denoising": DenoisingOptions(max_steps=0)}, "denoising.max_steps"),
        ({"denoising": DenoisingOptions(threshold=1.5)}, "denoising.threshold"),
    ],
)
async def test_what_denoising_does_not_define_is_refused_by_name(diffusion_runtime, change, field):
    with pytest.raises(InvalidRequestError) as refused:
        await collect(diffusion_runtime.generate(msgspec.structs.replace(GenerateRequest(prompt="Hello", max_tokens=4), **change)))
    assert refused.value.field == field
    # The runtime goes on.
    assert (await collect(diffusion_runtime.generate(GenerateRequest(prompt="Hello", max_tokens=4)))).last.finish_reason in ("length", "stop")


async def test_an_autoregressive_model_refuses_denoising_options():
    async with Runtime.open(make_config()) as rt:
        with pytest.raises(InvalidRequestError) as refused:
            await collect(rt.generate(GenerateRequest(prompt="Hello", max_tokens=4, denoising=DenoisingOptions(max_steps=4))))
    assert refused.value.field == "denoising"


@pytest.fixture(scope="module")
async def diffusion_runtime():
    async with Runtime.open(make_config(DIFFUSION_MODEL)) as rt:
        yield rt
