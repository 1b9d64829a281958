"""Vectorized per-row sampling for the decode batch, on device.

Each row carries its own temperature, top-p, top-k, min-p, penalties, seed and
logprob requests. Semantics follow mlx-lm's `make_sampler` and
`make_logits_processors` (penalties over the last `penalty_context_size` tokens,
prompt included; filters applied to log-probabilities at temperature 1; then a
Gumbel-max draw at the row's temperature), but one batch is one set of array
ops instead of a Python loop over rows. Random draws are keyed by
`(seed, tokens sampled so far)`, so a row's draws do not depend on which other
rows share its batch, and a resumed request can continue its sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
from xgrammar.kernels.apply_token_bitmask_mlx import apply_token_bitmask_mlx

from protocols.api import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_key(seed: int, index: int) -> tuple[int, int]:
    """The PRNG key for a row's `index`-th sampled token."""
    h = _mix64(_mix64(seed & _MASK64) ^ index)
    return h >> 32, h & 0xFFFFFFFF


@dataclass
class RowSampling:
    """One row's sampling settings and counters (host side)."""

    params: SamplingParams
    seed: int
    logprobs: bool = False
    top_logprobs: int = 0
    num_sampled: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature == 0.0

    @property
    def has_penalty(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


@dataclass
class SampleResult:
    """Device arrays of one step; rows in batch order."""

    tokens: mx.array
    logprobs: mx.array | None = None
    top_ids: mx.array | None = None
    top_logprobs: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs) if a is not None]


