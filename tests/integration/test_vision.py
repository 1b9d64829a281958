"""Images in the prompt (vision-language models through mlx-vlm): greedy tokens equal mlx-vlm's
own `generate` alone, in a batch with text rows, and from a prefix-cache hit; the prefix cache
keys images by their digest; limits refuse what must be refused before it is decoded."""

from __future__ import annotations

import contextlib
import io

import anyio
import msgspec
import pytest
from PIL import Image

from engine.model.vision import VisionLanguageModel
from protocols import GenerateRequest, SamplingParams
from protocols.api import TokenDelta
from protocols.errors import InvalidRequestError, ModelLoadError, RequestTooLargeError
from runtime import Runtime
from runtime.config import KvConfig, LimitsConfig
from tests.support.config import make_config
from tests.support.events import Outcome, collect, collect_all
from tests.support.vision import QUESTION, VISION_MODEL, VISION_MODELS, VisionReference, data_url, image_message, png

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=VISION_MODELS)
def reference(request) -> VisionReference:
    return VisionReference(request.param)


def _request(messages: list[dict], **kw) -> GenerateRequest:
    return GenerateRequest(messages=messages, max_tokens=MAX_TOKENS, ignore_eos=True, sampling=GREEDY, **kw)


async def test_image_prompts_equal_mlx_vlm_and_repeat_from_the_prefix_cache(reference):
    # Prefill chunks of 16 tokens cut through the images' tokens (and Gemma 3's windows).
    async with Runtime.open(make_config(reference.name)) as rt:
        first = await collect(rt.generate(_request(image_message(png(0)))))
        other = await collect(rt.generate(_request(image_message(png(1)))))
        again = await collect(rt.generate(_request(image_message(data_url(png(0))))))
    prompt_tokens = first.last.usage.prompt_tokens
    assert first.tokens == reference.greedy(image_message(png(0)), [png(0)], MAX_TOKENS)
    assert other.tokens == reference.greedy(image_message(png(1)), [png(1)], MAX_TOKENS)
    assert first.tokens != other.tokens  # the image is read (random weights still tell them apart)
    # Another image, the same text: at most the text before the image is shared (none where
    # sliding windows keep entries whole).
    ids = reference.prompt_ids(image_message(png(1)), [png(1)])
    first_image = ids.index(reference.image_token_id)
    assert other.last.usage.cached_tokens <= first_image
    assert other.last.usage.cached_tokens > 0 or reference.name != VISION_MODEL
    # The same image again (sent as a data: URL this time): the whole prompt from the cache.
    assert again.last.usage.cached_tokens == prompt_tokens - 1
    assert again.tokens == first.tokens


async def test_image_rows_decode_in_one_batch_with_text_rows(reference, monkeypatch):
    texts = [[{"role": "user", "content": f"Tell me about item {i}."}] for i in range(6)]
    images = [png(2), png(3, 84, 70)]  # two sizes: two token counts (and two mRoPE shifts)
    long = {"max_tokens": 3 * MAX_TOKENS}  # text rows still decode when the image rows join
    requests = [
        _request(image_message(images[0])),
        *(GenerateRequest(messages=m, ignore_eos=True, sampling=GREEDY, **long) for m in texts[:3]),
        _request(image_message(images[1])),
        *(GenerateRequest(messages=m, ignore_eos=True, sampling=GREEDY, **long) for m in texts[3:]),
    ]
    rows = []
    original = VisionLanguageModel.__call__

    def counting(self, inputs, cache=None, **kw):
        if kw.get("input_embeddings") is None and inputs.shape[1] == 1:
            rows.append(inputs.shape[0])
        return original(self, inputs, cache=cache, **kw)

    monkeypatch.setattr(VisionLanguageModel, "__call__", counting)
    async with Runtime.open(make_config(reference.name, max_batch_size=8)) as rt:
        outcomes = await collect_all(rt.generate, requests)
    assert max(rows) == 8  # every row in one decode step
    assert outcomes[0].tokens == reference.greedy(image_message(images[0]), [images[0]], MAX_TOKENS)
    assert outcomes[4].tokens == reference.greedy(image_message(images[1]), [images[1]], MAX_TOKENS)
    for i, messages in zip([1, 2, 3, 5, 6, 7], texts):
        assert outcomes[i].tokens == reference.greedy(messages, [], 3 * MAX_TOKENS)


