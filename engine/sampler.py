"""Vectorized per-row sampling for the decode batch, on device.

Each row carries its own temperature, top-p, top-k, min-p, penalties, seed and
logprob requests. Semantics follow mlx-lm's `make_sampler` and
`make_logits_processors` (penalties over the last `penalty_context_size` tokens,
prompt included; filters applied to log-probabilities at temperature 1; then a
Gumbel-max draw at the row's temperature), but one batch is one set of array
ops instead of a Python loop over rows. Random draws are keyed by
`(seed, tokens sampled so far)`, so a row's draws do not depend on which other
rows share its batch, and a resumed request can continue its sequence.

Per-request logits controls: `logit_bias` is added first (mlx-lm's processor
order), then after the penalties `allowed_token_ids`, `bad_words` and `min_tokens`
set what a row may not sample to -inf. Their arrays are built only while some row
has them, and rows without them keep their logits exactly. Rows with them never
check a span (admission refuses them speculation and fast-forwarding), so
`SpanCheck` positions see penalties and grammar masks only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
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
    # The ids `params.min_tokens` keeps from being sampled early (EOS and the request's stop
    # ids), and `bad_words` as token sequences (`AdmitRequest.bad_words_ids`).
    stop_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()

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

    @property
    def history_width(self) -> int:
        """Generated tokens its bad words look back over (the longest word's tokens but one)."""
        return max((len(word) - 1 for word in self.bad_words), default=0)

    @property
    def bans_stops(self) -> bool:
        """Its stop ids may not be sampled yet (`min_tokens`)."""
        return self.num_sampled < self.params.min_tokens and bool(self.stop_ids)


@dataclass
class SpanCheck:
    """Rows whose step forwarded a proposed span (a speculative draft, an echo span): every
    position is sampled as decoding without the span would have sampled it (same keyed draw,
    penalties over the span so far, grammar mask), and the span is kept while it agrees.

    `logits[i, j]` are row `rows[i]`'s logits before span token `j`, and at `len(spans[i])`
    after the whole span. With `rejection[i]` the row keeps a token with probability
    min(1, p/q) instead (standard speculative sampling; q is `draft_logprobs`, or a point mass
    on the proposed token when None) and draws a rejection from max(0, p - q).
    """

    rows: list[int]
    spans: list[list[int]]
    logits: mx.array
    masks: mx.array | None = None
    rejection: list[bool] = field(default_factory=list)
    draft_logprobs: mx.array | None = None


@dataclass
class SampleResult:
    """Device arrays of one step; rows in batch order. For a `SpanCheck`'s rows, `tokens` is the
    token after their kept span, and `accepted` how many span tokens were kept. `exhausted`
    (while some row's controls ban tokens): rows whose controls and grammar left no token at
    all (their token is meaningless: the request ends with an error)."""

    tokens: mx.array
    logprobs: mx.array | None = None
    top_ids: mx.array | None = None
    top_logprobs: mx.array | None = None
    accepted: mx.array | None = None
    exhausted: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs, self.accepted, self.exhausted) if a is not None]


# Draws that decide whether a proposed token is kept come from their own stream.
_ACCEPT_STREAM = 0x5BD1E995
# ... and of its residual draws on a rejection: the draft's tokens were drawn with the row's
# own keys, and a draw conditioned on a rejected token must not reuse its noise.
_RESIDUAL_STREAM = 0x27D4EB2F


@dataclass
class _Controls:
    """The batch's logits controls as device arrays (None: no row has that kind)."""

    # logit_bias: (rows, token ids, biases), one entry per biased token.
    bias: tuple[mx.array, mx.array, mx.array] | None = None
    # [rows, vocab]: False where allowed_token_ids leaves a token out or a one-token bad word bans it.
    allowed: mx.array | None = None
    # Longer bad words: (rows, prefixes right-aligned to the history's width with _ANY before
    # them, last tokens), one entry per word.
    words: tuple[mx.array, mx.array, mx.array] | None = None
    # Rows with min_tokens (whose stop ids are banned while they are below it).
    min_tokens: list[int] = field(default_factory=list)


_ANY = -2  # a bad word's prefix position that matches any history token


