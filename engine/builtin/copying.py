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


def build_copy_weights(config: dict, weights: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Overwrite the embeddings, head and first two layers of an initialised SmolLM3
    (`weights`, float32 numpy arrays by mlx-lm name) with the copying circuit."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    group = heads // kv_heads
    if head_dim < CODE + 2 * KEY_CODE or group < 3 or kv_heads < 2 or hidden < OUT.stop:
        raise ValueError(f"the copying circuit needs head_dim >= {CODE + 2 * KEY_CODE}, 3 query heads per kv head, 2 kv heads and {OUT.stop} hidden dimensions")
    if config["no_rope_layers"][:2] != [1, 0] or config["tie_word_embeddings"]:
        raise ValueError("the copying circuit needs RoPE in layer 0, NoPE in layer 1 and an untied head")
    half = head_dim // 2
    freqs = config["rope_theta"] ** (-np.arange(half) / half)
    if min(positional_margin(freqs, POSITIONAL_PAIRS, back) for back in (1, 2, 3)) < 1.0:
        raise ValueError("rope_theta and head_dim leave the positional heads no margin")
    rng = np.random.default_rng(seed)
    vocab = config["vocab_size"]

    def unit_codes(size: int) -> np.ndarray:
        codes = rng.standard_normal((vocab, size)).astype(np.float32)
        return codes / np.linalg.norm(codes, axis=1, keepdims=True)

    codes, keys = unit_codes(CODE), unit_codes(KEY_CODE)
    out = dict(weights)
    embed = np.zeros((vocab, hidden), np.float32)
    embed[:, TOKEN], embed[:, KEY], embed[:, CONST] = codes, keys, 1.0
    out["model.embed_tokens.weight"] = embed
    head = np.zeros((vocab, hidden), np.float32)
    head[:, OUT] = codes
    out["lm_head.weight"] = head
    norm = np.zeros(hidden, np.float32)
    # The final norm divides by the residual's RMS, ~|OUT| / sqrt(hidden) (UNITS unit
    # vectors beside OUT = OUT_GAIN * code): undo it so OUT reaches the head as a unit vector.
    norm[OUT] = LOGIT_SCALE * np.sqrt((UNITS + OUT_GAIN**2) / hidden) / OUT_GAIN
    out["model.norm.weight"] = norm

    def layer(i: int, name: str) -> str:
        return f"model.layers.{i}.{name}"

    for i in (0, 1):
        out[layer(i, "input_layernorm.weight")] = np.ones(hidden, np.float32)
        out[layer(i, "mlp.down_proj.weight")] = np.zeros_like(weights[layer(i, "mlp.down_proj.weight")])
    wq = np.zeros((2, heads * head_dim, hidden), np.float32)
    wk = np.zeros((2, kv_heads * head_dim, hidden), np.float32)
    wv = np.zeros((2, kv_heads * head_dim, hidden), np.float32)
    wo = np.zeros((2, hidden, heads * head_dim), np.float32)

    def part(head_index: int, offset: int = 0, size: int = CODE) -> slice:
        """Dimensions offset..offset + size of a head's (query, key or value) vector."""
        return slice(head_index * head_dim + offset, head_index * head_dim + offset + size)

    def eye(size: int) -> np.ndarray:
        return np.eye(size, dtype=np.float32)

    # Layer 0. The input norm scales the embedding (TOKEN, KEY: unit codes, CONST: 1) by
    # sqrt(hidden / 3). Each positional head reads the value (TOKEN, KEY) of its position.
    in0 = np.sqrt(hidden / 3.0)
    key = np.zeros(head_dim, np.float32)
    key[:POSITIONAL_PAIRS] = 1.0
    wk[0, part(0, 0, head_dim), CONST] = key * np.sqrt(POSITIONAL_GAIN) / in0
    wv[0, part(0), TOKEN], wv[0, part(0, CODE, KEY_CODE), KEY] = eye(CODE) / in0, eye(KEY_CODE) / in0
    for query_head, back, target in ((0, 1, PREV_KEY), (1, 2, PREV2_KEY), (2, 3, PREV3_KEY)):
        # Rotary scores are cos((t - s) w + phi): phi = -back * w peaks at s = t - back.
        angle = -back * freqs[:POSITIONAL_PAIRS]
        query = np.zeros(head_dim, np.float32)
        query[:POSITIONAL_PAIRS], query[half : half + POSITIONAL_PAIRS] = np.cos(angle), np.sin(angle)
        wq[0, part(query_head, 0, head_dim), CONST] = query * np.sqrt(POSITIONAL_GAIN) / in0
        wo[0, target, part(query_head, CODE, KEY_CODE)] = eye(KEY_CODE)
    wo[0, PREV, part(0)] = eye(CODE)
    # Layer 1 (NoPE). The residual now holds UNITS unit vectors: the norm scales them by
    # sqrt(hidden / UNITS). Query: (TOKEN, PREV_KEY, PREV2_KEY) weighted; key at each
    # position: (PREV, PREV2_KEY, PREV3_KEY); value: its TOKEN.
    in1 = np.sqrt(hidden / UNITS)
    gain = np.sqrt(MATCH_GAIN * np.sqrt(head_dim)) / in1
    this, previous, before = MATCH_WEIGHTS
    wq[1, part(group, 0), TOKEN] = eye(CODE) * gain * this
    wq[1, part(group, CODE, KEY_CODE), PREV_KEY] = eye(KEY_CODE) * gain * previous
    wq[1, part(group, CODE + KEY_CODE, KEY_CODE), PREV2_KEY] = eye(KEY_CODE) * gain * before
    wk[1, part(1, 0), PREV] = eye(CODE) * gain
    wk[1, part(1, CODE, KEY_CODE), PREV2_KEY] = eye(KEY_CODE) * gain
    wk[1, part(1, CODE + KEY_CODE, KEY_CODE), PREV3_KEY] = eye(KEY_CODE) * gain
    wv[1, part(1), TOKEN] = eye(CODE) / in1
    wo[1, OUT, part(group)] = eye(CODE) * OUT_GAIN
    for i in (0, 1):
        out[layer(i, "self_attn.q_proj.weight")] = wq[i]
        out[layer(i, "self_attn.k_proj.weight")] = wk[i]
        out[layer(i, "self_attn.v_proj.weight")] = wv[i]
        out[layer(i, "self_attn.o_proj.weight")] = wo[i]
    return out