async def test_the_vision_tower_runs_in_units_while_text_rows_decode(reference, monkeypatch):
    # One-token chunks: each tower unit is one stage of this tiny tower (an encoder layer's attention, or the rest of the layer).
    from engine.engine import Engine
    from engine.model.vision import TowerRun

    events: list[tuple[str, list[str]]] = []
    advance, decode = TowerRun.advance, Engine._decode
    monkeypatch.setattr(TowerRun, "advance", lambda self, budget: events.append(("unit", [])) or advance(self, budget))

    def decoding(self):
        outputs = decode(self)
        events.append(("decode", [o.request_id for o in outputs if o.token_ids]))
        return outputs

    monkeypatch.setattr(Engine, "_decode", decoding)
    text = [{"role": "user", "content": "Tell me about item 1."}]
    image = png(4)
    async with Runtime.open(make_config(reference.name, prefill_chunk_size=1)) as rt:
        text_request = GenerateRequest(messages=text, max_tokens=200, ignore_eos=True, sampling=GREEDY, request_id="text")
        text_outcome = Outcome()
        async with anyio.create_task_group() as tg:
            events_stream = rt.generate(text_request)
            first = await anext(aiter(events_stream))  # the text row is decoding
            tg.start_soon(_rest, events_stream, text_outcome)
            with anyio.fail_after(300):
                image_outcome = await collect(rt.generate(_request(image_message(image))))
            await rt.cancel("text")
    units = [i for i, (kind, _) in enumerate(events) if kind == "unit"]
    assert len(units) >= 2  # the tower ran in several units ...
    between = [rows for kind, rows in events[units[0] : units[-1]] if kind == "decode"]
    assert sum("text" in rows for rows in between) >= len(units) - 1  # ... with the text row decoding between them
    assert image_outcome.tokens == reference.greedy(image_message(image), [image], MAX_TOKENS)
    assert [*first.token_ids, *text_outcome.tokens][:MAX_TOKENS] == reference.greedy(text, [], MAX_TOKENS)


async def test_cancelling_an_image_request_between_tower_units_frees_it(reference, monkeypatch):
    import time

    from engine.model.vision import TowerRun
    from engine.prefill import prefill_one
    from protocols.api import Finished, PrefillProgress

    units, chunks = [], []
    advance = TowerRun.advance

    def slow(self, budget):
        units.append(budget)
        time.sleep(0.3)  # (the MLX thread) time for the cancel to arrive while units remain
        return advance(self, budget)

    monkeypatch.setattr(TowerRun, "advance", slow)
    monkeypatch.setattr("engine.engine.prefill_one", lambda model, layout, seq, n: chunks.append(seq.request_id) or prefill_one(model, layout, seq, n))
    image = png(5)
    async with Runtime.open(make_config(reference.name, prefill_chunk_size=1)) as rt:
        victim = _request(image_message(image), request_id="victim", report_progress=True)
        finished = None
        async for event in rt.generate(victim):
            if isinstance(event, PrefillProgress) and finished is None:
                await rt.cancel("victim")
            elif isinstance(event, Finished):
                finished = event
        with anyio.fail_after(10):
            while (stats := await rt.stats()).live_requests or stats.kv.live_tokens:
                await anyio.sleep(0.01)
        monkeypatch.setattr(TowerRun, "advance", advance)
        after = await collect(rt.generate(_request(image_message(image))))
    assert finished is not None and finished.finish_reason == "cancelled"
    assert "victim" not in chunks  # it ended in its tower: no prompt chunk ran
    assert after.tokens == reference.greedy(image_message(image), [image], MAX_TOKENS)
    assert after.last.usage.cached_tokens == 0  # nothing of the cancelled tower was kept


async def _rest(events, outcome: Outcome) -> None:
    with contextlib.suppress(Exception):
        async for event in events:
            if isinstance(event, TokenDelta):
                outcome.tokens += event.token_ids


@pytest.fixture(scope="module")
async def vision_runtime():
    limits = LimitsConfig(max_images=2, max_image_bytes=400_000, max_image_pixels=1_000_000)
    config = make_config(VISION_MODEL)
    async with Runtime.open(msgspec.structs.replace(config, limits=limits)) as rt:
        yield rt


def _solid_png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG", optimize=True)
    return out.getvalue()


async def _refusal(rt: Runtime, messages: list[dict]) -> Exception:
    with pytest.raises((InvalidRequestError,)) as caught:
        await collect(rt.generate(_request(messages)))
    return caught.value


async def test_a_decompression_bomb_is_refused_before_it_is_decoded(vision_runtime, monkeypatch):
    bomb, small = _solid_png(2000, 1000), _solid_png(40, 30)  # 2,000,000 pixels in a few KB
    assert len(bomb) < 20_000
    decoded = []
    original = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self.size) or original(self))
    error = await _refusal(vision_runtime, image_message(bomb))
    assert isinstance(error, RequestTooLargeError) and "max_image_pixels" in str(error)
    assert decoded == []  # refused from the header
    # A small image of the same kind is decoded and served.
    outcome = await collect(vision_runtime.generate(_request(image_message(small))))
    assert len(outcome.tokens) == MAX_TOKENS and decoded


