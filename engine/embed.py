"""Embeddings (MLX thread): the model's final hidden states, pooled per input.

The hidden states are what the model's body returns: the model without its LM head (mlx-lm's
`model.model(inputs)` for llama-like families, the normed states the head would project). The
body is found generically (`find_body`: through `language_model` wrappers, then the child named
`model`, `transformer` or `backbone`, called with `cache=None` as mlx-lm's models call it) and
checked once when the model loads (`Embedder`): it must return `[batch, length, width]` states that are not the logits, and its first position
must not see later ones (a body that needs a mask its model builds around it is refused). A
model whose body cannot be found or fails a check refuses embeddings with the reason, typed.

A call (`EmbedJob`) is split into forwards of at most `batch_tokens` tokens, run one at a time
so the model actor can put engine steps between them: inputs sorted by length and batched
right-padded (causal attention: a row's real positions never see its padding; `last` takes each
row's last real position, `mean` averages its real positions only), and an input longer than
`batch_tokens` forwarded in chunks through a fresh cache of its own (if the body takes one;
otherwise whole). Pooling and L2 normalization are in float32; vectors come back as plain lists.
Nothing here touches a request's KV or the engine's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx_lm.models.cache import make_prompt_cache

from engine import lanes
from protocols.config import Pooling
from protocols.errors import InvalidRequestError

log = structlog.get_logger(actor="engine")

# Where a model keeps its body: wrappers (vision-language models) first, then the body itself.
WRAPPERS = ("language_model",)
BODY_NAMES = ("model", "transformer", "backbone")
# Rows in one batched forward, whatever their length.
MAX_ROWS = 64
# Relative difference the checks allow (a float32 body agrees to ~1e-7; 16-bit ones less closely).
TOLERANCE = 1e-3
LOOSE_TOLERANCE = 5e-2


@dataclass(frozen=True)
class Body:
    """A model's body: the module, where it is (`language_model.model`), the width of its
    states, and whether it takes a cache (long inputs in chunks)."""

    module: nn.Module
    path: str
    width: int
    chunked: bool


def _child(module: nn.Module, name: str) -> nn.Module | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Module) else None


def find_body(model: nn.Module) -> tuple[nn.Module, str] | str:
    """The module that returns the final hidden states, and its path; or why none was found."""
    module, path = model, []
    for _ in range(4):  # wrappers nest a few levels at most
        wrapped = next(((name, child) for name in WRAPPERS if (child := _child(module, name)) is not None), None)
        if wrapped is None:
            break
        path.append(wrapped[0])
        module = wrapped[1]
    for name in BODY_NAMES:
        body = _child(module, name)
        if body is not None:
            return body, ".".join([*path, name])
    where = ".".join(path) or type(model).__name__
    return f"{where} has no child named {', '.join(BODY_NAMES)} (the model without its LM head)"


def _differs(a: mx.array, b: mx.array, tolerance: float) -> bool:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    scale = mx.maximum(mx.sqrt((a * a).sum()), mx.array(1e-6))
    return bool((mx.sqrt(((a - b) ** 2).sum()) / scale > tolerance).item())


def probe_body(model: nn.Module, vocab_size: int) -> Body | str:
    """The model's body, checked on a few tokens; or why embeddings are refused."""
    found = find_body(model)
    if isinstance(found, str):
        return found
    body, path = found
    tokens = [t % max(vocab_size, 1) for t in (1, 2, 3)]
    try:
        whole = body(mx.array([tokens]), cache=None)
        first = body(mx.array(tokens[:1])[None], cache=None)
    except Exception as exc:
        return f"calling {path} alone failed: {type(exc).__name__}: {exc}"
    if not isinstance(whole, mx.array) or whole.ndim != 3 or tuple(whole.shape[:2]) != (1, 3):
        return f"{path} does not return [batch, length, width] hidden states"
    width = int(whole.shape[-1])
    if width == vocab_size:
        return f"{path} returns the logits (width {width}, the vocabulary's), not hidden states"
    if not bool(mx.isfinite(whole).all().item()):
        return f"{path} returns values that are not finite"
    tolerance = TOLERANCE if whole.dtype == mx.float32 else LOOSE_TOLERANCE
    if _differs(whole[0, 0], first[0, 0], tolerance):
        return f"{path} alone lets a position see later ones (its model builds the causal mask around it)"
    return Body(module=body, path=path, width=width, chunked=_takes_cache(model, body, tokens, whole, tolerance))


def _takes_cache(model: nn.Module, body: nn.Module, tokens: list[int], whole: mx.array, tolerance: float) -> bool:
    """Whether the body continues through a cache exactly as one forward does."""
    try:
        cache = make_prompt_cache(model)
        body(mx.array([tokens[:2]]), cache=cache)
        rest = body(mx.array([tokens[2:]]), cache=cache)
        return not _differs(rest[0, -1], whole[0, -1], tolerance)
    except Exception:
        return False