class BatchSampler:
    """Samples one token per row from `[rows, vocab]` logits."""

    def __init__(self) -> None:
        self.rows: list[RowSampling] = []
        self._window: mx.array | None = None
        self._params: dict[str, mx.array] | None = None

    def add_row(self, row: RowSampling, context: list[int]) -> None:
        """Append a row; `context` is its token history so far (prompt, generated)."""
        self.rows.append(row)
        self._params = None
        if row.has_penalty or self._window is not None:
            self._rebuild_window(extra_context=context)

    def reorder(self, order: list[int]) -> None:
        """Keep rows `order` (old indices, in their new order)."""
        self.rows = [self.rows[i] for i in order]
        self._params = None
        if self._window is not None:
            self._window = self._window[mx.array(order, dtype=mx.int32)] if order else None
            if not any(r.has_penalty for r in self.rows):
                self._window = None

    def advance(self, appended: dict[int, list[int]]) -> None:
        """Rows `i` appended tokens they did not sample (forced, fast-forwarded): penalties
        count them, and draws stay keyed by the number of tokens generated."""
        for i, tokens in appended.items():
            self.rows[i].num_sampled += len(tokens)
        if self._window is None or not any(self.rows[i].has_penalty for i in appended):
            return
        width = self._window.shape[1]
        rows = []
        for i in range(len(self.rows)):
            tokens = appended.get(i, [])[-width:]
            row = self._window[i]
            rows.append(mx.concatenate([row[len(tokens) :], mx.array(tokens, dtype=mx.int32)]) if tokens else row)
        self._window = mx.stack(rows)

    def process(self, logits: mx.array) -> mx.array:
        """Logits after each row's penalties (mlx-lm's logits processors)."""
        logits = logits.astype(mx.float32)
        return self._apply_penalties(logits) if self._window is not None else logits

    def sample(self, logits: mx.array, mask: mx.array | None = None) -> SampleResult:
        """One token per row; `mask` is an xgrammar bitmask ([rows, ceil(vocab / 32)] int32)."""
        rows = self.rows
        logits = self.process(logits)
        if mask is not None:
            logits = apply_token_bitmask_mlx(mask, logits, logits.shape[-1])
        tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
        sampled = [i for i, r in enumerate(rows) if not r.is_greedy]
        if sampled:
            tokens = self._draw(logits, tokens, sampled)
        result = SampleResult(tokens=tokens)
        if any(r.wants_logprobs for r in rows):
            self._attach_logprobs(result, logits)
        if self._window is not None:
            self._window = mx.concatenate([self._window[:, 1:], tokens[:, None].astype(mx.int32)], axis=1)
        for r in rows:
            r.num_sampled += 1
        return result

    def _param(self, name: str) -> mx.array:
        if self._params is None:
            p = [r.params for r in self.rows]
            self._params = {
                "repetition": mx.array([x.repetition_penalty for x in p])[:, None],
                "presence": mx.array([x.presence_penalty for x in p])[:, None],
                "frequency": mx.array([x.frequency_penalty for x in p])[:, None],
                "context": mx.array([x.penalty_context_size if r.has_penalty else 0 for x, r in zip(p, self.rows)]),
            }
        return self._params[name]

    def _rebuild_window(self, extra_context: list[int]) -> None:
        """Recreate the penalty windows from host-side histories (rare: on joins)."""
        width = max([r.params.penalty_context_size for r in self.rows if r.has_penalty], default=1)
        old = None if self._window is None else self._window
        rows = []
        for i in range(len(self.rows)):
            if i == len(self.rows) - 1:
                tail = extra_context[-width:]
                rows.append(mx.array([-1] * (width - len(tail)) + tail, dtype=mx.int32))
            elif old is not None:
                have = old.shape[1]
                row = old[i, max(0, have - width) :]
                rows.append(mx.concatenate([mx.full((width - row.shape[0],), -1, mx.int32), row]))
            else:
                rows.append(mx.full((width,), -1, mx.int32))
        self._window = mx.stack(rows)

    def _apply_penalties(self, logits: mx.array) -> mx.array:
        window = self._window
        assert window is not None
        num_rows, width = window.shape
        age = mx.arange(width - 1, -1, -1, dtype=mx.int32)[None, :]
        valid = (window >= 0) & (age < self._param("context")[:, None])
        index = mx.where(valid, window, 0)
        row_index = mx.broadcast_to(mx.arange(num_rows, dtype=mx.int32)[:, None], index.shape)
        counts = mx.zeros(logits.shape, mx.float32).at[row_index, index].add(valid.astype(mx.float32))
        present = counts > 0
        rep = self._param("repetition")
        logits = mx.where(present, mx.where(logits < 0, logits * rep, logits / rep), logits)
        logits = logits - self._param("presence") * present
        return logits - self._param("frequency") * counts

    def _draw(self, logits: mx.array, tokens: mx.array, sampled: list[int]) -> mx.array:
        rows = [self.rows[i] for i in sampled]
        index = mx.array(sampled, dtype=mx.int32)
        sub = logits[index]
        lp = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
        lp = apply_filters(lp, [r.params for r in rows])
        keys = mx.array([draw_key(r.seed, r.num_sampled) for r in rows], dtype=mx.uint32)
        noise = mx.vmap(lambda k: mx.random.gumbel(shape=(lp.shape[-1],), key=k))(keys)
        inv_temp = mx.array([1.0 / r.params.temperature for r in rows])[:, None]
        drawn = mx.argmax(lp * inv_temp + noise, axis=-1).astype(mx.uint32)
        tokens[index] = drawn
        return tokens

    def _attach_logprobs(self, result: SampleResult, logits: mx.array) -> None:
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        result.logprobs = mx.take_along_axis(lp, result.tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
        k = max(r.top_logprobs for r in self.rows)
        if k > 0:
            top_ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
            result.top_ids = top_ids
            result.top_logprobs = mx.take_along_axis(lp, top_ids, axis=-1)


def apply_filters(lp: mx.array, params: list[SamplingParams]) -> mx.array:
    """top-p, min-p, top-k on log-probabilities, in mlx-lm's order, per row."""
    neg_inf = mx.array(-math.inf, lp.dtype)
    top_p = [p.top_p for p in params]
    if any(0.0 < p < 1.0 for p in top_p):
        p = mx.array(top_p)[:, None]
        sorted_lp = mx.sort(lp, axis=-1)
        sorted_probs = mx.exp(sorted_lp)
        mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
        total = mass_above[:, :1] + sorted_probs[:, :1]
        num_dropped = (mass_above >= p * total).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(sorted_lp, num_dropped, axis=-1)
        active = mx.array([0.0 < x < 1.0 for x in top_p])[:, None]
        lp = mx.where(active & (lp < threshold), neg_inf, lp)
    min_p = [p.min_p for p in params]
    if any(x > 0.0 for x in min_p):
        log_min_p = mx.array([math.log(x) if x > 0 else -math.inf for x in min_p])[:, None]
        threshold = mx.max(lp, axis=-1, keepdims=True) + log_min_p
        lp = mx.where(lp < threshold, neg_inf, lp)
    vocab = lp.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k_max = max(top_k)
        best = -mx.sort(-mx.topk(lp, k_max, axis=-1), axis=-1)
        kth = mx.array([max(k, 1) - 1 for k in top_k], dtype=mx.int32)[:, None]
        threshold = mx.take_along_axis(best, kth, axis=-1)
        active = mx.array([k > 0 for k in top_k])[:, None]
        lp = mx.where(active & (lp < threshold), neg_inf, lp)
    return lp
