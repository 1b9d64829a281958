"""Hardening, second round: the model pool and who owns a checkpoint file.

Each test is a finding of issue 26 that it reproduced before its fix: a pool request resumed
another request's checkpoint (2); stats polls loaded models (5); `min_resident_s = 0` livelocked
(6); a new request deleted another's checkpoint (9); a client leaving during a swap poisoned its
id (10); the memory cap trusted the start-up estimate of a model replaced since (13).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import anyio
import msgspec
import pytest

from engine.builtin import BUILTIN_MODELS, ensure_model, parameter_count
from engine.model.memory import estimate_weight_bytes
from protocols import GenerateRequest, TokenDelta
from runtime import Runtime, env
from runtime.checkpoints import path_for
from runtime.config import CheckpointConfig, ModelPoolConfig, PoolModelConfig
from runtime.errors import InvalidRequestError, ModelLoadError
from runtime.pool import ModelPool
from tests.support.config import builtin_dir, make_config
from tests.support.events import collect, collect_all

# Room for one of the two models (a copied directory is estimated from its files' sizes).
ONE_MODEL = max(4 * parameter_count(BUILTIN_MODELS["tiny-qwen2"]), estimate_weight_bytes(str(builtin_dir("tiny-qwen2")))) + 1


def _pool_config(tmp_path, *, qwen_path: str = "builtin:tiny-qwen2", cap: int = ONE_MODEL, min_resident_s: float = 0.05):
    return msgspec.structs.replace(
        make_config("builtin:tiny"),
        models=[PoolModelConfig(name="qwen", path=qwen_path)],
        model_pool=ModelPoolConfig(memory_bytes=cap, min_resident_s=min_resident_s),
        checkpoints=CheckpointConfig(dir=str(tmp_path / "checkpoints")),
    )


def _request(prompt_seed: int, *, max_tokens: int = 48, **fields) -> GenerateRequest:
    prompt = [(prompt_seed * 37 + 11 * j) % 900 + 5 for j in range(9 + prompt_seed % 5)]
    return GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens, ignore_eos=True, **fields)


async def _crashed_checkpoint(directory, model: str, request: GenerateRequest) -> bytes:
    """A request that 'crashed': streamed until its checkpoint is on disk, then its runtime shut
    down under it (a shutdown keeps checkpoints). Returns the file's bytes."""
    config = msgspec.structs.replace(make_config(model), checkpoints=CheckpointConfig(dir=str(directory)))
    async with Runtime.open(config) as rt:
        stream = rt.generate(request).__aiter__()
        with anyio.fail_after(60):
            while not path_for(directory, request.request_id).exists():
                await stream.__anext__()
    return path_for(directory, request.request_id).read_bytes()


async def test_a_new_request_never_overwrites_or_deletes_another_requests_checkpoint(tmp_path):
    """(9) An id naming a crashed request's checkpoint is refused for a different request that
    would checkpoint; the file stays; the crashed request itself may run again under its id."""
    directory = tmp_path / "checkpoints"
    crashed = _request(1, max_tokens=400, request_id="job-7", checkpoint_every=4)
    original = await _crashed_checkpoint(directory, "builtin:tiny", crashed)
    config = msgspec.structs.replace(make_config(), checkpoints=CheckpointConfig(dir=str(directory)))
    async with Runtime.open(config) as rt:
        with pytest.raises(InvalidRequestError) as refused:
            await collect(rt.generate(_request(2, request_id="job-7", checkpoint_every=4)))
        assert refused.value.field == "request_id" and "resume it" in str(refused.value)
        ran = await collect(rt.generate(_request(2, request_id="job-7")))  # no checkpointing: allowed
        assert ran.last.finish_reason == "length"
        assert path_for(directory, "job-7").read_bytes() == original
        again = await collect(rt.generate(crashed))  # the same request may start over (its own file)
        assert again.last.finish_reason == "length"


@pytest.mark.slow
async def test_a_pool_request_never_resumes_another_requests_checkpoint(tmp_path):
    """(2) A stale checkpoint of `job-42` on the model a new `job-42` runs on: the new request is
    swapped out and back and still gets its own tokens; the stale file is left alone."""
    directory = tmp_path / "checkpoints"
    stale = await _crashed_checkpoint(directory, "builtin:tiny-qwen2", _request(3, max_tokens=400, request_id="job-42", checkpoint_every=4))
    request = _request(4, max_tokens=60, request_id="job-42", model="qwen")
    async with Runtime.open(make_config("builtin:tiny-qwen2")) as alone:
        expected = (await collect(alone.generate(msgspec.structs.replace(request, model=None)))).tokens
    async with ModelPool.open(_pool_config(tmp_path, min_resident_s=0.0)) as pool:
        tokens: list[int] = []
        async with pool.submit(request) as stream:
            async for event in stream:
                if isinstance(event, TokenDelta):
                    tokens += event.token_ids
                    if len(tokens) == len(event.token_ids):  # after its first tokens: swap it out
                        other = await collect(pool.generate(_request(5, max_tokens=8)))
                        assert other.last.finish_reason == "length"
        assert {m.name: m.preempted for m in pool.models()}["qwen"] >= 1
    assert tokens == expected
    assert path_for(directory, "job-42").read_bytes() == stale


