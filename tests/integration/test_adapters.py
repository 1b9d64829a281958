"""LoRA adapters in one batch: rows with different adapters (and none) decode together, each
exactly as `mlx_lm.load(model, adapter_path=...)` decodes it alone; slots, prefix cache and
checkpoints keep adapters apart."""

from __future__ import annotations

import json
import shutil

import anyio
import msgspec
import pytest

from protocols import Finished, GenerateRequest, TokenDelta
from runtime import Runtime
from runtime.config import AdapterConfig, KvConfig, LoraConfig
from runtime.errors import AdapterLoadError, AdapterNotFoundError, ForeignCheckpointError, InvalidRequestError
from tests.support.config import builtin_dir, make_config
from tests.support.mlx_reference import greedy_tokens, load_reference
from tests.support.spies import record_opens
from tests.support.waiting import wait_until_async
from tools.lora_adapters import make_lora_adapter

MAX_TOKENS = 16
# (rank, num_layers, keys): different ranks, depths and layer sets.
SHAPES = {"A": (4, 2, None), "B": (8, 4, None), "C": (16, 1, ["self_attn.q_proj", "mlp.down_proj"])}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    model_dir = builtin_dir("tiny")
    return {
        name: make_lora_adapter(model_dir, root / name, rank=rank, num_layers=layers, keys=keys, seed=i + 1)
        for i, (name, (rank, layers, keys)) in enumerate(SHAPES.items())
    }


def _reference(adapter_dir, prompt: list[int]) -> list[int]:
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tokenizer = load(str(builtin_dir("tiny")), adapter_path=str(adapter_dir) if adapter_dir else None)
    model.set_dtype(mx.float32)
    return greedy_tokens(model, tokenizer, prompt, MAX_TOKENS)


def _prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 900 + 3 for j in range(5 + 7 * i)]


def _config(adapters: dict, names=("A", "B", "C"), **lora):
    config = make_config()
    return msgspec.structs.replace(
        config, adapters=[AdapterConfig(name=n, path=str(adapters[n])) for n in names], lora=LoraConfig(**lora) if lora else config.lora
    )


async def _run(rt: Runtime, requests: list[GenerateRequest]) -> list[list[int]]:
    results: list = [None] * len(requests)

    async def one(i: int) -> None:
        tokens = []
        async for event in rt.generate(requests[i]):
            if isinstance(event, TokenDelta):
                tokens += event.token_ids
            elif isinstance(event, Finished):
                assert event.error is None, event.error
        results[i] = tokens

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return results


async def test_rows_with_different_adapters_share_a_batch_exactly(adapters):
    names = ["A", "B", None, "C", "A", "B", None, "C"]
    prompts = [_prompt(i) for i in range(len(names))]
    expected = [_reference(adapters.get(n) if n else None, p) for n, p in zip(names, prompts)]
    base = [_reference(None, p) for p in prompts]
    # Each adapter changes what the model says (otherwise this would prove nothing).
    assert all(e != b for n, e, b in zip(names, expected, base) if n is not None)
    async with Runtime.open(_config(adapters)) as rt:
        got = await _run(rt, [GenerateRequest(prompt_ids=p, max_tokens=MAX_TOKENS, adapter=n) for n, p in zip(names, prompts)])
        alone = await _run(rt, [GenerateRequest(prompt_ids=prompts[0], max_tokens=MAX_TOKENS, adapter="A")])
        stats = await rt.stats()
    assert got == expected
    assert alone == [expected[0]], "a lone row with an adapter (no compiled step) too"
    assert stats.kv.adapter_bytes > 0 and {a.name for a in stats.adapters} == {"A", "B", "C"}


