"""Cancellation: by id and by abandoning the stream, mid-prefill and mid-decode."""

from __future__ import annotations

import contextlib
import random

import anyio

from protocols import Finished, GenerateRequest, PrefillProgress, TokenDelta
from runtime import Runtime
from tests.support.config import CHUNK
from tests.support.mlx_reference import greedy_tokens, load_reference

MAX_TOKENS = 20


def _prompts(lengths):
    rng = random.Random(11)
    return [[rng.randrange(1000) for _ in range(n)] for n in lengths]


async def _collect(rt: Runtime, prompt: list[int]) -> tuple[list[int], Finished]:
    tokens = []
    async for event in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=MAX_TOKENS)):
        if isinstance(event, TokenDelta):
            tokens += event.token_ids
        elif isinstance(event, Finished):
            return tokens, event
    raise AssertionError("stream ended without Finished")


async def _wait_idle(rt: Runtime) -> None:
    with anyio.fail_after(5):
        while (stats := await rt.stats()).live_requests or stats.kv.live_tokens:
            await anyio.sleep(0.01)


async def _cancel_by_id(rt: Runtime, prompt: list[int], phase: str) -> tuple[Finished, int]:
    """Cancel when the request is in `phase`; returns its Finished and the steps it took to end."""
    request = GenerateRequest(prompt_ids=prompt, max_tokens=200, request_id=f"victim-{phase}", report_progress=True, ignore_eos=True)
    steps_at_cancel = None
    async for event in rt.generate(request):
        in_phase = isinstance(event, PrefillProgress) if phase == "prefill" else isinstance(event, TokenDelta)
        if in_phase and steps_at_cancel is None:
            await rt.cancel(request.request_id)
            # (A fresh stats answers after the scheduler has read every message sent before it: the
            # steps from here on are the cancel's, not the ones run while it was in transit.)
            steps_at_cancel = (await rt.stats()).scheduler.steps
        if isinstance(event, Finished):
            return event, (await rt.stats()).scheduler.steps - steps_at_cancel
    raise AssertionError("no Finished")


async def test_cancel_by_id_mid_prefill_and_mid_decode(tiny_config):
    model, tokenizer = load_reference("builtin:tiny")
    others = _prompts([5, 12, 30])
    references = [greedy_tokens(model, tokenizer, p, MAX_TOKENS) for p in others]
    victim = _prompts([8 * CHUNK])[0]
    async with Runtime.open(tiny_config) as rt:
        results: dict = {}

        async def other(i):
            results[i] = await _collect(rt, others[i])

        async def victims():
            for phase in ("prefill", "decode"):
                finished, steps = await _cancel_by_id(rt, victim, phase)
                results[phase] = (finished, steps)

        async with anyio.create_task_group() as tg:
            tg.start_soon(victims)
            for i in range(len(others)):
                tg.start_soon(other, i)
        for phase in ("prefill", "decode"):
            finished, steps = results[phase]
            assert finished.finish_reason == "cancelled"
            # The release rides the first plan after the scheduler reads the cancel (see the
            # policy and engine tests), or, while short decode steps run ahead, the plan after
            # the one queued ahead; the margin covers steps run while the Finished event and the
            # last stats were in transit.
            assert steps <= 4, "the cancelled request must end within two steps of the cancel"
        for i, reference in enumerate(references):
            assert results[i][0] == reference
        await _wait_idle(rt)
        # Still serving after the cancellations.
        assert (await _collect(rt, others[0]))[0] == references[0]


async def test_abandoning_the_stream_cancels(tiny_config):
    prompt = _prompts([10])[0]
    async with Runtime.open(tiny_config) as rt:
        async with contextlib.aclosing(rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=500, ignore_eos=True))) as stream:
            async for event in stream:
                if isinstance(event, TokenDelta):
                    break
        await _wait_idle(rt)
        stats = await rt.stats()
        assert stats.scheduler.num_finished == 1 and stats.kv.reserved_tokens == 0

        # A plain `break` with no aclose: the generator is finalized when dropped.
        async for event in rt.generate(GenerateRequest(prompt_ids=prompt, max_tokens=500, ignore_eos=True)):
            if isinstance(event, TokenDelta):
                break
        await _wait_idle(rt)
        assert (await rt.stats()).scheduler.num_finished == 2


async def test_cancel_while_waiting_in_the_queue():
    from tests.support.config import make_config

    prompts = _prompts([10, 10])
    async with Runtime.open(make_config(max_batch_size=1)) as rt:
        first = GenerateRequest(prompt_ids=prompts[0], max_tokens=300, ignore_eos=True, request_id="first")
        second = GenerateRequest(prompt_ids=prompts[1], max_tokens=5, request_id="second")
        seen: dict = {}

        async def run_second():
            async for event in rt.generate(second):
                seen["second"] = event

        async with anyio.create_task_group() as tg:
            num_deltas = 0
            async for event in rt.generate(first):
                if isinstance(event, TokenDelta):
                    num_deltas += 1
                    if num_deltas == 1:
                        tg.start_soon(run_second)
                    elif num_deltas == 5:
                        # "second" has been queued behind "first" for several steps by now.
                        assert (await rt.stats()).scheduler.waiting == 1
                        await rt.cancel("second")
                        await rt.cancel("first")
                elif isinstance(event, Finished):
                    seen["first"] = event
        assert seen["second"].finish_reason == "cancelled"
        assert seen["second"].usage.completion_tokens == 0
        assert seen["first"].finish_reason == "cancelled"
        await _wait_idle(rt)
