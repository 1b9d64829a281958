"""`engine.embed` on its own: how a call's inputs become forwards, and the models whose body is
refused (with the reason) rather than returning something that is not their hidden states."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine import lanes
from engine.embed import Batch, Chunk, Embedder, find_body, plan_forwards
from protocols.errors import InvalidRequestError

VOCAB = 32
WIDTH = 8


def test_inputs_are_batched_by_length_within_the_token_budget():
    lengths = [5, 3, 40, 4, 3, 16]
    forwards = plan_forwards(lengths, 16, chunked=True)
    batches = [f.rows for f in forwards if isinstance(f, Batch)]
    chunks = [(f.row, f.start, f.end) for f in forwards if isinstance(f, Chunk)]
    assert chunks == [(2, 0, 16), (2, 16, 32), (2, 32, 40)]
    assert sorted(row for rows in batches for row in rows) == [0, 1, 3, 4, 5]
    for rows in batches:
        assert len(rows) * max(lengths[r] for r in rows) <= 16
    # Without a cache, a long input is one forward of its own.
    assert Batch([2]) in plan_forwards(lengths, 16, chunked=False)
    assert len(plan_forwards([1] * 200, 1024, chunked=True)) == 4  # at most 64 rows a forward


class Stack(nn.Module):
    """A causal toy body: embeddings, then each position the mean of those up to it."""

    def __init__(self, causal: bool = True, logits: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB) if logits else None
        self.causal = causal

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        n = h.shape[1]
        weights = mx.tril(mx.ones((n, n))) if self.causal else mx.ones((n, n))
        h = (weights / weights.sum(axis=-1, keepdims=True)) @ h
        return self.head(h) if self.head is not None else h


class Lm(nn.Module):
    def __init__(self, body: nn.Module | None, attribute: str = "model"):
        super().__init__()
        if body is not None:
            setattr(self, attribute, body)

    @property
    def layers(self):
        return []


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.language_model = inner


def test_the_body_is_found_through_wrappers_and_by_its_names():
    body = Stack()
    assert find_body(Wrapper(Lm(body))) == (body, "language_model.model")
    assert find_body(Lm(body, "backbone")) == (body, "backbone")
    embedder = Embedder(Wrapper(Lm(body)), VOCAB)
    assert embedder.width == WIDTH and embedder.refused == ""
    assert embedder.body is not None and not embedder.body.chunked  # (this body ignores a cache)
    [vector] = embedder.embed([[1, 2, 3]], "mean", normalize=False)
    assert vector == pytest.approx(body(mx.array([[1, 2, 3]]))[0].mean(axis=0).tolist(), abs=1e-6)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (Lm(None), "has no child named model, transformer, backbone"),
        (Lm(Stack(logits=True)), "returns the logits"),
        (Lm(Stack(causal=False)), "lets a position see later ones"),
    ],
)
def test_a_body_that_is_not_the_hidden_states_is_refused_with_the_reason(model, reason):
    embedder = Embedder(model, VOCAB)
    assert embedder.width == 0 and reason in embedder.refused
    with pytest.raises(InvalidRequestError, match=reason) as caught:
        embedder.embed([[1, 2]])
    assert caught.value.field == "model"


class Recording(Stack):
    """A Stack that notes whether each forward ran with the engine's kernels (`lanes.parallel`)."""

    def __init__(self):
        super().__init__()
        self.kernels: list[bool] = []

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        self.kernels.append(lanes.enabled())
        return super().__call__(inputs, cache)


def test_forwards_run_with_the_engines_kernels_as_its_steps_do():
    # (Outside them a CPU model whose quantized weights the kernels keep multiplies through MLX's
    # own quantized product: a 1,024-token forward of SmolLM2 held the MLX thread ~100 s.)
    body = Recording()
    embedder = Embedder(Lm(body), VOCAB)
    body.kernels.clear()  # (the probe's forwards at construction)
    embedder.embed([[1, 2, 3], [4, 5]])
    assert body.kernels and all(body.kernels) == (mx.default_device() == mx.cpu)
    assert not lanes.enabled()  # (and not past the forward)
