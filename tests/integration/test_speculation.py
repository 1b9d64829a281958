"""Speculative decoding in the shared batch, end to end: streams equal decoding without it.

Draft pairs: `tiny-spec` (llama, its last two layers damped) with `tiny-spec-draft` (its first
two layers): they agree on most greedy choices, not all, so rounds keep some drafts and rewind
others; `tiny-qwen2` drafted by `tiny` (another architecture, agreeing by chance: mostly
rewinds); sliding-window and recurrent targets drafted by `tiny-spec-draft`. Rounds draft a
fixed k (`adaptive = false`) so that every row keeps speculating whatever its acceptance.
"""

from __future__ import annotations

import json
import random

import anyio
import jsonschema
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta
from runtime import Runtime
from runtime.config import RuntimeConfig, SpeculativeConfig
from tests.support.config import make_config
from tests.support.damped_models import damped_model

# name: (target, draft)
PAIRS = {
    "llama": ("tiny-spec", "tiny-spec-draft"),
    "qwen2": ("tiny-qwen2", "tiny"),
    "gemma3": ("tiny-gemma3", "tiny-spec-draft"),
    "lfm2": ("tiny-lfm2", "tiny-spec-draft"),
}
GREEDY = SamplingParams()


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=seed)


def spec_config(model: str, *, draft: str = "", lookup: bool = False, acceptance: str = "exact", adaptive: bool = False, **scheduler) -> RuntimeConfig:
    base = make_config(model, **scheduler)
    spec = SpeculativeConfig(draft=draft, lookup=lookup, acceptance=acceptance, adaptive=adaptive, max_batch=16)  # type: ignore[arg-type]
    return msgspec.structs.replace(base, speculative=spec)


async def run(rt: Runtime, request: GenerateRequest) -> tuple[list[int], Finished]:
    ids, finished = [], None
    async for event in rt.generate(request):
        if isinstance(event, TokenDelta):
            ids += event.token_ids
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    return ids, finished


async def run_all(rt: Runtime, requests: list[GenerateRequest]) -> list[tuple[list[int], Finished]]:
    results: list = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await run(rt, requests[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return results


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 1000) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


def workload() -> dict[str, list[GenerateRequest]]:
    """One request alone, and batches of 8 (greedy; seeded sampled with a repetition penalty)
    in which every other row opts out of speculation."""
    ps = prompts(9)

    def batch(sampling) -> list[GenerateRequest]:
        return [
            GenerateRequest(prompt_ids=ps[i + 1], max_tokens=40, ignore_eos=True, sampling=sampling(i), speculative=False if i % 2 else None) for i in range(8)
        ]

    return {
        "alone": [GenerateRequest(prompt_ids=ps[0], max_tokens=48, ignore_eos=True)],
        "greedy": batch(lambda i: GREEDY),
        "seeded": batch(lambda i: seeded(100 + i)),
    }


async def outputs(config: RuntimeConfig) -> dict[str, list[tuple[list[int], Finished]]]:
    async with Runtime.open(config) as rt:
        result = {name: await run_all(rt, requests) for name, requests in workload().items()}
        stats = await rt.stats()
        page = rt.metrics.render().decode()
    result["stats"] = stats  # type: ignore[assignment]
    result["metrics"] = {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(page) for s in f.samples}  # type: ignore[assignment]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS))
async def test_streams_with_speculation_equal_streams_without(pair):
    target, draft = PAIRS[pair]
    plain = await outputs(make_config(f"builtin:{target}"))
    spec = await outputs(spec_config(f"builtin:{target}", draft=f"builtin:{draft}"))
    for name in ("alone", "greedy", "seeded"):
        for i, ((want, _), (got, finished)) in enumerate(zip(plain[name], spec[name])):
            assert got == want, f"{name} row {i}"
            assert finished.usage.completion_tokens == len(want)
    speculated = [f.spec for name in ("alone", "greedy", "seeded") for i, (_, f) in enumerate(spec[name]) if name == "alone" or i % 2 == 0]
    assert all(s is not None and s.method == "draft" and s.rounds > 0 for s in speculated)
    assert all(f.spec is None for name in ("greedy", "seeded") for i, (_, f) in enumerate(spec[name]) if i % 2)
    for s in speculated:
        assert s.accepted + s.rejected == s.drafted and sum(s.accepted_by_position) == s.accepted
        assert s.accepted_by_position == sorted(s.accepted_by_position, reverse=True)
        assert s.generated == s.target_forwards + s.forwards_saved and s.forwards_saved == s.accepted
    assert sum(s.rejected for s in speculated) > 0, "rewinds were exercised"
    if pair == "llama":
        assert sum(s.accepted for s in speculated) > sum(s.rejected for s in speculated), "a pair that mostly agrees"
    totals = spec["stats"].scheduler.spec  # type: ignore[attr-defined]
    assert totals.requests == len(speculated) and totals.accepted == sum(s.accepted for s in speculated)
    assert plain["stats"].scheduler.spec.requests == 0  # type: ignore[attr-defined]
    # Prometheus: vLLM's speculative decoding counters.
    metrics = spec["metrics"]
    assert metrics[("mlxrt:spec_decode_num_drafts_total", None)] == sum(s.rounds for s in speculated)  # type: ignore[call-overload]
    assert metrics[("mlxrt:spec_decode_num_draft_tokens_total", None)] == sum(s.drafted for s in speculated)  # type: ignore[call-overload]
    assert metrics[("mlxrt:spec_decode_num_accepted_tokens_total", None)] == sum(s.accepted for s in speculated)  # type: ignore[call-overload]
    assert metrics[("mlxrt:spec_decode_num_accepted_tokens_per_pos_total", "0")] == sum(s.accepted_by_position[0] for s in speculated)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def copying_model(tmp_path_factory) -> str:
    # Token mixers damped to 2% and logits scaled 4x: next tokens follow the current one,
    # sampled ones too, so text repeats.
    return damped_model("tiny", 0.02, tmp_path_factory.mktemp("copying-spec"), head_scale=4.0)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.7, seed=11)], ids=["greedy", "temp0.7"])
