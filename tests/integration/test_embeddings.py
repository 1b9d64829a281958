"""`Runtime.embed`: the model's final hidden states pooled as mlx-lm computes them (its body on one
input at a time), batched, padded and chunked alike; texts tokenized as a completion prompt is;
concurrent decoding streams unchanged; bad input refused naming the input."""

from __future__ import annotations

import random

import anyio
import mlx.core as mx
import msgspec
import pytest

from engine.embed import EmbedJob
from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta
from protocols.config import EmbeddingsConfig
from runtime import ConfigError, InvalidRequestError, RequestTooLargeError, Runtime
from runtime.config import RuntimeConfig
from tests.support.config import make_config
from tests.support.mlx_reference import greedy_tokens, load_reference
from tests.support.waiting import wait_until_async

TOLERANCE = 1e-5
LENGTHS = (1, 5, 17, 40, 9)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


INPUTS = [_ids(n, seed) for seed, n in enumerate(LENGTHS)]


def _config(**embeddings) -> RuntimeConfig:
    config = make_config()
    return msgspec.structs.replace(config, embeddings=msgspec.structs.replace(config.embeddings, **embeddings))


def _reference(model, ids: list[int], pooling: str, normalize: bool = True) -> list[float]:
    """mlx-lm's own: the body on this input alone, pooled and normalized in float32."""
    states = model.model(mx.array(ids)[None])[0].astype(mx.float32)
    vector = states[-1] if pooling == "last" else states.mean(axis=0)
    if normalize:
        vector = vector / mx.linalg.norm(vector)
    return vector.tolist()


def _assert_close(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert len(a) == len(b)
        assert max(abs(x - y) for x, y in zip(a, b)) < TOLERANCE


@pytest.mark.parametrize("pooling", ["last", "mean"])
async def test_embeddings_equal_mlx_lm_single_and_batched(pooling):
    model, _ = load_reference("builtin:tiny")
    want = [_reference(model, ids, pooling) for ids in INPUTS]
    raw = [_reference(model, ids, pooling, normalize=False) for ids in INPUTS]
    async with Runtime.open(_config()) as rt:
        width = rt.model_info.embedding_size
        singles = [(await rt.embed([ids], pooling=pooling))[0][0] for ids in INPUTS]
        batched, num_tokens = await rt.embed(INPUTS, pooling=pooling)
        unnormalized, _ = await rt.embed(INPUTS, pooling=pooling, normalize=False)
    assert width == len(want[0]) == 64
    _assert_close(singles, want)
    _assert_close(batched, want)  # one right-padded forward of five lengths
    _assert_close(unnormalized, raw)
    assert num_tokens == sum(LENGTHS)
    assert all(abs(sum(x * x for x in v) - 1.0) < 1e-5 for v in batched)


@pytest.mark.parametrize("pooling", ["last", "mean"])
async def test_long_inputs_go_in_chunks_and_batches_split_by_tokens(pooling):
    """16 tokens a forward: the 17- and 40-token inputs go in chunks through their own cache, the
    short ones in several small batches; the vectors are mlx-lm's still."""
    model, _ = load_reference("builtin:tiny")
    want = [_reference(model, ids, pooling) for ids in INPUTS]
    async with Runtime.open(_config(batch_tokens=16)) as rt:
        got, _ = await rt.embed(INPUTS, pooling=pooling)
    _assert_close(got, want)


async def test_texts_are_tokenized_as_a_completion_prompt_and_defaults_come_from_the_config():
    model, tokenizer = load_reference("builtin:tiny")
    texts = ["def parse(path):", "The quick brown fox", "x"]
    async with Runtime.open(_config(pooling="mean", normalize=False)) as rt:
        from_text, num_tokens = await rt.embed(texts)
        ids = [rt.tokenizer.encode(text) for text in texts]
        from_ids, _ = await rt.embed(ids, pooling="mean", normalize=False)
    assert from_text == from_ids
    assert num_tokens == sum(len(i) for i in ids) == sum(len(tokenizer.encode(t)) for t in texts)
    _assert_close(from_text, [_reference(model, i, "mean", normalize=False) for i in ids])


async def test_embedding_between_steps_leaves_decoding_streams_unchanged():
    """Two greedy streams decode while embedding calls run one after another; both streams are
    mlx-lm's tokens, and the calls' vectors are the ones computed with nothing else running."""
    model, tokenizer = load_reference("builtin:tiny")
    prompts = [_ids(12, 100), _ids(30, 101)]
    references = [greedy_tokens(model, tokenizer, prompt, 120) for prompt in prompts]
    async with Runtime.open(_config(batch_tokens=16)) as rt:
        alone, _ = await rt.embed(INPUTS)
        streamed: list[list[int]] = [[], []]
        during: list[list[list[float]]] = []
        first_token = anyio.Event()
        first_embedded = anyio.Event()
        finished = anyio.Event()
        ended_first: list[bool] = []

        async def consume(i: int) -> None:
            request = GenerateRequest(prompt_ids=prompts[i], max_tokens=120, sampling=SamplingParams(temperature=0.0))
            async for event in rt.generate(request):
                if isinstance(event, TokenDelta):
                    streamed[i] += event.token_ids
                    if i == 0 and not first_token.is_set():
                        first_token.set()
                        await first_embedded.wait()  # the request is live while the first call runs
                elif isinstance(event, Finished):
                    assert event.finish_reason in ("stop", "length")

        async def embed_meanwhile() -> None:
            await first_token.wait()
            while not finished.is_set():
                during.append((await rt.embed(INPUTS))[0])
                ended_first.append(finished.is_set())
                first_embedded.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(embed_meanwhile)
            async with anyio.create_task_group() as streams:
                streams.start_soon(consume, 0)
                streams.start_soon(consume, 1)
            finished.set()
    assert streamed == references
    assert during and not ended_first[0]
    for vectors in during:
        _assert_close(vectors, alone)


async def test_a_caller_that_leaves_stops_its_call_at_the_next_forward(monkeypatch):
    forwards: list[int] = []
    step = EmbedJob.step

    def counted(job: EmbedJob):
        forwards.append(len(job.inputs))
        return step(job)

    monkeypatch.setattr(EmbedJob, "step", counted)
    async with Runtime.open(_config(batch_tokens=16)) as rt:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rt.embed, [[1] * 16] * 200)  # 200 forwards
            await wait_until_async(lambda: len(forwards) >= 2)
            tg.cancel_scope.cancel()
            at_leaving = len(forwards)
        assert (await rt.embed([[1, 2]]))[1] == 2  # the model actor serves the next call
    # The forward in flight when the caller left, at most, then the next call's one forward.
    assert forwards[-1] == 1 and forwards[:-1] == [200] * len(forwards[:-1])
    assert at_leaving <= len(forwards) - 1 <= at_leaving + 1 < 200