async def test_adapters_load_and_unload_at_run_time(adapters, tmp_path):
    prompt = _prompt(2)
    async with Runtime.open(_config(adapters, names=())) as rt:
        with pytest.raises(AdapterNotFoundError) as missing:
            async for _ in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=4, adapter="B")):
                pass
        assert missing.value.field == "adapter"
        info = await rt.load_adapter("B", adapters["B"])
        assert (info.name, info.rank, info.resident, info.modules) == ("B", 8, True, 2 * 7)  # every linear layer of both blocks
        assert await _run(rt, [GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, adapter="B")]) == [_reference(adapters["B"], prompt)]
        with pytest.raises(InvalidRequestError):
            await rt.load_adapter("B", adapters["A"])  # the name is taken by another directory

        # Unloading is refused while a request holds the adapter, then done.
        async with rt.submit(GenerateRequest(prompt_ids=prompt, max_tokens=64, adapter="B", ignore_eos=True)) as stream:
            async for event in stream:
                if isinstance(event, TokenDelta):
                    with pytest.raises(InvalidRequestError, match="in use"):
                        await rt.unload_adapter("B")
                    break
        with anyio.fail_after(30):
            while (await rt.adapters())[0].users:
                await anyio.sleep(0.01)
        await rt.unload_adapter("B")
        assert await rt.adapters() == []
        with pytest.raises(AdapterNotFoundError):
            await rt.unload_adapter("B")

        # Adapters this runtime cannot apply exactly are refused with the reason.
        dora = tmp_path / "dora"
        shutil.copytree(adapters["A"], dora)
        config = json.loads((dora / "adapter_config.json").read_text())
        (dora / "adapter_config.json").write_text(json.dumps(config | {"fine_tune_type": "dora"}))
        with pytest.raises(AdapterLoadError, match="dora"):
            await rt.load_adapter("D", dora)
        with pytest.raises(AdapterLoadError, match="needs"):
            await rt.load_adapter("E", tmp_path / "nothing")
        for broken, expected in (("[]", "JSON object"), (json.dumps(config | {"lora_parameters": {"rank": "x", "scale": 1}}), "numeric")):
            (dora / "adapter_config.json").write_text(broken)
            with pytest.raises(AdapterLoadError, match=expected):
                await rt.load_adapter("G", dora)
        import mlx.core as mx

        nan = tmp_path / "nan"
        shutil.copytree(adapters["A"], nan)
        weights = mx.load(str(nan / "adapters.safetensors"))
        key = next(k for k in weights if k.endswith("lora_b"))
        mx.save_safetensors(str(nan / "adapters.safetensors"), weights | {key: weights[key] * float("nan")})
        with pytest.raises(AdapterLoadError, match="not finite"):
            await rt.load_adapter("H", nan)
        other_model = make_lora_adapter(builtin_dir("tiny-qwen2"), tmp_path / "qwen2", rank=4, num_layers=1)
        with pytest.raises(AdapterLoadError):
            await rt.load_adapter("F", other_model)
        assert await rt.adapters() == []
        # The runtime goes on serving.
        assert await _run(rt, [GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS)]) == [_reference(None, prompt)]


async def test_slots_are_reused_least_recently_used_first_and_pins_stay(adapters):
    # Two slots for three adapters: requests queue for a slot and every stream stays exact.
    prompts = {n: _prompt(i + 1) for i, n in enumerate("ABC")}
    expected = {n: _reference(adapters[n], prompts[n]) for n in "ABC"}
    config = _config(adapters, names=("A",), max_resident=2)
    config = msgspec.structs.replace(config, adapters=[AdapterConfig(name="A", path=str(adapters["A"]), pinned=True)])
    async with Runtime.open(config) as rt:
        await rt.load_adapter("B", adapters["B"])
        await rt.load_adapter("C", adapters["C"])  # B is evicted: A is pinned
        resident = {a.name: a.resident for a in await rt.adapters()}
        assert resident == {"A": True, "B": False, "C": True}
        names = ["B", "C", "A", "B", "C", "A"]
        got = await _run(rt, [GenerateRequest(prompt_ids=prompts[n], max_tokens=MAX_TOKENS, adapter=n) for n in names])
        assert got == [expected[n] for n in names]
        assert {a.name: a.pinned for a in await rt.adapters()}["A"]