async def test_stats_never_load_a_model(tmp_path):
    """(5) With no model resident (a load failed after the others were swapped out), stats and
    metrics answer from the last figures and load nothing."""
    broken = tmp_path / "broken"
    shutil.copytree(builtin_dir("tiny-qwen2"), broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_architecture"}))
    async with ModelPool.open(_pool_config(tmp_path, qwen_path=str(broken), min_resident_s=0.0)) as pool:
        with pytest.raises(ModelLoadError):
            await collect(pool.generate(_request(6, model="qwen")))
        loads = {m.name: m.loads for m in pool.models()}
        assert {m.state for m in pool.models()} == {"unloaded"}
        for _ in range(20):
            stats = await pool.stats()
            assert stats.kv.live_tokens == 0 and stats.metrics.generation_tokens >= 0
        assert {m.name: m.loads for m in pool.models()} == loads
        assert {m.state for m in pool.models()} == {"unloaded"}
        served = await collect(pool.generate(_request(7, max_tokens=4)))  # a request still loads its model
        assert served.last.finish_reason == "length"


@pytest.mark.slow
async def test_a_zero_residence_pool_does_not_livelock(tmp_path):
    """(6) `min_resident_s = 0` under a one-model cap: three requests over two models all end
    (a model swapped in stays until its requests made progress)."""
    requests = [_request(8, max_tokens=24), _request(9, max_tokens=24, model="qwen"), _request(10, max_tokens=24)]
    async with ModelPool.open(_pool_config(tmp_path, min_resident_s=0.0)) as pool:
        with anyio.fail_after(180):
            outcomes = await collect_all(pool.generate, requests)
        loads = sum(m.loads for m in pool.models())
    assert [o.last.finish_reason for o in outcomes] == ["length"] * 3
    # Every swap bought progress: a model is swapped out only after its requests got tokens since
    # it came in, so the loads are bounded by the deliveries (plus each model's first load), not
    # by timing (a zero residence may swap after every delivery on a busy machine).
    deliveries = sum(1 for o in outcomes for e in o.events if isinstance(e, TokenDelta) and e.token_ids)
    assert loads <= deliveries + 2, f"{loads} model loads for {deliveries} deliveries"


async def test_a_client_leaving_during_a_swap_does_not_poison_its_id(tmp_path):
    """(10) A request that waits for its model and is left by its caller: its id serves the next
    request normally."""
    async with ModelPool.open(_pool_config(tmp_path, min_resident_s=60.0)) as pool:
        await collect(pool.generate(_request(11, max_tokens=4)))  # the default model: resident, fresh
        with anyio.move_on_after(0.5):  # `qwen` cannot come in for a minute: the caller leaves
            await collect(pool.generate(_request(12, model="qwen", request_id="leaver")))
        again = await collect(pool.generate(_request(13, max_tokens=6, request_id="leaver")))
    assert again.last.finish_reason == "length" and len(again.tokens) == 6


async def test_the_cap_holds_for_a_model_replaced_after_start(tmp_path):
    """(13) A `[[models]]` directory replaced after the pool started by a bigger model is refused,
    not loaded under the cap."""
    replaced = tmp_path / "qwen"
    shutil.copytree(builtin_dir("tiny-qwen2"), replaced)
    bigger = ensure_model(dataclasses.replace(BUILTIN_MODELS["tiny-qwen2"], name="tiny-qwen2-wide", hidden_size=256, intermediate_size=640), root=env.home())
    async with ModelPool.open(_pool_config(tmp_path, qwen_path=str(replaced))) as pool:
        shutil.rmtree(replaced)
        shutil.copytree(bigger, replaced)
        with pytest.raises(ModelLoadError, match="memory_bytes"):
            await collect(pool.generate(_request(14, model="qwen")))
        assert pool.peak_weight_bytes <= ONE_MODEL
        assert (await collect(pool.generate(_request(15, max_tokens=4)))).last.finish_reason == "length"


async def test_an_unsafe_request_id_is_refused_at_submit_by_runtime_and_pool(tmp_path):
    """(4, 11) One rule for request ids on every front: no CR/LF, nothing outside ASCII."""
    bad = ("a\r\nSet-Cookie: x=1", "snow\u2603", "x" * 201, "../up")
    async with Runtime.open(make_config()) as rt:
        for rid in bad:
            with pytest.raises(InvalidRequestError) as refused:
                rt.submit(GenerateRequest(prompt_ids=[1, 2], max_tokens=2, request_id=rid))
            assert refused.value.field == "request_id"
    async with ModelPool.open(_pool_config(tmp_path, cap=0)) as pool:
        for rid in bad:
            with pytest.raises(InvalidRequestError):
                pool.submit(GenerateRequest(prompt_ids=[1, 2], max_tokens=2, request_id=rid))
