"""Several models in one process: requests name a model, weights stay under the cap, and a
swapped-out model's requests resume exactly where their callers are."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from engine.builtin import BUILTIN_MODELS, parameter_count
from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta
from runtime import Runtime
from runtime.config import CheckpointConfig, ModelPoolConfig, PoolModelConfig
from runtime.errors import ConfigError, InvalidRequestError, ModelLoadError, ModelNotFoundError
from runtime.pool import ModelPool
from tests.support.config import make_config

MODELS = {None: "builtin:tiny", "qwen": "builtin:tiny-qwen2"}
# Long enough that every request is running when its model is swapped out (a swap waits 0.05 s
# of residence), short enough that requests preempted without checkpoints, which start over,
# end in seconds.
MAX_TOKENS = 48


def _config(tmp_path, *, cap: int, pinned: bool = False, min_resident_s: float = 0.05, checkpoint_every: int = 16):
    config = make_config(MODELS[None])
    return msgspec.structs.replace(
        config,
        models=[PoolModelConfig(name="qwen", path=MODELS["qwen"], pinned=pinned)],
        model_pool=ModelPoolConfig(memory_bytes=cap, min_resident_s=min_resident_s, checkpoint_every=checkpoint_every),
        checkpoints=CheckpointConfig(dir=str(tmp_path / "checkpoints")),
    )


def _sizes() -> dict:
    return {name: 4 * parameter_count(BUILTIN_MODELS[path.removeprefix("builtin:")]) for name, path in MODELS.items()}


def _requests() -> list[GenerateRequest]:
    requests = []
    for i in range(8):
        sampling = SamplingParams() if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i)
        prompt = [(13 * i + 7 * j) % 900 + 5 for j in range(9 + i)]
        requests.append(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, sampling=sampling, model=(None, "qwen")[i % 2 == 1]))
    return requests


async def _collect(events) -> tuple[list[int], str, Finished | None]:
    tokens, text, finished = [], "", None
    async for event in events:
        if isinstance(event, TokenDelta):
            tokens += event.token_ids
            text += event.text
        elif isinstance(event, Finished):
            finished = event
    return tokens, text, finished


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_every", [16, 0])
async def test_two_models_over_the_cap_alternate_and_preempted_streams_are_exact(tmp_path, checkpoint_every):
    sizes = _sizes()
    cap = max(sizes.values()) + min(sizes.values()) // 2  # one model at a time
    requests = _requests()
    expected = {}
    for name, path in MODELS.items():
        async with Runtime.open(make_config(path)) as rt:
            for i, request in enumerate(requests):
                if request.model == name:
                    expected[i] = await _collect(rt.generate(msgspec.structs.replace(request, model=None)))
    got: dict = {}
    # A short stay makes swaps frequent at any machine speed; without checkpoints a preempted
    # request starts over, and still progresses (its model is not swapped out while it catches up).
    async with ModelPool.open(_config(tmp_path, cap=cap, checkpoint_every=checkpoint_every, min_resident_s=0.05)) as pool:

        async def one(i: int) -> None:
            got[i] = await _collect(pool.generate(requests[i]))

        # A guard against a livelock, not a bound on speed: beside a CPU hog and other suites the
        # swaps (model loads) of this test have taken over 120 s.
        with anyio.fail_after(900):
            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
        states = {m.name: m for m in pool.models()}
        peak = pool.peak_weight_bytes
    for i in range(len(requests)):
        assert got[i][0] == expected[i][0], f"request {i} ({requests[i].model or 'default'}) differs from its uninterrupted stream"
        assert got[i][1] == expected[i][1]
        assert got[i][2] is not None and got[i][2].finish_reason == "length"
    assert sum(m.preempted for m in states.values()) > 0, "the models were swapped with requests running"
    assert all(m.loads >= 1 for m in states.values())
    assert peak <= cap, "the weights resident at once stay under model_pool.memory_bytes"


async def test_unknown_models_and_impossible_pins_are_refused(tmp_path):
    sizes = _sizes()
    with pytest.raises(ConfigError, match="pinned"):
        async with ModelPool.open(_config(tmp_path, cap=max(sizes.values()) + 1, pinned=True)):
            pass
    async with ModelPool.open(_config(tmp_path, cap=0)) as pool:
        with pytest.raises(ModelNotFoundError) as refused:
            async for _ in pool.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=2, model="nope")):
                pass
        assert refused.value.field == "model"
        tokens, _, finished = await _collect(pool.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=4, model="qwen")))
        assert finished is not None and finished.finish_reason == "length" and len(tokens) == 4
        assert {m.name: m.state for m in pool.models()} == {"builtin:tiny": "resident", "qwen": "resident"}
    async with Runtime.open(make_config()) as rt:
        with pytest.raises(ModelNotFoundError):
            async for _ in rt.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=2, model="qwen")):
                pass


async def test_a_request_waiting_for_its_model_can_be_cancelled(tmp_path):
    sizes = _sizes()
    cap = max(sizes.values()) + min(sizes.values()) // 2
    async with ModelPool.open(_config(tmp_path, cap=cap, min_resident_s=30.0)) as pool:
        # The default model was just loaded: another model's request waits (30 s at least).
        waiting = GenerateRequest(prompt_ids=[4, 5, 6], max_tokens=4, model="qwen", request_id="w-1")
        ended: list[Finished | None] = []

        stream = pool.submit(waiting)  # its id is claimed at once

        async def wait_for_qwen() -> None:
            async with stream:
                ended.append((await _collect(stream))[2])

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_for_qwen)
                await pool.cancel("w-1")
        assert ended and ended[0] is not None and ended[0].finish_reason == "cancelled"
        assert {m.name: m.state for m in pool.models()}["qwen"] == "unloaded"


@pytest.mark.server
async def test_several_models_over_the_socket(tmp_path):
    from net.client import Client
    from tests.support.events import collect
    from tests.support.serve import running_server

    sizes = _sizes()
    cap = max(sizes.values()) + min(sizes.values()) // 2
    request = GenerateRequest(prompt_ids=[7, 8, 9, 10], max_tokens=24, ignore_eos=True)
    expected = {}
    for name, path in MODELS.items():
        async with Runtime.open(make_config(path)) as rt:
            expected[name] = (await _collect(rt.generate(request)))[0]
    pool = {"memory_bytes": cap, "min_resident_s": 0.05}
    with running_server(tmp_path, models=[{"name": "qwen", "path": MODELS["qwen"]}], model_pool=pool) as server:
        async with Client.connect(server.socket) as client:
            for i, name in enumerate([None, "qwen", None]):
                outcome = await collect(client.generate(msgspec.structs.replace(request, model=name, request_id=f"s-{i}")))
                assert outcome.tokens == expected[name]
            with pytest.raises(ModelNotFoundError):
                await collect(client.generate(msgspec.structs.replace(request, model="nope", request_id="s-x")))
            stats = await client.stats()
    states = {m.name: m for m in stats.models}
    assert set(states) == {"builtin:tiny", "qwen"}
    assert states["qwen"].loads == 1 and states["builtin:tiny"].loads == 2, "one model resident at a time under the cap"


@pytest.mark.server
async def test_an_openai_client_picks_a_model_by_name(tmp_path):
    import openai

    from tests.support.http_serving import serving

    prompt = [7, 8, 9, 10, 11]
    expected = {}
    for name, path in MODELS.items():
        async with Runtime.open(make_config(path)) as rt:
            expected[name] = (await _collect(rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=12, ignore_eos=True))))[0]
    async with serving(_config(tmp_path, cap=0), pool=True) as served:
        client = served.client()
        assert {m.id for m in (await client.models.list()).data} == {"builtin:tiny", "qwen"}
        for name in (None, "qwen"):
            completion = await client.completions.create(
                model=name or served.model,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                logprobs=1,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            choice = completion.choices[0]
            assert (choice.model_extra or {}).get("token_ids") == expected[name] and completion.model == (name or served.model)
            assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 12
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt=prompt, max_tokens=2)
        await client.close()


async def test_a_model_that_cannot_load_fails_its_requests_alone(tmp_path):
    config = msgspec.structs.replace(_config(tmp_path, cap=0), models=[PoolModelConfig(name="broken", path=str(tmp_path / "no-model"))])
    async with ModelPool.open(config) as pool:
        with pytest.raises(ModelLoadError):
            async for _ in pool.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=2, model="broken")):
                pass
        tokens, _, finished = await _collect(pool.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=3, request_id="ok-1")))
        assert finished is not None and finished.finish_reason == "length" and len(tokens) == 3
        # Ids are checked as on every front: safe in a header, a log line and a file name.
        with pytest.raises(InvalidRequestError) as refused:
            pool.submit(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=3, request_id="a/b c"))
        assert refused.value.field == "request_id"
        assert {m.name: m.state for m in pool.models()}["broken"] == "unloaded"


@pytest.mark.server
async def test_a_model_that_cannot_load_is_a_503_naming_why_over_http(tmp_path):
    """(Issue 46's soak) A pool whose shared `[kv]` asks for paged KV, which a vision model cannot
    serve: its requests answered 500 "internal"; now a typed 503 naming the model and why, while
    the default model keeps serving."""
    import openai

    from tests.support.http_serving import serving
    from tests.support.vision import VISION_MODEL

    config = msgspec.structs.replace(
        _config(tmp_path, cap=0),
        models=[PoolModelConfig(name="vision", path=VISION_MODEL)],
        kv=msgspec.structs.replace(make_config("builtin:tiny").kv, block_size=16),
    )
    async with serving(config, pool=True) as served:
        client = served.client()
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.APIStatusError) as refused:
            await client.with_options(max_retries=0).chat.completions.create(model="vision", messages=messages, max_tokens=2)
        assert refused.value.status_code == 503 and "'vision' could not be loaded" in refused.value.message and "kv.block_size" in refused.value.message
        answer = await client.completions.create(model=served.model, prompt=[1, 2, 3], max_tokens=3, extra_body={"ignore_eos": True})
        assert answer.choices[0].finish_reason == "length"
        await client.close()


async def test_a_models_own_options_apply_to_it_alone(tmp_path):
    from runtime.config import RuntimeConfig
    from runtime.errors import InvalidRequestError

    text = f"""
[model]
path = "builtin:tiny"
[[models]]
name = "short"
path = "builtin:tiny-qwen2"
max_context = 40
[checkpoints]
dir = "{tmp_path / "checkpoints"}"
"""
    config = RuntimeConfig.from_toml(text)
    assert config.models[0].model_config(config.model).max_context == 40 and config.model.max_context is None
    request = GenerateRequest(prompt_ids=list(range(5, 35)), max_tokens=20, ignore_eos=True)
    async with ModelPool.open(config) as pool:
        tokens, _, _ = await _collect(pool.generate(request))
        assert len(tokens) == 20, "the default model's context is its own"
        tokens, _, finished = await _collect(pool.generate(msgspec.structs.replace(request, model="short")))
        assert len(tokens) == 10 and finished is not None and finished.finish_reason == "length", "fitted to the 40 this model was given"
        with pytest.raises(InvalidRequestError):  # a prompt that fills its context
            await _collect(pool.generate(GenerateRequest(prompt_ids=list(range(5, 50)), max_tokens=2, model="short")))
