"""A model that copies its context by construction: induction heads written by hand.

Prompt lookup pays off when a model repeats spans of its context (rewriting a given
file, quoting a document, echoing code). Random-weight models do not, so `builtin:bench-copy`
is built to, with the mechanism trained models use (induction heads, Olsson et al. 2022),
in a SmolLM3 (llama with NoPE layers) of `bench`'s shape:

- residual subspaces: TOKEN (the token's code: a random unit vector of 64 dimensions),
  CONST (a constant 1), PREV and PREV2 (the codes of the previous and the one-before-previous
  token), OUT (the code of the predicted token), the rest left to the other layers;
- layer 0 (RoPE): two heads attend to exactly 1 and 2 positions back (content-free
  queries and keys on CONST, pre-rotated so the rotary score peaks there) and write those
  tokens' codes into PREV and PREV2;
- layer 1 (NoPE, so matching ignores distance): the induction head matches the current
  token's code (TOKEN) against each earlier position's previous token (PREV) and writes the
  code of the token that followed into OUT; a recovery head matches the previous token
  (PREV) against each position's one-before-previous (PREV2), so after a token that leaves the copy
  (a sampled deviation, an edit) the model returns to the copied text;
- the head reads OUT only, normalized: the logit of token v is `LOGIT_SCALE` times the
  cosine of v's code with OUT, whether one head or both found the copy. Greedy, it copies;
  at temperature 0.7 it leaves the copy on a few percent of tokens and comes back at once.

Every other layer is `bench`'s random layer with its output damped (`spec.scale`), so a
step costs what a 135M model's step costs.
"""

from __future__ import annotations

import numpy as np

CODE = 64
# Residual dimensions of each subspace.
TOKEN, CONST, PREV, PREV2, OUT = slice(0, 64), 64, slice(65, 129), slice(129, 193), slice(193, 257)
# Rotary pairs used by the positional heads, and their query-key product: the score at
# the wanted offset beats every other offset up to 8,192 by 1.08 x this / sqrt(head_dim).
POSITIONAL_PAIRS = 10
POSITIONAL_GAIN = 200.0
# Query-key product of the matching heads (a code's dot product with itself is 1, with
# another token's ~N(0, 1/64)).
MATCH_GAIN = 60.0
# Layer 1 writes its prediction this much larger than the unit vectors beside it, so
# the final norm sees OUT alone: one agreeing head (after a deviation) or two (copying)
# give the head the same unit vector.
OUT_GAIN = 10.0
# The logit of the predicted token: its code's dot product with OUT's direction, times this.
LOGIT_SCALE = 12.5


def build_copy_weights(config: dict, weights: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Overwrite the embeddings, head and first two layers of an initialised SmolLM3
    (`weights`, float32 numpy arrays by mlx-lm name) with the copying circuit."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    group = heads // kv_heads
    if head_dim != CODE or kv_heads < 3 or hidden < OUT.stop:
        raise ValueError("the copying circuit needs head_dim 64, at least 3 kv heads and 257 hidden dimensions")
    if config["no_rope_layers"][:2] != [1, 0] or config["tie_word_embeddings"]:
        raise ValueError("the copying circuit needs RoPE in layer 0, NoPE in layer 1 and an untied head")
    rng = np.random.default_rng(seed)
    vocab = config["vocab_size"]
    codes = rng.standard_normal((vocab, CODE)).astype(np.float32)
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    out = dict(weights)

    embed = np.zeros((vocab, hidden), np.float32)
    embed[:, TOKEN], embed[:, CONST] = codes, 1.0
    out["model.embed_tokens.weight"] = embed
    head = np.zeros((vocab, hidden), np.float32)
    head[:, OUT] = codes
    out["lm_head.weight"] = head
    norm = np.zeros(hidden, np.float32)
    # The final norm divides by the residual's RMS, ~|OUT| / sqrt(hidden) (TOKEN, CONST, PREV
    # and PREV2 are unit vectors beside OUT = 2 * OUT_GAIN * code): undo it so OUT reaches the
    # head as a unit vector.
    copying = 2.0 * OUT_GAIN
    norm[OUT] = LOGIT_SCALE * np.sqrt((4.0 + copying**2) / hidden) / copying
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

    def rows(head_index: int) -> slice:
        return slice(head_index * head_dim, (head_index + 1) * head_dim)

    identity = np.eye(CODE, dtype=np.float32)
    # Layer 0. The input norm scales the embedding (TOKEN: a unit code, CONST: 1) by
    # sqrt(hidden / 2).
    in0 = np.sqrt(hidden / 2.0)
    freqs = config["rope_theta"] ** (-np.arange(head_dim // 2) / (head_dim // 2))
    half = head_dim // 2
    key = np.zeros(head_dim, np.float32)
    key[:POSITIONAL_PAIRS] = 1.0
    wk[0, rows(0), CONST] = key * np.sqrt(POSITIONAL_GAIN) / in0
    wv[0, rows(0), TOKEN] = identity / in0
    for query_head, back, target in ((0, 1, PREV), (1, 2, PREV2)):
        # Rotary scores are cos((t - s) w + phi): phi = -back * w peaks at s = t - back.
        angle = -back * freqs[:POSITIONAL_PAIRS]
        query = np.zeros(head_dim, np.float32)
        query[:POSITIONAL_PAIRS], query[half : half + POSITIONAL_PAIRS] = np.cos(angle), np.sin(angle)
        wq[0, rows(query_head), CONST] = query * np.sqrt(POSITIONAL_GAIN) / in0
        wo[0, target, rows(query_head)] = identity
    # Layer 1 (NoPE). The residual now holds four unit vectors (TOKEN, CONST, PREV, PREV2):
    # the norm scales them by sqrt(hidden / 4).
    in1 = np.sqrt(hidden / 4.0)
    gain = np.sqrt(MATCH_GAIN * np.sqrt(head_dim)) / in1
    for query_head, query_from, key_from in ((group, TOKEN, PREV), (2 * group, PREV, PREV2)):
        kv = query_head // group
        wq[1, rows(query_head), query_from] = identity * gain
        wk[1, rows(kv), key_from] = identity * gain
        wv[1, rows(kv), TOKEN] = identity / in1
        wo[1, OUT, rows(query_head)] = identity * OUT_GAIN
    for i in (0, 1):
        out[layer(i, "self_attn.q_proj.weight")] = wq[i]
        out[layer(i, "self_attn.k_proj.weight")] = wk[i]
        out[layer(i, "self_attn.v_proj.weight")] = wv[i]
        out[layer(i, "self_attn.o_proj.weight")] = wo[i]
    return out
