"""Token fast-forwarding: strict tool-call rows (assert) and echo spans (verify)."""

from __future__ import annotations

import json

import anyio
import jsonschema
import msgspec
import pytest

from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta, ToolCall
from runtime import InvalidRequestError, Runtime
from tests.support.config import make_config
from tests.support.damped_models import damped_model
from tests.support.tool_schemas import CLOCK, WEATHER

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ONE_ARG = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12}}, "required": ["query"]}},
}


async def _run(rt: Runtime, request: GenerateRequest) -> tuple[list[int], list[ToolCall], Finished, int]:
    ids, calls, finished = [], [], None
    before = (await rt.stats()).scheduler.steps
    async for event in rt.generate(request):
        if isinstance(event, TokenDelta):
            ids += event.token_ids
        elif isinstance(event, ToolCall):
            calls.append(event)
        elif isinstance(event, Finished):
            finished = event
    return ids, calls, finished, (await rt.stats()).scheduler.steps - before


@pytest.mark.parametrize("tools", [[WEATHER, CLOCK], [ONE_ARG]], ids=["two-tools", "one-arg"])
async def test_strict_rows_append_the_scaffold_of_a_forced_tool_call(tiny_config, tools):
    async with Runtime.open(tiny_config) as rt:
        runs = {}
        for mode in ("off", "strict"):
            request = GenerateRequest(messages=MESSAGES, tools=tools, tool_choice="required", max_tokens=200, fill=mode, jump_forward=False)
            runs[mode] = await _run(rt, request)
    (_, _, plain_end, plain_steps), (ids, calls, finished, steps) = runs["off"], runs["strict"]
    assert plain_end.fill is None
    stats = finished.fill
    assert stats.mode == "strict" and stats.refused is None
    assert stats.strict > 0 and stats.events >= 1 and stats.injected == sum(stats.span_lens)
    assert stats.decode_steps + stats.injected == len(ids)
    assert steps < plain_steps, f"{steps} forwards with strict rows, {plain_steps} without"
    assert finished.finish_reason == "stop" and len(calls) == 1
    call = calls[0]
    tool = next(t for t in tools if t["function"]["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])


@pytest.fixture(scope="module")
def copying_model(tmp_path_factory) -> str:
    return damped_model("tiny", 0.0, tmp_path_factory.mktemp("copying"))


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
async def test_echo_spans_never_change_greedy_output_and_save_forwards(copying_model, batched):
    async with Runtime.open(make_config(copying_model)) as rt:
        # What the model says after a text, then a prompt that holds that answer and ends
        # with the text again: the answer is worth copying.
        text = rt.tokenizer.encode("def add(a, b):\n    return a + b\n")
        answer, *_ = await _run(rt, GenerateRequest(prompt_ids=text, max_tokens=64, ignore_eos=True))
        prompt = text + answer + text
        others = [GenerateRequest(prompt=f"other {i}", max_tokens=40, ignore_eos=True) for i in range(3 if batched else 0)]
        runs = {}
        for mode in ("off", "echo"):
            async with anyio.create_task_group() as tg:
                for other in others:
                    tg.start_soon(_run, rt, other)
                runs[mode] = await _run(rt, GenerateRequest(prompt_ids=prompt, max_tokens=64, ignore_eos=True, fill=mode))
    (plain_ids, _, _, plain_steps), (ids, _, finished, steps) = runs["off"], runs["echo"]
    assert ids == plain_ids == answer
    stats = finished.fill
    assert stats.echo > 0 and stats.verify_events > 0 and stats.verify_accepted == stats.echo
    assert stats.decode_steps + stats.echo == len(ids)
    assert steps < plain_steps, f"{steps} forwards with echo, {plain_steps} without"


# Scales at which each model copies part of an earlier answer and then departs from it.
PARTIAL_COPIERS = {"tiny-gemma3": 0.1, "tiny-lfm2": 0.1, "tiny-qwen3next": 0.3}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARTIAL_COPIERS))
async def test_echo_spans_on_sliding_and_recurrent_layers_are_exact(name, tmp_path):
    """Accepted spans and rejected tails on a model with 16-token sliding windows and on
    hybrids whose recurrent layers cannot be trimmed (their state is restored from a snapshot
    and the accepted prefix replayed): the output equals plain decoding, token for token."""
    config = make_config(damped_model(name, PARTIAL_COPIERS[name], tmp_path))
    config = msgspec.structs.replace(config, generation=msgspec.structs.replace(config.generation, fill_echo_k=2))
    async with Runtime.open(config) as rt:
        text = rt.tokenizer.encode("def add(a, b):\n    return a + b\n")
        answer, *_ = await _run(rt, GenerateRequest(prompt_ids=text, max_tokens=64, ignore_eos=True))
        prompt = text + answer + text
        others = [GenerateRequest(prompt=f"other {i}", max_tokens=40, ignore_eos=True) for i in range(2)]
        runs = {}
        for mode in ("off", "echo"):
            async with anyio.create_task_group() as tg:
                for other in others:
                    tg.start_soon(_run, rt, other)
                runs[mode] = await _run(rt, GenerateRequest(prompt_ids=prompt, max_tokens=64, ignore_eos=True, fill=mode))
    (plain_ids, *_), (ids, _, finished, _) = runs["off"], runs["echo"]
    assert ids == plain_ids
    stats = finished.fill
    assert stats.verify_accepted > 0 and stats.verify_rejected > 0, stats
    assert stats.decode_steps + stats.echo == len(ids)