@pytest.mark.parametrize(
    ("image", "error", "words"),
    [
        ("https://example.com/cat.png", InvalidRequestError, "remote image URLs"),
        ("data:text/plain;base64,aGVsbG8=", InvalidRequestError, "data:image"),
        ("not base64 !!", InvalidRequestError, "base64"),
        (b"GIF89a but not really", InvalidRequestError, "readable"),
        (b"\x89PNG" + bytes(500_000), RequestTooLargeError, "max_image_bytes"),
        (png(0)[:200], InvalidRequestError, "decoded"),
    ],
)
async def test_bad_images_get_typed_errors_and_the_runtime_goes_on(vision_runtime, image, error, words):
    refused = await _refusal(vision_runtime, image_message(image))
    assert isinstance(refused, error) and words in str(refused) and refused.field == "messages"
    assert len((await collect(vision_runtime.generate(_request(image_message(png(5)))))).tokens) == MAX_TOKENS


async def test_more_images_than_the_limit_are_refused(vision_runtime):
    three = [{"role": "user", "content": [*({"type": "image", "image": png(i)} for i in range(3)), {"type": "text", "text": QUESTION}]}]
    assert "max_images" in str(await _refusal(vision_runtime, three))


async def test_a_text_model_refuses_images():
    async with Runtime.open(make_config()) as rt:
        refused = await _refusal(rt, image_message(png(0)))
        assert "not a vision-language model" in str(refused)
        assert len((await collect(rt.generate(GenerateRequest(prompt="Hello", max_tokens=3)))).tokens) == 3


async def test_quantized_or_paged_kv_is_refused_for_a_vision_model():
    for kv in (KvConfig(bits=8), KvConfig(block_size=16)):
        with pytest.raises(ModelLoadError, match="vision-language"):
            async with Runtime.open(msgspec.structs.replace(make_config(VISION_MODEL), kv=kv)):
                pass


@pytest.mark.server
async def test_an_image_over_the_socket_as_bytes_gets_the_in_process_tokens(tmp_path):
    import anyio

    from net.client import Client
    from net.server import Server
    from runtime.config import ServerConfig

    path = tmp_path / "mlxrt.sock"
    async with Runtime.open(make_config(VISION_MODEL)) as rt, anyio.create_task_group() as tg:
        server = Server(rt, ServerConfig(), path)
        await tg.start(server.serve)
        try:
            local = await collect(rt.generate(_request(image_message(png(9)))))
            async with Client.connect(path) as client:
                remote = await collect(client.generate(_request(image_message(png(9)))))
        finally:
            server.stop()
    assert remote.tokens == local.tokens and remote.last.usage.cached_tokens == local.last.usage.prompt_tokens - 1


async def test_a_follow_up_turn_reuses_the_images_kv_without_encoding_it_again(reference, monkeypatch):
    encoded = []
    original = VisionLanguageModel.embed_prompt
    monkeypatch.setattr(VisionLanguageModel, "embed_prompt", lambda self, ids, arrays: encoded.append(len(ids)) or original(self, ids, arrays))
    image = png(11)
    async with Runtime.open(make_config(reference.name)) as rt:
        assert len(encoded) == 1  # the load's warm-up: the tower's kernels compile before ready
        encoded.clear()
        first = await collect(rt.generate(_request(image_message(image))))
        turn = [*image_message(image), {"role": "assistant", "content": first.text}, {"role": "user", "content": "And the colours?"}]
        second = await collect(rt.generate(_request(turn)))
    assert len(encoded) == 1  # the second turn's prompt starts from the first turn's KV, image included
    assert second.last.usage.cached_tokens >= first.last.usage.prompt_tokens - 1
    assert second.tokens == reference.greedy(turn, [image], MAX_TOKENS)


async def test_an_image_request_resumes_from_its_checkpoint_exactly(tmp_path, reference):
    from runtime import checkpoints
    from runtime.config import CheckpointConfig

    config = msgspec.structs.replace(make_config(reference.name), checkpoints=CheckpointConfig(dir=str(tmp_path)))
    image, long = png(12), 60
    request = GenerateRequest(messages=image_message(image), max_tokens=long, ignore_eos=True, sampling=GREEDY, request_id="img", checkpoint_every=8)
    async with Runtime.open(config) as rt:
        stream = rt.generate(request).__aiter__()
        seen = []
        while len(seen) < 20 or not checkpoints.path_for(tmp_path, "img").exists():
            event = await stream.__anext__()
            seen += getattr(event, "token_ids", [])
    raw = checkpoints.path_for(tmp_path, "img").read_bytes()
    assert image not in raw and len(raw) < 10 * len(image) + 200_000  # the digest is kept, not the image
    async with Runtime.open(config) as rt:
        resumed = await collect(rt.resume("img"))
        again = await collect(rt.generate(_request(image_message(image))))
    assert resumed.tokens == reference.greedy(image_message(image), [image], long)
    assert resumed.last.finish_reason == "length"
    # The resumed request's prefix is keyed by its images: the same image and text hit it (where
    # entries can be cut back: sliding windows keep them whole, at the resumed request's end).
    if reference.name == VISION_MODEL:
        assert again.last.usage.cached_tokens == again.last.usage.prompt_tokens - 1
    assert again.tokens == reference.greedy(image_message(image), [image], MAX_TOKENS)