async def test_prefix_cache_keeps_adapters_apart(adapters):
    prompt = _prompt(4)
    config = msgspec.structs.replace(_config(adapters), kv=KvConfig(prefix_cache_bytes=1 << 26))
    async with Runtime.open(config) as rt:
        first = await _run(rt, [GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, adapter="A")])
        base = await _run(rt, [GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS)])
        hits_before = (await rt.stats()).kv.prefix_hits
        again = await _run(rt, [GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, adapter="A")])
        hits_after = (await rt.stats()).kv.prefix_hits
    assert base == [_reference(None, prompt)], "the base model never starts from an adapter's KV"
    assert first == again == [_reference(adapters["A"], prompt)]
    assert hits_after == hits_before + 1, "a request of the same adapter reuses its KV"


@pytest.mark.slow
async def test_checkpoint_resume_needs_the_same_adapter(adapters, tmp_path):
    from runtime.checkpoints import path_for
    from runtime.config import CheckpointConfig

    directory = tmp_path / "ck"
    config = msgspec.structs.replace(_config(adapters), checkpoints=CheckpointConfig(dir=str(directory)))
    request = GenerateRequest(prompt_ids=_prompt(3), max_tokens=300, ignore_eos=True, adapter="C", request_id="ad-1", checkpoint_every=8)
    async with Runtime.open(config) as rt:
        [uninterrupted] = await _run(rt, [msgspec.structs.replace(request, request_id=None, checkpoint_every=None)])
        # Stream until a checkpoint exists, then shut the runtime down under the open stream.
        stream = rt.generate(request).__aiter__()
        while not isinstance(await stream.__anext__(), TokenDelta):
            pass
        with anyio.fail_after(60):
            while not path_for(directory, "ad-1").exists():
                await anyio.sleep(0.02)
    # The same name with other weights: the checkpoint's KV is not theirs.
    swapped = msgspec.structs.replace(config, adapters=[AdapterConfig(name="C", path=str(adapters["B"]))])
    async with Runtime.open(swapped) as rt:
        with pytest.raises(ForeignCheckpointError, match="adapter 'C'"):
            async for _ in rt.resume("ad-1"):
                pass
    async with Runtime.open(config) as rt:
        resumed = []
        async for event in rt.resume("ad-1"):
            if isinstance(event, TokenDelta):
                resumed += event.token_ids
    assert resumed == uninterrupted


@pytest.mark.server
async def test_adapters_over_the_socket(adapters, tmp_path):
    from net.client import Client
    from tests.support.events import collect
    from tests.support.serve import running_server

    prompt = _prompt(5)
    with running_server(tmp_path, adapters=[{"name": "A", "path": str(adapters["A"])}]) as server:
        async with Client.connect(server.socket) as client:
            assert [a.name for a in await client.adapters()] == ["A"]
            info = await client.load_adapter("B", adapters["B"], pinned=True)
            assert (info.name, info.pinned, info.resident) == ("B", True, True)
            outcome = await collect(client.generate(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS, adapter="B", request_id="sock-b")))
            assert outcome.tokens == _reference(adapters["B"], prompt)
            with pytest.raises(AdapterNotFoundError):
                await client.unload_adapter("Z")
            with pytest.raises(AdapterLoadError):
                await client.load_adapter("Z", tmp_path / "missing")
            with pytest.raises(AdapterNotFoundError):
                await collect(client.generate(GenerateRequest(prompt_ids=prompt, max_tokens=2, adapter="Z", request_id="sock-z")))
            await client.unload_adapter("A")
            assert [a.name for a in await client.adapters()] == ["B"]


@pytest.mark.server
async def test_an_openai_client_selects_an_adapter_by_model_name(adapters):
    from tests.support.http_serving import serving

    prompt = _prompt(6)
    async with serving(_config(adapters, names=("A",))) as served:
        client = served.client()
        listed = await client.models.list()
        cards = {m.id: (m.model_extra or {}).get("parent") for m in listed.data}
        assert cards == {served.model: None, "A": served.model}
        answers = {}
        for model in (served.model, "A"):
            completion = await client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True}
            )
            answers[model] = ((completion.choices[0].model_extra or {}).get("token_ids"), completion.model)
        await client.close()
    assert answers["A"] == (_reference(adapters["A"], prompt), "A")
    assert answers[served.model][0] == _reference(None, prompt)


