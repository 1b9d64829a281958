"""Several choices and prompt scores over HTTP: `n` (greedy choices equal, seeded ones distinct
and reproducible, the prompt prefilled once), several prompts in one completion request, `echo`
with `logprobs` (lm-eval's loglikelihood request: the prompt's tokens scored, `max_tokens: 0`),
vLLM's `prompt_logprobs`."""

from __future__ import annotations

import pytest

from protocols.api import GenerateRequest, TokenDelta
from tests.support.http_serving import serving

pytestmark = pytest.mark.server

LONG = [{"role": "user", "content": "Tell me a long story about a dragon and a knight in a castle by the sea."}]


async def _scores(rt, prompt_ids: list[int], k: int = 1) -> list:
    """The runtime's own scores of a prompt (its first delta's)."""
    async for event in rt.generate(GenerateRequest(prompt_ids=prompt_ids, max_tokens=1, prompt_logprobs=k)):
        if isinstance(event, TokenDelta):
            return event.prompt_logprobs or []
    raise AssertionError("no delta")


async def test_echo_with_logprobs_and_no_tokens_scores_the_prompt_alone():
    text = "Once upon a time, in a land far away"
    async with serving() as served:
        client = served.client()
        answer = await client.completions.create(model=served.model, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
        ids = served.runtime.tokenizer.encode(text)
        scores = await _scores(served.runtime, ids)
        from_ids = await client.completions.create(model=served.model, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
        await client.close()
    choice = answer.choices[0]
    assert choice.text == text and answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([s.logprob for s in scores], abs=1e-5)
    assert "".join(lp.tokens) == served.runtime.tokenizer.decode(ids)
    # lm-eval's greedy check: the top alternative is the token itself exactly when its rank is 1.
    assert [max(top.values()) == tok for tok, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:])] == [s.rank == 1 for s in scores]
    assert from_ids.choices[0].logprobs.token_logprobs == lp.token_logprobs


async def test_echo_puts_the_prompt_before_the_generated_text():
    async with serving() as served:
        client = served.client()
        plain = await client.completions.create(model=served.model, prompt="def add(a, b):", max_tokens=6, temperature=0, logprobs=0)
        echoed = await client.completions.create(model=served.model, prompt="def add(a, b):", max_tokens=6, temperature=0, logprobs=0, echo=True)
        await client.close()
    assert echoed.choices[0].text == "def add(a, b):" + plain.choices[0].text
    generated = len(plain.choices[0].logprobs.tokens)
    assert echoed.choices[0].logprobs.token_logprobs[-generated:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert len(echoed.choices[0].logprobs.tokens) == echoed.usage.prompt_tokens + generated


async def test_several_prompts_in_one_request_answer_as_they_would_alone():
    prompts = ["The cat", "A dog and", [5, 6, 7, 8]]
    async with serving() as served:
        client = served.client()
        together = await client.completions.create(model=served.model, prompt=prompts, max_tokens=5, temperature=0)
        alone = [await client.completions.create(model=served.model, prompt=p, max_tokens=5, temperature=0) for p in prompts]
        await client.close()
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


async def test_n_greedy_choices_are_equal_and_the_prompt_is_prefilled_once():
    async with serving() as served:
        client = served.client()
        before = await served.runtime.stats()
        answer = await client.chat.completions.create(model=served.model, messages=LONG, n=4, max_tokens=6, temperature=0)
        after = await served.runtime.stats()
        await client.close()
    texts = [c.message.content for c in answer.choices]
    assert [c.index for c in answer.choices] == [0, 1, 2, 3] and len(set(texts)) == 1
    prompt = answer.usage.prompt_tokens // 4
    # Three choices started from the first one's prefix: all of the prompt but two tokens each.
    assert after.kv.prefix_hits - before.kv.prefix_hits == 3
    assert after.kv.prefix_tokens_reused - before.kv.prefix_tokens_reused == 3 * (prompt - 2)
    assert answer.usage.prompt_tokens_details.cached_tokens == 3 * (prompt - 2)


async def test_n_seeded_choices_are_distinct_and_reproducible_streamed_or_not():
    async with serving() as served:
        client = served.client()
        kwargs = dict(model=served.model, messages=LONG, n=3, max_tokens=8, temperature=1.0, seed=11)
        first = await client.chat.completions.create(**kwargs)
        again = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        texts: dict[int, str] = {}
        usages = []
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            usages += [chunk.usage] if chunk.usage else []
        await client.close()
    choices = [c.message.content for c in first.choices]
    assert len(set(choices)) == 3
    assert [c.message.content for c in again.choices] == choices
    assert [texts[i] for i in range(3)] == choices
    assert len(usages) == 1 and usages[0].completion_tokens == first.usage.completion_tokens


async def test_vllm_prompt_logprobs_name_each_prompt_tokens_score_and_rank():
    async with serving() as served:
        client = served.client()
        answer = await client.completions.create(model=served.model, prompt="abc def", max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2})
        ids = served.runtime.tokenizer.encode("abc def")
        scores = await _scores(served.runtime, ids, 2)
        await client.close()
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for entry, score in zip(entries[1:], scores):
        own = entry[str(score.token_id)]
        assert own["logprob"] == pytest.approx(score.logprob, abs=1e-5) and own["rank"] == score.rank
        assert {int(t) for t in entry} >= {alt.token_id for alt in score.top}


async def test_max_tokens_zero_needs_echo():
    import openai

    async with serving() as served:
        client = served.client()
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=served.model, prompt="x", max_tokens=0)
        await client.close()
    assert info.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("pool", [False, True])
async def test_a_client_leaving_a_streamed_n_choice_answer_cancels_every_choice_cleanly(pool, caplog):
    """(Issue 46's soak) Leaving a streamed `n` answer served by a pool raised "aclose():
    asynchronous generator is already running" in the server (each choice's stream was closed
    while its forwarding task still iterated it); now every choice ends cancelled, nothing raised."""
    from tests.support.http_serving import wait_runtime_idle

    async with serving(pool=pool) as served:
        client = served.client()
        stream = await client.chat.completions.create(
            model=served.model, messages=LONG, n=3, max_tokens=200, temperature=0.8, stream=True, extra_body={"ignore_eos": True}
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        await stream.close()
        stats = await (wait_runtime_idle(served.runtime) if not pool else _pool_idle(served.runtime))
        await client.close()
    assert stats.live_requests == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], [r.getMessage() for r in caplog.records]


async def _pool_idle(pool):
    import anyio

    with anyio.fail_after(10):
        while (stats := await pool.stats()).live_requests:
            await anyio.sleep(0.02)
    return stats
