"""A model that copies its context by construction: induction heads written by hand.

Prompt lookup pays off when a model repeats spans of its context (rewriting a given
file, quoting a document, echoing code). Random-weight models do not, so `builtin:bench-copy`
is built to, with the mechanism trained models use (induction heads, Olsson et al. 2022),
in a SmolLM3 (llama with NoPE layers) of `bench`'s width, with 128-dimensional heads:

- residual subspaces: TOKEN (the token's code: a random unit vector of 64 dimensions),
  KEY (a second code of 32 dimensions, for matching), CONST (a constant 1), PREV (the
  previous token's TOKEN), PREV_KEY, PREV2_KEY and PREV3_KEY (the KEY of the tokens 1, 2
  and 3 back), OUT (the code of the predicted token); the rest is left to the other layers;
- layer 0 (RoPE): three heads attend to exactly 1, 2 and 3 positions back (content-free
  queries and keys on CONST, pre-rotated so the rotary score peaks there) and write those
  tokens' codes into PREV, PREV_KEY, PREV2_KEY and PREV3_KEY;
- layer 1 (NoPE, so matching ignores distance): the induction head matches the last three
  tokens (this one, weighted 1; the previous, 0.75; the one before, 0.5) against the three
  before each earlier position and writes the TOKEN code found there into OUT: a trigram
  match wins over a bigram, a bigram over this token alone (plain induction), and the two
  tokens before this one (0.75 + 0.5) over this one alone, which is how the copy resumes
  after a token that left it (a sampled deviation, an edit);
- the head reads OUT only, normalized: the logit of token v is `LOGIT_SCALE` times the
  cosine of v's code with OUT, whichever match found it. Greedy, it copies (where the
  last three tokens recur with different continuations it mixes them, as a model unsure
  where it is would); at temperature 0.7 it leaves the copy now and then and comes back.

Every other layer is a random layer of that shape with its output damped (`spec.scale`),
so a step costs what any 170M-parameter model's step costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CODE, KEY_CODE = 64, 32
# Residual dimensions of each subspace.
TOKEN, KEY, CONST = slice(0, 64), slice(64, 96), 96
PREV, PREV_KEY, PREV2_KEY, PREV3_KEY, OUT = slice(97, 161), slice(161, 193), slice(193, 225), slice(225, 257), slice(257, 321)
# Unit vectors in the residual before layer 1: TOKEN, KEY, CONST, PREV and the three KEYs.
UNITS = 7
# The induction head's weights for this token, the previous one and the one before.
MATCH_WEIGHTS = (1.0, 0.75, 0.5)
# Rotary pairs used by the positional heads, and their query-key product: the score at
# the wanted offset beats every other offset up to 8,192 by `positional_margin` (1.89 at
# head_dim 128) x this / sqrt(head_dim).
POSITIONAL_PAIRS = 16
POSITIONAL_GAIN = 200.0
# Query-key product of the induction head per unit of match weight (a code's dot product
# with itself is 1, with another token's ~N(0, 1/64), or 1/32 for KEY codes).
MATCH_GAIN = 60.0
# Layer 1 writes its prediction this much larger than the unit vectors beside it, so
# the final norm sees OUT alone: a full match and a fallback give the head the same
# unit vector.
OUT_GAIN = 10.0
# The logit of the predicted token: its code's dot product with OUT's direction, times this.
LOGIT_SCALE = 12.5


def positional_margin(freqs: np.ndarray, pairs: int, back: int, horizon: int = 8192) -> float:
    """How much the rotary score of a positional head (its first `pairs` frequencies)
    beats, at `back` positions, its best other offset up to `horizon`."""
    offsets = np.arange(horizon + 1)
    scores = np.cos(np.outer(offsets - back, freqs[:pairs])).sum(axis=1)
    return float(scores[back] - np.delete(scores, back).max())


@dataclass(frozen=True)
class _Heads:
    """The attention geometry the circuit is written into."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per kv head: query head `group` is the first to read kv head 1."""
        return self.heads // self.kv_heads

    def part(self, head_index: int, offset: int = 0, size: int = CODE) -> slice:
        """Dimensions offset..offset + size of a head's (query, key or value) vector."""
        return slice(head_index * self.head_dim + offset, head_index * self.head_dim + offset + size)


def _eye(size: int) -> np.ndarray:
    return np.eye(size, dtype=np.float32)


def _layer(i: int, name: str) -> str:
    return f"model.layers.{i}.{name}"