async def test_prompt_lookup_is_exact_and_saves_target_forwards(copying_model, sampling):
    async with Runtime.open(make_config(copying_model)) as rt:
        text = rt.tokenizer.encode("def add(a, b):\n    return a + b\n")
        answer, _ = await run(rt, GenerateRequest(prompt_ids=text, max_tokens=64, ignore_eos=True))
        request = GenerateRequest(prompt_ids=text + answer + text, max_tokens=64, ignore_eos=True, sampling=sampling)
        want, _ = await run(rt, request)
    async with Runtime.open(spec_config(copying_model, lookup=True, adaptive=True)) as rt:
        got, finished = await run(rt, request)
    assert got == want
    s = finished.spec
    assert s is not None and s.method == "lookup" and s.accepted > 0
    assert s.target_forwards < s.generated == len(want)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.7, seed=5)], ids=["greedy", "temp0.7"])
async def test_prompt_lookup_on_a_model_that_copies_its_context(sampling):
    """`tiny-copy` copies what it was shown (induction heads): lookup drafts long runs that
    are kept, the stream stays the one decoded without speculation."""
    document = random.Random(4).sample(range(20, 1000), 96)
    request = GenerateRequest(prompt_ids=[*document, 13, 13, *document[:4]], max_tokens=80, ignore_eos=True, sampling=sampling)
    async with Runtime.open(make_config("builtin:tiny-copy")) as rt:
        want, _ = await run(rt, request)
    async with Runtime.open(spec_config("builtin:tiny-copy", lookup=True, adaptive=True)) as rt:
        got, finished = await run(rt, request)
    assert got == want
    if sampling.temperature == 0:
        assert want == [*document, 13, 13, *document][4:84]
    s = finished.spec
    assert s is not None and s.method == "lookup" and s.accepted >= 0.9 * s.drafted
    assert s.tokens_per_forward >= 3.0 and max(s.accepted_by_position[4:], default=0) > 0, "drafts longer than a draft model's"


async def test_asking_for_speculation_without_a_draft_gets_prompt_lookup():
    async with Runtime.open(make_config()) as rt:
        prompt = prompts(1)[0]
        want, plain = await run(rt, GenerateRequest(prompt_ids=prompt, max_tokens=24, ignore_eos=True))
        got, finished = await run(rt, GenerateRequest(prompt_ids=prompt, max_tokens=24, ignore_eos=True, speculative=True))
        refused_ids, refused = await run(rt, GenerateRequest(prompt_ids=prompt, max_tokens=24, ignore_eos=True, speculative=True, logprobs=True))
    assert plain.spec is None
    assert got == want and finished.spec is not None and finished.spec.method == "lookup" and finished.spec.refused is None
    # Log-probabilities are not reported for kept drafts: that request decodes plainly and says why.
    assert refused_ids == want and refused.finish_reason == "length"
    assert refused.spec is not None and refused.spec.refused is not None and "logprobs" in refused.spec.refused


async def test_a_prefix_hit_on_speculated_output_is_exact():
    """Prefix entries hold only verified tokens: a request that continues an earlier one's
    output from its saved KV gets the tokens decoding from scratch gives."""
    target, draft = PAIRS["llama"]
    first = GenerateRequest(prompt_ids=prompts(1, seed=8)[0], max_tokens=40, ignore_eos=True)
    async with Runtime.open(spec_config(f"builtin:{target}", draft=f"builtin:{draft}")) as rt:
        answer, _ = await run(rt, first)
        follow = GenerateRequest(prompt_ids=first.prompt_ids + answer + [7, 8, 9], max_tokens=24, ignore_eos=True)
        got, finished = await run(rt, follow)
    async with Runtime.open(make_config(f"builtin:{target}")) as rt:
        want, _ = await run(rt, follow)
        plain_answer, _ = await run(rt, first)
    assert answer == plain_answer and got == want
    assert finished.usage.cached_tokens > len(first.prompt_ids), "the hit covered speculated output"
    assert finished.spec is not None and finished.spec.rounds > 0


