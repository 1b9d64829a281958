"""The denoising engine driven plan by plan: canvases of the same length step in one batched
decoder forward, and each request's tokens are still mlx-vlm's `stream_diffusion_generate`'s."""

from __future__ import annotations

import pytest

from engine.denoise import DenoiseEngine
from protocols.api import DenoisingOptions, SamplingParams
from protocols.model import AdmitRequest, PrefillWork, StepPlan
from tests.support.diffusion import DiffusionReference


@pytest.fixture(scope="module")
def reference() -> DiffusionReference:
    return DiffusionReference()


class _Forwards:
    """The batch size of each decoder forward the engine runs (a spy on the model's method)."""

    def __init__(self, model) -> None:
        self.sizes: list[int] = []
        self._model, self._method = model, model.diffusion_decoder_logits

    def __enter__(self) -> _Forwards:
        def spy(canvas, *args, **kwargs):
            self.sizes.append(canvas.shape[0])
            return self._method(canvas, *args, **kwargs)

        self._model.diffusion_decoder_logits = spy
        return self

    def __exit__(self, *exc) -> None:
        del self._model.diffusion_decoder_logits


def _admit(rid: str, prompt: list[int], max_tokens: int, seed: int, temperature: float, **options) -> AdmitRequest:
    return AdmitRequest(
        request_id=rid,
        prompt_ids=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, seed=seed),
        seed=seed,
        stop_token_ids=[],
        save_prefix=False,
        denoise=DenoisingOptions(**options),
    )


def _run(engine: DenoiseEngine, admits: list[AdmitRequest], *, start_after: dict[str, int]) -> dict[str, list[int]]:
    """Every request denoised to its end, all stepping in each plan; a request in
    `start_after` joins only after that many plans (mid-canvas of the others)."""
    tokens: dict[str, list[int]] = {a.request_id: [] for a in admits}
    running: set[str] = set()
    for plan_index in range(400):
        joining = [a for a in admits if a.request_id not in running and start_after.get(a.request_id, 0) <= plan_index and not tokens[a.request_id]]
        if joining:
            engine.step(StepPlan(admit=joining, prefill=[PrefillWork(request_id=a.request_id, num_tokens=len(a.prompt_ids)) for a in joining]))
            running |= {a.request_id for a in joining}
        if not running and all(tokens.values()):
            return tokens
        outcome = engine.step(StepPlan(denoise=sorted(running)))
        for row in outcome.outputs:
            tokens[row.request_id] += row.token_ids
            if row.finish_reason is not None:
                running.discard(row.request_id)
    raise AssertionError("the requests did not end")


def test_canvases_of_one_length_step_in_one_forward_and_equal_mlx_vlms_loop(reference):
    prompts = [reference.prompt_ids([{"role": "user", "content": f"Story {i}:" + " about the sea" * (i + 1)}]) for i in range(4)]
    assert len({len(p) for p in prompts}) == 4  # encoder caches of different lengths
    cases = [(40, 1, 0.0, {}), (33, 2, 0.7, {}), (24, 3, 1.0, {"max_steps": 5}), (20, 4, 0.0, {})]
    expected = {
        f"r{i}": reference.generate(p, n, seed=seed, temperature=t, **({"max_denoising_steps": o["max_steps"]} if o else {}))
        for i, (p, (n, seed, t, o)) in enumerate(zip(prompts, cases))
    }
    admits = [_admit(f"r{i}", p, n, seed, t, **o) for i, (p, (n, seed, t, o)) in enumerate(zip(prompts, cases))]
    engine = DenoiseEngine(reference.model)
    with _Forwards(reference.model) as forwards:
        # r3 joins after 3 plans: its canvas starts while the others' are mid-denoise.
        got = _run(engine, admits, start_after={"r3": 3})
    assert got == expected
    assert max(forwards.sizes) == 4, forwards.sizes  # all four canvases in one forward
    assert engine.kv_tokens() == {} and engine.kv_bytes() == 0


@pytest.mark.slow
def test_a_batched_forward_is_bitwise_each_rows_own_on_the_bench_model():
    """On the 63M bench model (widths where BLAS picks its kernels by shape: a router's matmul
    over 3 rows' tokens rounds differently from one row's), each row's logits from the batched
    forward equal mlx-vlm's forward of that row alone, bit for bit."""
    import mlx.core as mx

    bench = DiffusionReference("builtin:bench-diffusion-gemma")
    engine = DenoiseEngine(bench.model)
    rows = []
    for i in range(3):
        prompt = bench.prompt_ids([{"role": "user", "content": f"Story {i} about the sea" + " and the wind" * i}])
        engine.step(StepPlan(admit=[_admit(f"r{i}", prompt, 64, i, 0.0)], prefill=[PrefillWork(request_id=f"r{i}", num_tokens=len(prompt))]))
        row = engine._rows[f"r{i}"]
        row.canvas = engine._start_canvas(row)
        rows.append(row)
    alone = [engine._forward([row])[0] for row in rows]
    together = engine._forward(rows)
    if _blas_rounds_alike_at_any_height():
        assert all(mx.array_equal(a, b).item() for a, b in zip(alone, together))
    else:  # this CPU's BLAS kernels round by matrix height: the same tokens, logits within rounding
        assert all(mx.array_equal(a.argmax(-1), b.argmax(-1)).item() for a, b in zip(alone, together))
        assert all(mx.allclose(a, b, atol=1e-3, rtol=1e-4).item() for a, b in zip(alone, together))


def _blas_rounds_alike_at_any_height() -> bool:
    """Whether a matmul's first 64 rows equal those rows' own matmul bit for bit here (OpenBLAS
    on AVX-512 machines: yes; its AVX2 kernels split by height and round differently: no)."""
    import mlx.core as mx

    x, w = mx.random.normal((192, 512), key=mx.random.key(0)), mx.random.normal((512, 512), key=mx.random.key(1))
    return bool(mx.array_equal((x @ w)[:64], x[:64] @ w).item())