async def test_bad_inputs_are_refused_naming_the_input():
    config = _config(max_inputs=3, max_tokens=60)
    config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, max_context=32))
    async with Runtime.open(config) as rt:
        vocab = rt.model_info.vocab_size
        cases: dict[str, tuple[type[Exception], object]] = {
            "input": (InvalidRequestError, []),
            "input[1]": (InvalidRequestError, ["a", ""]),
            "input[0]": (InvalidRequestError, [[1, vocab]]),
            "input[2]": (InvalidRequestError, [[1], [2], []]),
            "input ": (InvalidRequestError, [[1]] * 4),
            "input[1] ": (RequestTooLargeError, [[1], [1] * 33]),
            "input  ": (RequestTooLargeError, [[1] * 30, [1] * 30, [1] * 30]),
        }
        for field, (kind, inputs) in cases.items():
            with pytest.raises(kind) as caught:
                await rt.embed(inputs)  # type: ignore[arg-type]
            assert caught.value.field == field.strip(), (field, caught.value)
        with pytest.raises(InvalidRequestError) as caught:
            await rt.embed([[1]], pooling="max")  # type: ignore[arg-type]
        assert caught.value.field == "pooling"
        assert (await rt.embed([[1] * 32]))[1] == 32  # the context itself fits


def test_the_embeddings_section_is_checked():
    with pytest.raises(ConfigError, match="pooling"):
        RuntimeConfig.from_toml('[model]\npath = "builtin:tiny"\n[embeddings]\npooling = "max"\n')
    config = RuntimeConfig.from_toml('[model]\npath = "builtin:tiny"\n[embeddings]\npooling = "mean"\nnormalize = false\n')
    assert config.embeddings == EmbeddingsConfig(pooling="mean", normalize=False)
