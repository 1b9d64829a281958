"""lm-eval-harness (`local-completions`) against the HTTP server, as its users run it: the
multiple-choice loglikelihoods it reads from `echo` + `logprobs` equal mlx-lm's own forward over
the same tokens, with its tokenizer (token-id prompts, batched) and with ours (text prompts, the
`/tokenize` routes); a generate_until task runs to its stop string. No network: the tasks are in
tests/data/lm_eval."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import mlx.core as mx
import pytest

from tests.support.config import builtin_dir
from tests.support.http_serving import serving
from tests.support.mlx_reference import load_reference

pytestmark = [pytest.mark.server, pytest.mark.slow]

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
CHOICE_TASK = """task: mlxrt_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/tiny_choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GENERATE_TASK = """task: mlxrt_tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/tiny_generate.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _evaluate(tasks_dir: Path, task: str, model_args: dict) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        limit=None,
    )


def _reference_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, list[int]]:
    """mlx-lm's log-probability of the continuation's tokens after the context's, split as lm-eval
    splits a causal pair (the whole encoded, the context's tokens first)."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = len(tokenizer.encode(context, add_special_tokens=False))
    logits = model(mx.array(whole)[None])[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sum(lp[i - 1, whole[i]].item() for i in range(ctx, len(whole))), whole


@pytest.mark.parametrize("tokenized", [pytest.param(True, id="token-ids", marks=pytest.mark.exhaustive), pytest.param(False, id="text")])
async def test_lm_eval_multiple_choice_loglikelihoods_equal_mlx_lms_forward(tmp_path, monkeypatch, tokenized):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "choice.yaml").write_text(CHOICE_TASK.format(data=DATA))
    model, _ = load_reference("builtin:tiny")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(builtin_dir("tiny")))
    async with serving() as served:
        args = {"model": served.model, "base_url": f"{served.url}/v1/completions", "num_concurrent": 1, "max_retries": 1, "tokenized_requests": tokenized}
        if tokenized:  # lm-eval's own tokenizer, 4 prompts per request
            args |= {"tokenizer_backend": "huggingface", "tokenizer": str(builtin_dir("tiny")), "batch_size": 4}
        else:  # the server's (its /tokenize routes)
            args |= {"tokenizer_backend": "remote", "batch_size": 1}
        results = await anyio.to_thread.run_sync(lambda: _evaluate(tmp_path, "mlxrt_tiny_choice", args))
    samples = results["samples"]["mlxrt_tiny_choice"]
    assert len(samples) == 20
    accuracy = results["results"]["mlxrt_tiny_choice"]["acc,none"]
    assert accuracy == pytest.approx(sum(s["acc"] for s in samples) / 20)
    for sample in samples:
        for (context, continuation), (loglikelihood, _) in zip(sample["arguments"], [r[0] for r in sample["resps"]]):
            want, _ = _reference_loglikelihood(model, hf, context, continuation)
            assert loglikelihood == pytest.approx(want, abs=1e-4), (context, continuation)


async def test_lm_eval_generate_until_stops_at_its_stop_string(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "generate.yaml").write_text(GENERATE_TASK.format(data=DATA))
    async with serving() as served:
        args = {"model": served.model, "base_url": f"{served.url}/v1/completions", "num_concurrent": 1, "max_retries": 1, "tokenizer_backend": "remote"}
        results = await anyio.to_thread.run_sync(lambda: _evaluate(tmp_path, "mlxrt_tiny_generate", args))
        client = served.client()
        direct = []
        for line in (DATA / "tiny_generate.jsonl").read_text().splitlines():
            question = json.loads(line)["question"]
            answer = await client.completions.create(model=served.model, prompt=question, max_tokens=8, temperature=0, stop=["\n"])
            direct.append(answer.choices[0].text)
        await client.close()
    samples = results["samples"]["mlxrt_tiny_generate"]
    assert [s["resps"][0][0] for s in samples] == direct
    assert all("\n" not in text for text in direct)