def build_copy_weights(config: dict, weights: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Overwrite the embeddings, head and first two layers of an initialised SmolLM3
    (`weights`, float32 numpy arrays by mlx-lm name) with the copying circuit."""
    geometry, freqs = _check_geometry(config)
    out = dict(weights)
    out.update(_embeddings_and_head(config["vocab_size"], geometry.hidden, np.random.default_rng(seed)))
    shape = {"q": geometry.heads, "k": geometry.kv_heads, "v": geometry.kv_heads}
    attention = {name: np.zeros((2, count * geometry.head_dim, geometry.hidden), np.float32) for name, count in shape.items()}
    attention["o"] = np.zeros((2, geometry.hidden, geometry.heads * geometry.head_dim), np.float32)
    _positional_layer(geometry, freqs, attention)
    _induction_layer(geometry, attention)
    for i in (0, 1):
        out[_layer(i, "input_layernorm.weight")] = np.ones(geometry.hidden, np.float32)
        out[_layer(i, "mlp.down_proj.weight")] = np.zeros_like(weights[_layer(i, "mlp.down_proj.weight")])
        for name, array in attention.items():
            out[_layer(i, f"self_attn.{name}_proj.weight")] = array[i]
    return out


def _check_geometry(config: dict) -> tuple[_Heads, np.ndarray]:
    """The model's heads (refused with `ValueError` unless the circuit fits them) and its rotary frequencies."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    geometry = _Heads(hidden, heads, kv_heads, config.get("head_dim") or hidden // heads)
    if geometry.head_dim < CODE + 2 * KEY_CODE or geometry.group < 3 or kv_heads < 2 or hidden < OUT.stop:
        raise ValueError(f"the copying circuit needs head_dim >= {CODE + 2 * KEY_CODE}, 3 query heads per kv head, 2 kv heads and {OUT.stop} hidden dimensions")
    if config["no_rope_layers"][:2] != [1, 0] or config["tie_word_embeddings"]:
        raise ValueError("the copying circuit needs RoPE in layer 0, NoPE in layer 1 and an untied head")
    half = geometry.head_dim // 2
    freqs = config["rope_theta"] ** (-np.arange(half) / half)
    if min(positional_margin(freqs, POSITIONAL_PAIRS, back) for back in (1, 2, 3)) < 1.0:
        raise ValueError("rope_theta and head_dim leave the positional heads no margin")
    return geometry, freqs


def _embeddings_and_head(vocab: int, hidden: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Each token's TOKEN and KEY codes (random unit vectors) in its embedding, and a head that
    reads OUT against the TOKEN codes."""

    def unit_codes(size: int) -> np.ndarray:
        codes = rng.standard_normal((vocab, size)).astype(np.float32)
        return codes / np.linalg.norm(codes, axis=1, keepdims=True)

    codes, keys = unit_codes(CODE), unit_codes(KEY_CODE)
    embed = np.zeros((vocab, hidden), np.float32)
    embed[:, TOKEN], embed[:, KEY], embed[:, CONST] = codes, keys, 1.0
    head = np.zeros((vocab, hidden), np.float32)
    head[:, OUT] = codes
    norm = np.zeros(hidden, np.float32)
    # The final norm divides by the residual's RMS, ~|OUT| / sqrt(hidden) (UNITS unit
    # vectors beside OUT = OUT_GAIN * code): undo it so OUT reaches the head as a unit vector.
    norm[OUT] = LOGIT_SCALE * np.sqrt((UNITS + OUT_GAIN**2) / hidden) / OUT_GAIN
    return {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": norm}


def _positional_layer(g: _Heads, freqs: np.ndarray, w: dict[str, np.ndarray]) -> None:
    """Layer 0. The input norm scales the embedding (TOKEN, KEY: unit codes, CONST: 1) by
    sqrt(hidden / 3). Each positional head reads the value (TOKEN, KEY) of its position."""
    in0 = np.sqrt(g.hidden / 3.0)
    half = g.head_dim // 2
    key = np.zeros(g.head_dim, np.float32)
    key[:POSITIONAL_PAIRS] = 1.0
    w["k"][0, g.part(0, 0, g.head_dim), CONST] = key * np.sqrt(POSITIONAL_GAIN) / in0
    w["v"][0, g.part(0), TOKEN], w["v"][0, g.part(0, CODE, KEY_CODE), KEY] = _eye(CODE) / in0, _eye(KEY_CODE) / in0
    for query_head, back, target in ((0, 1, PREV_KEY), (1, 2, PREV2_KEY), (2, 3, PREV3_KEY)):
        # Rotary scores are cos((t - s) w + phi): phi = -back * w peaks at s = t - back.
        angle = -back * freqs[:POSITIONAL_PAIRS]
        query = np.zeros(g.head_dim, np.float32)
        query[:POSITIONAL_PAIRS], query[half : half + POSITIONAL_PAIRS] = np.cos(angle), np.sin(angle)
        w["q"][0, g.part(query_head, 0, g.head_dim), CONST] = query * np.sqrt(POSITIONAL_GAIN) / in0
        w["o"][0, target, g.part(query_head, CODE, KEY_CODE)] = _eye(KEY_CODE)
    w["o"][0, PREV, g.part(0)] = _eye(CODE)


def _induction_layer(g: _Heads, w: dict[str, np.ndarray]) -> None:
    """Layer 1 (NoPE). The residual now holds UNITS unit vectors: the norm scales them by
    sqrt(hidden / UNITS). Query: (TOKEN, PREV_KEY, PREV2_KEY) weighted; key at each
    position: (PREV, PREV2_KEY, PREV3_KEY); value: its TOKEN."""
    in1 = np.sqrt(g.hidden / UNITS)
    gain = np.sqrt(MATCH_GAIN * np.sqrt(g.head_dim)) / in1
    this, previous, before = MATCH_WEIGHTS
    w["q"][1, g.part(g.group, 0), TOKEN] = _eye(CODE) * gain * this
    w["q"][1, g.part(g.group, CODE, KEY_CODE), PREV_KEY] = _eye(KEY_CODE) * gain * previous
    w["q"][1, g.part(g.group, CODE + KEY_CODE, KEY_CODE), PREV2_KEY] = _eye(KEY_CODE) * gain * before
    w["k"][1, g.part(1, 0), PREV] = _eye(CODE) * gain
    w["k"][1, g.part(1, CODE, KEY_CODE), PREV2_KEY] = _eye(KEY_CODE) * gain
    w["k"][1, g.part(1, CODE + KEY_CODE, KEY_CODE), PREV3_KEY] = _eye(KEY_CODE) * gain
    w["v"][1, g.part(1), TOKEN] = _eye(CODE) / in1
    w["o"][1, OUT, g.part(g.group)] = _eye(CODE) * OUT_GAIN