class Embedder:
    """Embeddings of one loaded model (built on the MLX thread once it is loaded)."""

    def __init__(self, model: nn.Module, vocab_size: int):
        self._model = model
        probed = probe_body(model, vocab_size)
        self.body: Body | None = probed if isinstance(probed, Body) else None
        self.refused = probed if isinstance(probed, str) else ""
        if self.body is None:
            log.info("embeddings_unavailable", reason=self.refused)

    @property
    def width(self) -> int:
        """The embeddings' width (0: refused)."""
        return self.body.width if self.body is not None else 0

    def job(self, inputs: list[list[int]], pooling: Pooling, normalize: bool, batch_tokens: int) -> EmbedJob:
        if self.body is None:
            raise InvalidRequestError(f"this model serves no embeddings: {self.refused}", field="model")
        return EmbedJob(self._model, self.body, inputs, pooling, normalize, batch_tokens)

    def embed(self, inputs: list[list[int]], pooling: Pooling = "last", normalize: bool = True, batch_tokens: int = 1024) -> list[list[float]]:
        """A whole call at once."""
        job = self.job(inputs, pooling, normalize, batch_tokens)
        while (vectors := job.step()) is None:
            pass
        return vectors


@dataclass(frozen=True)
class Batch:
    """Whole inputs in one right-padded forward."""

    rows: list[int]


@dataclass(frozen=True)
class Chunk:
    """Positions `start`..`end` of one long input, through its own cache."""

    row: int
    start: int
    end: int


def plan_forwards(lengths: list[int], batch_tokens: int, chunked: bool) -> list[Batch | Chunk]:
    """Inputs sorted by length, batched while rows x the longest stay within `batch_tokens`
    (and `MAX_ROWS`); a longer input alone, in chunks when the body takes a cache."""
    forwards: list[Batch | Chunk] = []
    group: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = lengths[row]
        if n > batch_tokens and chunked:
            forwards += [Chunk(row, start, min(start + batch_tokens, n)) for start in range(0, n, batch_tokens)]
            continue
        if group and ((len(group) + 1) * n > batch_tokens or len(group) >= MAX_ROWS):
            forwards.append(Batch(group))
            group = []
        group.append(row)
    if group:
        forwards.append(Batch(group))
    return forwards


@dataclass
class _Long:
    """A long input's state between its chunks."""

    cache: list
    total: mx.array
    last: mx.array | None = None


@dataclass
class EmbedJob:
    """One call's forwards, run one per `step` (MLX thread only)."""

    model: nn.Module
    body: Body
    inputs: list[list[int]]
    pooling: Pooling
    normalize: bool
    batch_tokens: int
    _vectors: list[list[float] | None] = field(init=False)
    _forwards: list[Batch | Chunk] = field(init=False)
    _long: _Long | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.inputs or any(not ids for ids in self.inputs):
            raise InvalidRequestError("every input needs at least one token", field="input")
        self._vectors = [None] * len(self.inputs)
        self._forwards = plan_forwards([len(ids) for ids in self.inputs], self.batch_tokens, self.body.chunked)[::-1]

    def step(self) -> list[list[float]] | None:
        """Run the next forward; every input's vector, in order, once the last one ran. (With
        the engine's kernels, as its steps run: without them a CPU model whose quantized weights
        the kernels keep would multiply through MLX's own quantized product, ~35x slower at
        many rows: a forward of 1,024 tokens of SmolLM2 held the MLX thread ~100 s.)"""
        if self._forwards:
            forward = self._forwards.pop()
            with lanes.parallel():
                if isinstance(forward, Batch):
                    self._batch(forward.rows)
                else:
                    self._chunk(forward)
        if self._forwards:
            return None
        assert all(v is not None for v in self._vectors)
        return [v for v in self._vectors if v is not None]

    def close(self) -> None:
        """Drop what a long input holds (a call abandoned between its chunks)."""
        self._long = None
        self._forwards = []

    def _batch(self, rows: list[int]) -> None:
        lengths = [len(self.inputs[row]) for row in rows]
        width = max(lengths)
        tokens = mx.array([self.inputs[row] + [0] * (width - n) for row, n in zip(rows, lengths)])
        states = self.body.module(tokens, cache=None).astype(mx.float32)
        ends = mx.array(lengths)
        if self.pooling == "last":
            pooled = states[mx.arange(len(rows)), ends - 1]
        else:
            real = (mx.arange(width)[None, :] < ends[:, None])[..., None]
            pooled = mx.where(real, states, 0.0).sum(axis=1) / ends[:, None].astype(mx.float32)
        for row, vector in zip(rows, self._finish(pooled)):
            self._vectors[row] = vector

    def _chunk(self, chunk: Chunk) -> None:
        if chunk.start == 0:
            self._long = _Long(cache=make_prompt_cache(self.model), total=mx.zeros((self.body.width,), dtype=mx.float32))
        long = self._long
        assert long is not None
        tokens = mx.array(self.inputs[chunk.row][chunk.start : chunk.end])[None]
        states = self.body.module(tokens, cache=long.cache).astype(mx.float32)[0]
        long.total = long.total + states.sum(axis=0)
        long.last = states[-1]
        mx.eval(long.total, long.last, [c.state for c in long.cache])
        n = len(self.inputs[chunk.row])
        if chunk.end < n:
            return
        pooled = long.last if self.pooling == "last" else long.total / n
        self._vectors[chunk.row] = self._finish(pooled[None])[0]
        self._long = None

    def _finish(self, pooled: mx.array) -> list[list[float]]:
        """Pooled rows normalized (if asked), as plain lists."""
        if self.normalize:
            pooled = pooled / mx.maximum(mx.sqrt((pooled * pooled).sum(axis=-1, keepdims=True)), 1e-12)
        return cast(list[list[float]], pooled.tolist())