async def test_adapters_with_speculation_and_a_grammar(adapters):
    """A draft without the adapter drafts worse, never differently: streams stay exact; a
    grammar row with an adapter produces valid JSON."""
    from runtime.config import SpeculativeConfig

    prompts = [_prompt(i) * 2 for i in range(4)]  # repeats: prompt lookup has drafts to offer
    names = ["A", "B", None, "C"]
    expected = [_reference(adapters.get(n) if n else None, p) for n, p in zip(names, prompts)]
    config = msgspec.structs.replace(_config(adapters), speculative=SpeculativeConfig(lookup=True))
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
    async with Runtime.open(config) as rt:
        got = await _run(rt, [GenerateRequest(prompt_ids=p, max_tokens=MAX_TOKENS, adapter=n) for n, p in zip(names, prompts)])
        text = ""
        async for event in rt.generate(GenerateRequest(prompt="answer:", max_tokens=64, adapter="B", response_format=fmt)):
            if isinstance(event, TokenDelta):
                text += event.text
        stats = await rt.stats()
    assert got == expected
    assert stats.scheduler.spec.drafted > 0, "the rows did speculate"
    assert isinstance(json.loads(text)["ok"], bool)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-gemma3", "tiny-lfm2", "tiny-qwen3next"])
async def test_adapter_rows_are_exact_on_every_family(family, tmp_path):
    """Biases (qwen2), sliding windows (gemma3), convolution state (lfm2), linear attention
    (qwen3-next): an adapter row decodes as mlx-lm does with the adapter alone, beside others."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model_dir = builtin_dir(family)
    # qwen3-next's experts (SwitchLinear) take no routed deltas: its adapters leave them alone.
    keys = ["linear_attn.in_proj_qkvz", "linear_attn.out_proj", "self_attn.q_proj", "mlp.shared_expert.up_proj"] if family == "tiny-qwen3next" else None
    paths = {
        "P": make_lora_adapter(model_dir, tmp_path / "P", rank=4, num_layers=1, seed=5, keys=keys),
        "Q": make_lora_adapter(model_dir, tmp_path / "Q", rank=8, num_layers=8, seed=6, keys=keys),
    }
    names = ["P", None, "Q", "P", "Q", None]
    prompts = [_prompt(i) for i in range(len(names))]
    expected = []
    for name, prompt in zip(names, prompts):
        model, tokenizer = load(str(model_dir), adapter_path=str(paths[name]) if name else None)
        model.set_dtype(mx.float32)
        expected.append(greedy_tokens(model, tokenizer, prompt, MAX_TOKENS))
    config = msgspec.structs.replace(make_config(f"builtin:{family}"), adapters=[AdapterConfig(name=n, path=str(p)) for n, p in paths.items()])
    async with Runtime.open(config) as rt:
        got = await _run(rt, [GenerateRequest(prompt_ids=p, max_tokens=MAX_TOKENS, adapter=n) for n, p in zip(names, prompts)])
    assert got == expected


async def test_an_adapter_on_expert_layers_is_refused_with_the_reason(tmp_path):
    experts = make_lora_adapter(builtin_dir("tiny-qwen3next"), tmp_path / "E", rank=4, num_layers=1)
    async with Runtime.open(make_config("builtin:tiny-qwen3next")) as rt:
        with pytest.raises(AdapterLoadError, match="SwitchLinear"):
            await rt.load_adapter("E", experts)


@pytest.mark.server
async def test_vllm_runtime_lora_routes_load_and_unload_over_http(adapters):
    from tests.support.http_serving import raw_request, serving

    async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
        data = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n".encode()
        status, _, answer = await raw_request(url, head, data)
        return status, json.loads(answer)

    prompt = _prompt(7)
    load_a = {"lora_name": "A", "lora_path": str(adapters["A"])}
    async with serving(_config(adapters, names=())) as served:
        assert (await post(served.url, "/v1/load_lora_adapter", load_a))[0] == 404, "off unless server.http_adapter_updates"
    async with serving(_config(adapters, names=()), http_adapter_updates=True) as served:
        status, loaded = await post(served.url, "/v1/load_lora_adapter", load_a)
        assert status == 200 and loaded["adapter"]["rank"] == 4
        body = {"model": "A", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
        status, completion = await post(served.url, "/v1/completions", body)
        assert status == 200 and completion["choices"][0]["token_ids"] == _reference(adapters["A"], prompt)
        status, bad = await post(served.url, "/v1/load_lora_adapter", {"lora_name": "B", "lora_path": "/nonexistent"})
        assert status == 422 and bad["error"]["code"] == "adapter_invalid"
        assert (await post(served.url, "/v1/unload_lora_adapter", {"lora_name": "A"}))[0] == 200
        assert (await post(served.url, "/v1/unload_lora_adapter", {"lora_name": "A"}))[0] == 404
        client = served.client()
        assert [m.id for m in (await client.models.list()).data] == [served.model]
        await client.close()


def _paged(adapters: dict, names, **lora):
    config = _config(adapters, names=names, **lora)
    return msgspec.structs.replace(config, kv=KvConfig(block_size=16, prefix_cache_bytes=1 << 26))


async def _finish(rt: Runtime, request: GenerateRequest) -> Finished:
    async for event in rt.generate(request):
        if isinstance(event, Finished):
            return event
    raise AssertionError("no Finished event")


async def _scheduled(rt: Runtime, *, decoding: int, waiting: int) -> bool:
    scheduler = (await rt.stats()).scheduler
    return scheduler.decoding == decoding and scheduler.waiting == waiting


async def _pool_after_probe(rt: Runtime):
    """The pool's figures, fresh: a request that starts and ends makes the engine report them
    (the same prompt every time: its entry replaces the one it left before)."""
    await _run(rt, [GenerateRequest(prompt_ids=_prompt(9), max_tokens=4)])
    pool = (await rt.stats()).kv.pool
    assert pool is not None
    return (pool.used, pool.shared, pool.unused_positions)


async def test_a_failed_adapter_admission_gives_back_its_kv_blocks(adapters, tmp_path):
    """A request seeded from a prefix entry (shared blocks, a copied partial block) whose
    adapter cannot be reloaded at admission ends with `error` and holds nothing afterwards."""
    own = dict(adapters, A=shutil.copytree(adapters["A"], tmp_path / "A"))
    system = _prompt(6)  # 47 tokens: two full blocks and a partial one
    async with Runtime.open(_paged(own, ("A", "B"), max_resident=1)) as rt:
        await _run(rt, [GenerateRequest(prompt_ids=system, max_tokens=4, adapter="A")])
        await _run(rt, [GenerateRequest(prompt_ids=_prompt(1), max_tokens=4, adapter="B")])  # A is evicted
        await _pool_after_probe(rt)
        baseline = await _pool_after_probe(rt)
        # A's files change while it is evicted: its reload at admission is refused.
        config = json.loads((own["A"] / "adapter_config.json").read_text())
        config["lora_parameters"]["scale"] = 3.0
        (own["A"] / "adapter_config.json").write_text(json.dumps(config))
        for i in range(8):
            finished = await _finish(rt, GenerateRequest(prompt_ids=[*system, 5 + i, 7], max_tokens=4, adapter="A"))
            assert finished.finish_reason == "error" and "changed" in (finished.error or ""), finished
            assert finished.usage.cached_tokens == len(system), "the request was seeded from the prefix entry"
        assert await _pool_after_probe(rt) == baseline


@pytest.mark.slow
async def test_an_adapter_unloaded_while_its_request_waits_leaves_no_blocks_held(adapters):
    system = _prompt(6)
    config = msgspec.structs.replace(_paged(adapters, ("A",)), scheduler=msgspec.structs.replace(make_config().scheduler, max_batch_size=1))
    waiting: list[Finished] = []

    async def wait_for_a(i: int) -> None:
        waiting.append(await _finish(rt, GenerateRequest(prompt_ids=[*system, 9, i], max_tokens=4, adapter="A")))

    long = GenerateRequest(prompt_ids=_prompt(2), max_tokens=800, ignore_eos=True)
    async with Runtime.open(config) as rt:
        await _run(rt, [GenerateRequest(prompt_ids=system, max_tokens=4, adapter="A")])
        await _finish(rt, long)  # its entry is in the baseline (the run below leaves the same)
        await _pool_after_probe(rt)
        baseline = await _pool_after_probe(rt)
        async with anyio.create_task_group() as tg:
            # The one batch row is taken (its stream read, so it is never parked) while the
            # requests for A queue; A is unloaded before they start.
            tg.start_soon(_finish, rt, long)
            await wait_until_async(lambda: _scheduled(rt, decoding=1, waiting=0))
            for i in range(4):
                tg.start_soon(wait_for_a, i)
            await wait_until_async(lambda: _scheduled(rt, decoding=1, waiting=4))
            await rt.unload_adapter("A")
        assert [f.finish_reason for f in waiting] == ["error"] * 4 and all("unloaded" in (f.error or "") for f in waiting), waiting
        # The request is at fault (it named an adapter that went away), not the server: 404 over HTTP.
        assert {f.error_code for f in waiting} == {"adapter_not_found"}, waiting
        assert all(f.usage.cached_tokens == len(system) for f in waiting)
        assert await _pool_after_probe(rt) == baseline


async def test_an_oversized_adapter_is_refused_unread_while_a_stream_goes_on(adapters, tmp_path, monkeypatch):
    """A weights file bigger than any adapter of `lora.max_rank` for this model can be (here a
    3 GB sparse file) is refused on its size, unread; a running stream goes on to its end."""
    huge = shutil.copytree(adapters["A"], tmp_path / "huge")
    with open(huge / "adapters.safetensors", "r+b") as f:
        f.truncate(3 * 2**30)
    prompt = _prompt(3)
    stream: list[int] = []
    finished: list[Finished] = []
    async with Runtime.open(_config(adapters, names=("A",))) as rt:
        started = anyio.Event()

        async def run() -> None:
            async for event in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS * 4)):
                if isinstance(event, TokenDelta):
                    stream.extend(event.token_ids)
                    started.set()
                elif isinstance(event, Finished):
                    finished.append(event)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await started.wait()
            opened = record_opens(monkeypatch)
            with pytest.raises(AdapterLoadError, match=r"adapters\.safetensors is 3,221,225,472 bytes, over the [\d,]+"):
                await rt.load_adapter("huge", huge)
            monkeypatch.undo()
        assert [a.name for a in await rt.adapters()] == ["A"]
    assert (huge / "adapters.safetensors").resolve() not in opened  # refused on its size, never read
    assert len(finished) == 1 and finished[0].error is None, finished
    assert stream == greedy_tokens(*load_reference("builtin:tiny"), prompt, MAX_TOKENS * 4)


async def test_evicted_adapters_reload_from_files_read_off_the_mlx_thread(adapters, monkeypatch):
    """Every adapter file is read in a worker thread: at start, at a load, and when a step
    reloads an evicted adapter (its files read before the step, handed to the bank)."""
    import threading

    import engine.lora

    reads: list[tuple[str, str]] = []
    read_bounded = engine.lora._read_bounded

    def recorded(name, path, max_bytes):
        reads.append((path.name, threading.current_thread().name))
        return read_bounded(name, path, max_bytes)

    monkeypatch.setattr(engine.lora, "_read_bounded", recorded)
    prompts = {n: _prompt(i + 1) for i, n in enumerate("AB")}
    async with Runtime.open(_config(adapters, names=("A", "B"), max_resident=1)) as rt:
        names = ["A", "B", "A", "B"]
        for name in names:  # one at a time: each request evicts the other adapter
            assert await _run(rt, [GenerateRequest(prompt_ids=prompts[name], max_tokens=MAX_TOKENS, adapter=name)]) == [
                _reference(adapters[name], prompts[name])
            ]
    weights_reads = [thread for file, thread in reads if file == "adapters.safetensors"]
    assert len(weights_reads) == 2 + len(names), reads  # two at start (B evicts A), then a reload per request
    assert "mlx" not in weights_reads, reads