@pytest.mark.slow
async def test_cancel_mid_round_reports_only_verified_tokens_and_frees_kv():
    target, draft = PAIRS["llama"]
    ps = prompts(3, seed=9)
    async with Runtime.open(make_config(f"builtin:{target}")) as rt:
        plain = [(await run(rt, GenerateRequest(prompt_ids=p, max_tokens=300, ignore_eos=True)))[0] for p in ps]
    async with Runtime.open(spec_config(f"builtin:{target}", draft=f"builtin:{draft}")) as rt:
        cancelled: dict[str, list[int]] = {}
        finished: dict[str, Finished] = {}

        async def doomed(i: int) -> None:
            rid = f"doomed-{i}"
            ids: list[int] = []
            async for event in rt.generate(GenerateRequest(prompt_ids=ps[i], max_tokens=300, ignore_eos=True, request_id=rid)):
                if isinstance(event, TokenDelta):
                    ids += event.token_ids
                    if len(ids) >= 10 + 7 * i:
                        await rt.cancel(rid)
                elif isinstance(event, Finished):
                    finished[rid] = event
            cancelled[rid] = ids

        bystander: list = []

        async def stay() -> None:
            bystander.extend(await run(rt, GenerateRequest(prompt_ids=ps[2], max_tokens=300, ignore_eos=True)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(stay)
            for i in range(2):
                tg.start_soon(doomed, i)
        with anyio.fail_after(10):
            while (stats := await rt.stats()).scheduler.decoding or stats.kv.live_requests:
                await anyio.sleep(0.02)
    # Only the ended requests' prefix entries hold KV (the draft's rows went with them).
    assert stats.kv.physical_bytes == stats.kv.prefix_bytes
    for i in range(2):
        ids = cancelled[f"doomed-{i}"]
        assert finished[f"doomed-{i}"].finish_reason == "cancelled"
        assert 10 <= len(ids) < 300 and ids == plain[i][: len(ids)]
    assert bystander[0] == plain[2]


async def test_grammar_constrained_speculation_produces_valid_json():
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}}, "required": ["name", "n"]}
    target, draft = PAIRS["llama"]
    request = GenerateRequest(
        prompt="Give me a record.", max_tokens=120, response_format={"type": "json_schema", "json_schema": {"schema": schema}}, jump_forward=False
    )
    async with Runtime.open(make_config(f"builtin:{target}")) as rt:
        want, _ = await run(rt, request)
    async with Runtime.open(spec_config(f"builtin:{target}", draft=f"builtin:{draft}")) as rt:
        got, finished = await run(rt, request)
        text = rt.tokenizer.decode(got)
    assert got == want
    assert finished.finish_reason == "stop" and finished.spec is not None and finished.spec.rounds > 0
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
async def test_rejection_acceptance_serves_sampled_rows_and_keeps_greedy_rows_exact():
    """`rejection` keeps more drafts of sampled rows (their distribution, not their stream, is
    the target's: see tests/engine/test_speculation_sampling.py); greedy rows stay exact."""
    target, draft = PAIRS["llama"]
    ps = prompts(4, seed=12)
    greedy = GenerateRequest(prompt_ids=ps[0], max_tokens=40, ignore_eos=True)
    sampled = [GenerateRequest(prompt_ids=p, max_tokens=40, ignore_eos=True, sampling=seeded(7 + i)) for i, p in enumerate(ps[1:])]
    async with Runtime.open(make_config(f"builtin:{target}")) as rt:
        (want, _), *_ = await run_all(rt, [greedy, *sampled])
    async with Runtime.open(spec_config(f"builtin:{target}", draft=f"builtin:{draft}", acceptance="rejection")) as rt:
        (got, _), *rows = await run_all(rt, [greedy, *sampled])
        exact = await run_all(rt, [msgspec.structs.replace(r, acceptance="exact") for r in sampled])
    assert got == want
    for (ids, finished), (_, exact_finished) in zip(rows, exact):
        s = finished.spec
        assert len(ids) == 40 and finished.finish_reason == "length"
        assert s is not None and s.acceptance == "rejection" and s.rounds > 0 and s.accepted + s.rejected == s.drafted
        assert exact_finished.spec is not None and exact_finished.spec.acceptance == "exact"
    rejection_rate = sum(f.spec.accepted for _, f in rows) / sum(f.spec.drafted for _, f in rows)  # type: ignore[union-attr]
    exact_rate = sum(f.spec.accepted for _, f in exact) / sum(f.spec.drafted for _, f in exact)  # type: ignore[union-attr]
    assert rejection_rate >= exact_rate - 0.05, (rejection_rate, exact_rate)