async def test_rejected_echo_tokens_are_rewound(tiny_config):
    """A random model rarely agrees with a copied span: what it rejects must leave no trace."""
    config = make_config(max_batch_size=4)
    config = msgspec.structs.replace(config, generation=msgspec.structs.replace(config.generation, fill_echo_k=2))
    async with Runtime.open(config) as rt:
        prompt = "x = [1, 1, 1, 1, 1, 1, 1, 1]\n" * 8
        runs = {mode: await _run(rt, GenerateRequest(prompt=prompt, max_tokens=96, ignore_eos=True, fill=mode)) for mode in ("off", "echo")}
    assert runs["echo"][0] == runs["off"][0]
    assert runs["echo"][2].fill.verify_rejected > 0


async def test_refusals_are_reported(tiny_config):
    fmt = {"type": "json_object"}
    async with Runtime.open(tiny_config) as rt:
        _, _, finished, _ = await _run(rt, GenerateRequest(prompt="x", max_tokens=8, fill="strict", response_format=fmt))
        assert finished.fill.refused and "grammar" in finished.fill.refused
        _, _, finished, _ = await _run(rt, GenerateRequest(prompt="x", max_tokens=8, fill="echo", logprobs=True))
        assert finished.fill.refused and "logprobs" in finished.fill.refused
        ids, _, finished, _ = await _run(rt, GenerateRequest(prompt="x", max_tokens=8, ignore_eos=True, fill="echo", sampling=SamplingParams(temperature=0.7)))
        assert finished.fill.refused is None and "temperature" in finished.fill.echo_refused and len(ids) == 8
        # An explicit seed at temperature > 0: strict injection would bypass the seeded sampler.
        ids, _, finished, _ = await _run(
            rt, GenerateRequest(prompt="x", max_tokens=8, ignore_eos=True, fill="strict", sampling=SamplingParams(temperature=0.7, seed=1))
        )
        assert finished.fill.refused and "seed" in finished.fill.refused and len(ids) == 8
        with pytest.raises(InvalidRequestError) as info:
            await _run(rt, GenerateRequest(prompt="x", fill="sometimes"))
        assert info.value.field == "fill"
        with pytest.raises(InvalidRequestError) as info:
            await _run(rt, GenerateRequest(messages=MESSAGES, tools=[{"type": "function", "function": {"parameters": {}}}], fill="strict"))
        assert info.value.field == "tools"


async def test_trace_records_each_span_next_to_the_models_choices(copying_model, tmp_path):
    trace = tmp_path / "fill.jsonl"
    config = make_config(copying_model)
    config = msgspec.structs.replace(config, generation=msgspec.structs.replace(config.generation, fill="echo", fill_trace=str(trace)))
    async with Runtime.open(config) as rt:
        text = rt.tokenizer.encode("class A:\n    pass\n")
        answer, *_ = await _run(rt, GenerateRequest(prompt_ids=text, max_tokens=40, ignore_eos=True, fill="off"))
        ids, _, finished, _ = await _run(rt, GenerateRequest(prompt_ids=text + answer + text, max_tokens=40, ignore_eos=True))
    assert ids == answer and finished.fill.mode == "echo"
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == finished.fill.verify_events > 0
    for record in records:
        assert record["policy"] == "verify" and record["origin"] == "echo"
        n = record["accepted"]
        assert record["proposed"][:n] == record["actual"][:n]
        assert record["first_mismatch"] == (-1 if n == record["proposed_len"] else n)
