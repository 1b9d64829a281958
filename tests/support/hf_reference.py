"""transformers' reading of a GGUF file: the reference the GGUF tests compare with.

transformers dequantizes a GGUF to float32 torch weights with its own reader (and undoes
llama.cpp's Q/K permutation itself), so agreeing with it checks our reader, name mapping,
permutation, rotary embedding and tokenizer independently. Greedy continuations are cached
as JSON under the tests' cache directory, keyed by the file's digest, the prompts and the
transformers version: loading the real model into transformers takes ~25 s.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.model.gguf.format import GGUFFile
from runtime import env

# Positions where transformers' two best logits are closer than this may go either way under
# another float summation order: a divergence there is excused.
NEAR_TIE = 0.02


@dataclass
class Continuation:
    tokens: list[int]  # without the end-of-sequence token it stopped on
    margins: list[float]  # top-1 minus top-2 logit at each generated position


def _model(path: Path, config: dict):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, **config).eval()


def logits(path: Path, ids: list[int], config: dict | None = None) -> np.ndarray:
    """transformers' logits for every position of `ids` (teacher-forced)."""
    import torch

    model = _model(path, config or {})
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def greedy(path: Path, prompts: list[list[int]], max_tokens: int, eos: list[int], config: dict | None = None) -> list[Continuation]:
    """transformers' greedy continuation of each prompt (one at a time, no padding), cached."""
    with GGUFFile.open(path) as file:
        digest = file.digest()
    import transformers

    key = hashlib.sha256(json.dumps([digest, prompts, max_tokens, eos, config, transformers.__version__]).encode()).hexdigest()[:32]
    cache = env.home() / "hf-reference" / f"{key}.json"
    if cache.is_file():
        return [Continuation(**c) for c in json.loads(cache.read_text())]
    import torch

    model = _model(path, config or {})
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
                output_scores=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            top2 = [torch.topk(s[0], 2).values for s in out.scores]
            margins = [float(v[0] - v[1]) for v in top2]
            if tokens and tokens[-1] in eos:
                tokens = tokens[:-1]
            results.append(Continuation(tokens, margins))
    cache.parent.mkdir(parents=True, exist_ok=True)
    # Written whole, then renamed: a test running beside this one (pytest-xdist) reads either
    # nothing or the whole file.
    partial = cache.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps([asdict(r) for r in results]))
    os.replace(partial, cache)
    return results


def assert_same_greedy(ours: list[int], reference: Continuation, label: str = "") -> bool:
    """Equal token for token, or diverging first at a near-tie of the reference (excused).
    Returns whether a near-tie was excused."""
    n = min(len(ours), len(reference.tokens))
    first = next((i for i in range(n) if ours[i] != reference.tokens[i]), None)
    if first is None:
        if len(ours) == len(reference.tokens):
            return False
        first = n  # one stopped (end of sequence) where the other went on
    margin = reference.margins[first] if first < len(reference.margins) else 0.0
    assert margin < NEAR_TIE, f"{label}: diverged at token {first} ({ours[first]} vs {reference.tokens[first]}) where the reference's margin is {margin:.4f}"
    return True
