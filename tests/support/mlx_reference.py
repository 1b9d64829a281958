"""mlx-lm's own greedy generation, the reference every parity test compares to."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.utils import load

from engine.builtin import builtin_name
from tests.support.config import builtin_dir


def load_reference(model: str):
    """mlx-lm's model (in float32) and tokenizer for a `builtin:` model."""
    model_obj, tokenizer = load(str(builtin_dir(builtin_name(model))))
    model_obj.set_dtype(mx.float32)
    return model_obj, tokenizer


def greedy_tokens(model, tokenizer, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Token ids `stream_generate` produces, without the EOS it stops on."""
    tokens = []
    for response in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens):
        if response.finish_reason == "stop":
            break
        tokens.append(response.token)
    return tokens


def greedy_steps(model, prompt: list[int], n: int, *, logits_processors=None) -> list[tuple[int, mx.array]]:
    """mlx-lm's first `n` greedy steps (`generate_step`, EOS or not): each token, with the
    log-probabilities it was chosen from; `logits_processors` as `generate_step` takes them."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=logits_processors)
    return [(int(token), logprobs) for token, logprobs in steps]


def greedy_ids(model, prompt: list[int], n: int, *, logits_processors=None) -> list[int]:
    """mlx-lm's first `n` greedy tokens, EOS or not (for requests without stops)."""
    return [token for token, _ in greedy_steps(model, prompt, n, logits_processors=logits_processors)]