class BatchSampler:
    """Samples one token per row from `[rows, vocab]` logits."""

    def __init__(self) -> None:
        self.rows: list[RowSampling] = []
        self._window: mx.array | None = None
        self._params: dict[str, mx.array] | None = None
        # Logits controls, rebuilt when the rows change; and each row's last generated tokens
        # (-1 before the first) while some row has a bad word of several tokens.
        self._controls: _Controls | None = None
        self._history: mx.array | None = None

    def add_row(self, row: RowSampling, context: list[int], generated: list[int] | None = None) -> None:
        """Append a row; `context` is its token history so far (prompt, generated), `generated`
        the part of it the row generated (bad words look back over only that)."""
        self.rows.append(row)
        self._params = None
        self._controls = None
        if row.has_penalty or self._window is not None:
            self._rebuild_window(extra_context=context)
        if row.history_width or self._history is not None:
            self._rebuild_history(generated or [])

    def reorder(self, order: list[int]) -> None:
        """Keep rows `order` (old indices, in their new order)."""
        self.rows = [self.rows[i] for i in order]
        self._params = None
        self._controls = None
        if self._window is not None:
            self._window = self._window[mx.array(order, dtype=mx.int32)] if order else None
            if not any(r.has_penalty for r in self.rows):
                self._window = None
        if self._history is not None:
            keep = order and any(r.history_width for r in self.rows)
            self._history = self._history[mx.array(order, dtype=mx.int32)] if keep else None

    def advance(self, appended: dict[int, list[int]]) -> None:
        """Rows `i` appended tokens they did not sample (forced, fast-forwarded): penalties
        count them, and draws stay keyed by the number of tokens generated."""
        for i, tokens in appended.items():
            self.rows[i].num_sampled += len(tokens)
        if self._history is not None and any(self.rows[i].history_width for i in appended):
            self._history = _pushed(self._history, appended)
        if self._window is None or not any(self.rows[i].has_penalty for i in appended):
            return
        self._window = _pushed(self._window, appended)

    def process(self, logits: mx.array) -> mx.array:
        """Logits after each row's logit bias, penalties (mlx-lm's logits processors, in its
        order) and bans (allowed_token_ids, bad_words, min_tokens)."""
        logits = logits.astype(mx.float32)
        controls = self._controls_for(logits.shape[-1])
        if controls.bias is not None:
            rows, ids, values = controls.bias
            logits = logits.at[rows, ids].add(values)
        if self._window is not None:
            logits = self._penalize(logits, self._window, self.rows)
        return self._ban(logits, controls)

    def _ban(self, logits: mx.array, controls: _Controls) -> mx.array:
        """-inf where a row's controls forbid a token this step."""
        if controls.allowed is not None:
            logits = mx.where(controls.allowed, logits, -math.inf)
        if controls.words is not None and self._history is not None:
            rows, prefixes, last = controls.words
            match = mx.all((prefixes == _ANY) | (self._history[rows] == prefixes), axis=1)
            logits = logits.at[rows, last].add(mx.where(match, -math.inf, 0.0))
        stops = [(i, t) for i in controls.min_tokens if self.rows[i].bans_stops for t in self.rows[i].stop_ids]
        if stops:
            stop_rows, stop_ids = zip(*stops)
            banned = mx.full((len(stops),), -math.inf, mx.float32)
            logits = logits.at[mx.array(stop_rows, dtype=mx.int32), mx.array(stop_ids, dtype=mx.int32)].add(banned)
        return logits

    def _controls_for(self, vocab: int) -> _Controls:
        """The rows' logits controls as device arrays (cached until the rows change)."""
        if self._controls is not None:
            return self._controls
        controls = _Controls(min_tokens=[i for i, r in enumerate(self.rows) if r.params.min_tokens > 0 and r.stop_ids])
        bias = [(i, t, v) for i, r in enumerate(self.rows) for t, v in (r.params.logit_bias or {}).items()]
        if bias:
            rows, ids, values = zip(*bias)
            controls.bias = (mx.array(rows, dtype=mx.int32), mx.array(ids, dtype=mx.int32), mx.array(values, dtype=mx.float32))
        masked = [i for i, r in enumerate(self.rows) if r.params.allowed_token_ids is not None or any(len(w) == 1 for w in r.bad_words)]
        if masked:
            allowed = np.ones((len(self.rows), vocab), dtype=np.bool_)
            for i in masked:
                r = self.rows[i]
                if r.params.allowed_token_ids is not None:
                    allowed[i] = False
                    allowed[i, r.params.allowed_token_ids] = True
                allowed[i, [w[0] for w in r.bad_words if len(w) == 1]] = False
            controls.allowed = mx.array(allowed)
        width = self._history.shape[1] if self._history is not None else 0
        words = [(i, w) for i, r in enumerate(self.rows) for w in r.bad_words if len(w) > 1]
        if words and width:
            prefixes = [[_ANY] * (width - len(w) + 1) + list(w[:-1]) for _, w in words]
            controls.words = (
                mx.array([i for i, _ in words], dtype=mx.int32),
                mx.array(prefixes, dtype=mx.int32),
                mx.array([w[-1] for _, w in words], dtype=mx.int32),
            )
        self._controls = controls
        return controls

    def sample(self, logits: mx.array, mask: mx.array | None = None, check: SpanCheck | None = None) -> SampleResult:
        """One token per row; `mask` is an xgrammar bitmask ([rows, ceil(vocab / 32)] int32).
        Rows of `check` get the token after the part of their span that is kept instead."""
        rows = self.rows
        controls = self._controls_for(logits.shape[-1])
        bans = controls.allowed is not None or controls.words is not None or any(rows[i].bans_stops for i in controls.min_tokens)
        logits = self.process(logits)
        if mask is not None:
            logits = apply_token_bitmask_mlx(mask, logits, logits.shape[-1])
        tokens = self._choose(logits, rows, [0] * len(rows))
        result = SampleResult(tokens=tokens)
        if bans:
            result.exhausted = mx.max(logits, axis=-1) == -math.inf
        if any(r.wants_logprobs for r in rows):
            self._attach_logprobs(result, logits)
        new_windows = None
        if check is not None and check.rows:
            final, result.accepted, new_windows = self._check(check)
            tokens[mx.array(check.rows, dtype=mx.int32)] = final
        if self._window is not None:
            self._window = mx.concatenate([self._window[:, 1:], tokens[:, None].astype(mx.int32)], axis=1)
            if new_windows is not None and check is not None:
                self._window[mx.array(check.rows, dtype=mx.int32)] = new_windows
        if self._history is not None:  # (a checked row has no bad words: its history is unused)
            self._history = mx.concatenate([self._history[:, 1:], tokens[:, None].astype(mx.int32)], axis=1)
        for r in rows:
            r.num_sampled += 1
        return result

    def _choose(self, logits: mx.array, rows: list[RowSampling], offsets: list[int]) -> mx.array:
        """Each row's token from its processed logits: argmax, or a keyed draw `offsets` past
        its tokens sampled so far."""
        tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
        sampled = [i for i, r in enumerate(rows) if not r.is_greedy]
        if not sampled:
            return tokens
        index = mx.array(sampled, dtype=mx.int32)
        lp = self._filtered(logits[index], [rows[i] for i in sampled])
        keys = [draw_key(rows[i].seed, rows[i].num_sampled + offsets[i]) for i in sampled]
        tokens[index] = _gumbel_argmax(lp, keys)
        return tokens

    @staticmethod
    def _filtered(logits: mx.array, rows: list[RowSampling]) -> mx.array:
        """Log-probabilities after top-p/min-p/top-k, scaled by each row's temperature."""
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        lp = apply_filters(lp, [r.params for r in rows])
        return lp * mx.array([1.0 / r.params.temperature for r in rows])[:, None]

    def _check(self, check: SpanCheck) -> tuple[mx.array, mx.array, mx.array | None]:
        """Final tokens, kept counts and the penalty windows after the kept tokens, for the
        rows of `check` (see `SpanCheck`)."""
        n, positions, vocab = check.logits.shape
        rows = [self.rows[i] for i in check.rows]
        flat_rows = [r for r in rows for _ in range(positions)]
        offsets = [j for _ in rows for j in range(positions)]
        flat = check.logits.reshape(n * positions, vocab).astype(mx.float32)
        windows = self._span_windows(check) if self._window is not None else None
        if windows is not None:
            flat = self._penalize(flat, windows.reshape(n * positions, -1), flat_rows)
        if check.masks is not None:
            flat = apply_token_bitmask_mlx(check.masks.reshape(n * positions, -1), flat, vocab)
        samples = self._choose(flat, flat_rows, offsets).reshape(n, positions).astype(mx.int32)
        proposed = mx.array([span + [-1] * (positions - 1 - len(span)) for span in check.spans], dtype=mx.int32)
        accepted = mx.cumprod((samples[:, :-1] == proposed).astype(mx.int32), axis=1).sum(axis=1)
        final = mx.take_along_axis(samples, accepted[:, None], axis=1)[:, 0]
        if any(check.rejection):
            final, accepted = self._rejection(check, flat, flat_rows, proposed, samples, final, accepted)
        new_windows = None
        if windows is not None:
            before = mx.take_along_axis(windows, accepted[:, None, None], axis=1)[:, 0]
            new_windows = mx.concatenate([before[:, 1:], final[:, None]], axis=1)
        return final.astype(mx.uint32), accepted, new_windows

    def _rejection(self, check, flat, flat_rows, proposed, samples, final, accepted):
        """Standard speculative sampling for the rows that ask (greedy rows stay exact)."""
        n, positions = samples.shape
        vocab = flat.shape[-1]
        lp = self._filtered(flat, [r if not r.is_greedy else _UNIT for r in flat_rows]).reshape(n, positions, vocab)
        p = mx.softmax(lp, axis=-1)
        safe = mx.maximum(proposed, 0)
        p_x = mx.take_along_axis(p[:, :-1], safe[:, :, None], axis=-1)[:, :, 0]
        if check.draft_logprobs is not None:
            q = mx.exp(check.draft_logprobs.astype(mx.float32))
        else:  # a point mass on the proposed token
            q = (mx.arange(vocab)[None, None, :] == safe[:, :, None]).astype(mx.float32)
        q_x = mx.take_along_axis(q, safe[:, :, None], axis=-1)[:, :, 0]
        rows = [self.rows[i] for i in check.rows]
        keys = [draw_key(r.seed ^ _ACCEPT_STREAM, r.num_sampled + j) for r in rows for j in range(positions - 1)]
        uniform = mx.vmap(lambda k: mx.random.uniform(key=k))(mx.array(keys, dtype=mx.uint32)).reshape(n, positions - 1)
        kept = (uniform * q_x < p_x) & (proposed >= 0)
        rejected_at = mx.cumprod(kept.astype(mx.int32), axis=1).sum(axis=1)
        residual = mx.maximum(p[:, :-1] - q, 0.0)
        residual_keys = [draw_key(r.seed ^ _RESIDUAL_STREAM, r.num_sampled + j) for r in rows for j in range(positions - 1)]
        redraw = _gumbel_argmax(mx.log(residual.reshape(n * (positions - 1), vocab)), residual_keys).reshape(n, positions - 1)
        # A rejection draws from the residual there; a whole span kept adds the plain sample after it.
        at = mx.minimum(rejected_at, positions - 2)[:, None]
        lengths = mx.array([len(span) for span in check.spans], dtype=mx.int32)
        residual_token = mx.take_along_axis(redraw, at, axis=1)[:, 0].astype(mx.int32)
        chosen = mx.where(rejected_at < lengths, residual_token, mx.take_along_axis(samples, rejected_at[:, None], axis=1)[:, 0])
        use = mx.array([rej and not r.is_greedy for rej, r in zip(check.rejection, rows)])
        return mx.where(use, chosen, final), mx.where(use, rejected_at, accepted)

    def _span_windows(self, check: SpanCheck) -> mx.array:
        """Each checked row's penalty window before each span position: `[rows, positions, width]`."""
        assert self._window is not None
        positions = check.logits.shape[1]
        width = self._window.shape[1]
        padded = mx.array([span + [-1] * (positions - 1 - len(span)) for span in check.spans], dtype=mx.int32)
        extended = mx.concatenate([self._window[mx.array(check.rows, dtype=mx.int32)], padded], axis=1)
        index = mx.arange(positions, dtype=mx.int32)[:, None] + mx.arange(width, dtype=mx.int32)[None, :]
        return extended[:, index]

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

    def _rebuild_history(self, generated: list[int]) -> None:
        """Recreate the bad-word histories on a join: the new row's from its generated tokens,
        the others' kept (rows without longer bad words keep -1s)."""
        width = max(r.history_width for r in self.rows)
        old = self._history
        rows = []
        for i, r in enumerate(self.rows):
            if i == len(self.rows) - 1:
                tail = generated[-width:] if r.history_width else []
                rows.append(mx.array([-1] * (width - len(tail)) + tail, dtype=mx.int32))
            elif old is not None and r.history_width:
                row = old[i, max(0, old.shape[1] - width) :]
                rows.append(mx.concatenate([mx.full((width - row.shape[0],), -1, mx.int32), row]))
            else:
                rows.append(mx.full((width,), -1, mx.int32))
        self._history = mx.stack(rows)

    def _penalize(self, logits: mx.array, window: mx.array, rows: list[RowSampling]) -> mx.array:
        params = self._params_for(rows)
        num_rows, width = window.shape
        age = mx.arange(width - 1, -1, -1, dtype=mx.int32)[None, :]
        valid = (window >= 0) & (age < params["context"][:, None])
        index = mx.where(valid, window, 0)
        row_index = mx.broadcast_to(mx.arange(num_rows, dtype=mx.int32)[:, None], index.shape)
        counts = mx.zeros(logits.shape, mx.float32).at[row_index, index].add(valid.astype(mx.float32))
        present = counts > 0
        rep = params["repetition"]
        logits = mx.where(present, mx.where(logits < 0, logits * rep, logits / rep), logits)
        logits = logits - params["presence"] * present
        return logits - params["frequency"] * counts

    def _params_for(self, rows: list[RowSampling]) -> dict[str, mx.array]:
        if rows is self.rows:
            if self._params is None:
                self._params = _penalty_params(self.rows)
            return self._params
        return _penalty_params(rows)

    def _attach_logprobs(self, result: SampleResult, logits: mx.array) -> None:
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        result.logprobs = mx.take_along_axis(lp, result.tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
        k = max(r.top_logprobs for r in self.rows)
        if k > 0:
            top_ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
            result.top_ids = top_ids
            result.top_logprobs = mx.take_along_axis(lp, top_ids, axis=-1)


# A greedy row's distribution, for rejection sampling's arithmetic (never drawn from).
_UNIT = RowSampling(SamplingParams(temperature=1.0), seed=0)


def _penalty_params(rows: list[RowSampling]) -> dict[str, mx.array]:
    p = [r.params for r in rows]
    return {
        "repetition": mx.array([x.repetition_penalty for x in p])[:, None],
        "presence": mx.array([x.presence_penalty for x in p])[:, None],
        "frequency": mx.array([x.frequency_penalty for x in p])[:, None],
        "context": mx.array([x.penalty_context_size if r.has_penalty else 0 for x, r in zip(p, rows)]),
    }


def _pushed(windows: mx.array, appended: dict[int, list[int]]) -> mx.array:
    """`windows` ([rows, width] token windows) after rows `i` appended `appended[i]`."""
    width = windows.shape[1]
    rows = []
    for i in range(windows.shape[0]):
        tokens = appended.get(i, [])[-width:]
        row = windows[i]
        rows.append(mx.concatenate([row[len(tokens) :], mx.array(tokens, dtype=mx.int32)]) if tokens else row)
    return mx.stack(rows)


def draft_draws(logits: mx.array, rows: list[RowSampling], offset: int) -> tuple[mx.array, mx.array]:
    """A draft model's tokens, drawn as the target's sampler will draw position `offset` past
    each row's sampled tokens: argmax for greedy rows, otherwise the same keyed Gumbel noise
    over the draft's own filtered, tempered distribution (so agreeing models draw alike).
    Returns the tokens and the log-probabilities they were drawn from (greedy rows: the
    draft's plain distribution)."""
    logits = logits.astype(mx.float32)
    tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampled = [i for i, r in enumerate(rows) if not r.is_greedy]
    if sampled:
        index = mx.array(sampled, dtype=mx.int32)
        scaled = BatchSampler._filtered(logits[index], [rows[i] for i in sampled])
        tokens[index] = _gumbel_argmax(scaled, [draw_key(rows[i].seed, rows[i].num_sampled + offset) for i in sampled])
        logprobs[index] = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    return tokens, logprobs


def _gumbel_argmax(scaled: mx.array, keys: list[tuple[int, int]]) -> mx.array:
    """One keyed Gumbel-max draw per row of `scaled` log-probabilities."""
    noise = mx.vmap(lambda k: mx.random.gumbel(shape=(scaled.shape[-1],), key=k))(mx.array(keys, dtype=mx.uint32))
    return mx.argmax(scaled + noise, axis=-1).astype(mx.uint32)


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
