"""Request ids: reuse after an end, races on one id, and cancels that arrive early."""

from __future__ import annotations

import anyio
import pytest

from protocols import Finished, GenerateRequest, TokenDelta
from runtime import InvalidRequestError, RequestTooLargeError, Runtime


async def _collect(rt: Runtime, request: GenerateRequest, cancel_after: int | None = None) -> tuple[list[int], str]:
    tokens, reason = [], None
    async for event in rt.generate(request):
        if isinstance(event, TokenDelta):
            tokens += event.token_ids
            if cancel_after is not None and len(tokens) >= cancel_after:
                cancel_after = None
                await rt.cancel(request.request_id)
        elif isinstance(event, Finished):
            reason = event.finish_reason
    return tokens, reason


async def _tokens_and_reason(events) -> tuple[list[int], str]:
    tokens, reason = [], None
    async for event in events:
        if isinstance(event, TokenDelta):
            tokens += event.token_ids
        elif isinstance(event, Finished):
            reason = event.finish_reason
    return tokens, reason


def _short(rid: str) -> GenerateRequest:
    return GenerateRequest(prompt_ids=[9], max_tokens=4, ignore_eos=True, request_id=rid)


async def test_an_id_reused_after_a_cancel_gets_none_of_the_old_tokens(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        fresh = await _collect(rt, _short("fresh"))
        cancelled = await _collect(rt, GenerateRequest(prompt_ids=[5, 6, 7, 8], max_tokens=50, ignore_eos=True, request_id="X"), cancel_after=3)
        reused = await _collect(rt, _short("X"))
    assert cancelled[1] == "cancelled"
    assert reused == fresh == (fresh[0], "length")


async def test_stopping_at_finished_does_not_cancel_a_later_request_with_that_id(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        async for event in rt.generate(_short("Y")):
            if isinstance(event, Finished):
                break  # the generator is left suspended at its last yield
        tokens, reason = await _collect(rt, _short("Y"))
    assert reason == "length" and len(tokens) == 4


async def test_one_id_cannot_run_twice(tiny_config):
    long = GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=400, ignore_eos=True, request_id="Z")
    async with Runtime.open(tiny_config) as rt:
        async with anyio.create_task_group() as tg:
            results = {}
            live = rt.submit(long)  # "Z" is claimed from here

            async def first():
                async with live:
                    results["first"] = await _tokens_and_reason(live)

            async def other():
                results["other"] = await _collect(rt, _short("O"))

            tg.start_soon(first)
            with pytest.raises(InvalidRequestError) as info:
                await _collect(rt, long)
            assert info.value.field == "request_id"
            with pytest.raises(InvalidRequestError):
                async for _ in rt.resume("Z"):
                    pass
            tg.start_soon(other)
        assert results["first"][1] == "length" and results["other"][1] == "length"


async def test_an_early_cancel_for_a_refused_request_does_not_linger(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        too_long = GenerateRequest(prompt_ids=[1] * rt.model_info.max_context, request_id="E")
        stream = rt.submit(too_long)  # claimed; prepared when first iterated
        await rt.cancel("E")  # arrives before the request is prepared (and refused)
        with pytest.raises(RequestTooLargeError):
            async with stream:
                await _tokens_and_reason(stream)
        tokens, reason = await _collect(rt, _short("E"))
    assert reason == "length" and len(tokens) == 4


async def test_submit_claims_the_id_at_once_and_closing_gives_it_back(tiny_config):
    from runtime.errors import DuplicateRequestError

    async with Runtime.open(tiny_config) as rt:
        first = rt.submit(_short("claimed"))
        with pytest.raises(DuplicateRequestError) as info:
            rt.submit(_short("claimed"))  # no await: the claim is synchronous
        assert info.value.field == "request_id" and info.value.code == "duplicate_request"
        await first.aclose()  # never iterated: the id is free again
        async with rt.submit(_short("claimed")) as again:
            events = [event async for event in again]
        assert isinstance(events[-1], Finished) and events[-1].finish_reason == "length"
        assert (await rt.stats()).live_requests == 0


async def test_a_cancel_before_the_stream_starts_ends_it_cancelled(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        stream = rt.submit(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=500, ignore_eos=True, request_id="early"))
        await rt.cancel("early")  # the request is not even prepared yet
        async with stream:
            events = [event async for event in stream]
        finished = events[-1]
        assert isinstance(finished, Finished) and finished.finish_reason == "cancelled"
        assert sum(len(e.token_ids) for e in events if isinstance(e, TokenDelta)) < 500
