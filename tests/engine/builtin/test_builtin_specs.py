"""The tiny model specs are written once (`engine.builtin.catalog.tiny_spec`): the built-ins
written with it keep their digests (so their directories and bytes), and the test families
that are a built-in under another seed are derived from it."""

from __future__ import annotations

import dataclasses

from engine.builtin.catalog import BUILTIN_MODELS, TINY_TOKENIZER, tiny_spec
from tests.support.families import FAMILIES

# `<name>-<digest[:12]>` of the built-ins written with `tiny_spec`, as they were written out
# field by field before it (a changed digest rebuilds the model elsewhere).
DIRECTORIES = {
    "tiny": "tiny-49c0e6f2404f",
    "tiny-kv": "tiny-kv-6f4b233aacea",
    "tiny-qwen2": "tiny-qwen2-6f25a7a33dd2",
    "tiny-gemma3": "tiny-gemma3-4bc22fe15541",
    "tiny-gemma3-kv": "tiny-gemma3-kv-2527759d8c65",
    "tiny-qwen3next": "tiny-qwen3next-d892e8a6e4ae",
    "tiny-lfm2": "tiny-lfm2-377e10659891",
    "tiny-spec": "tiny-spec-c9700bd5d2c3",
    "tiny-spec-draft": "tiny-spec-draft-e4116fd00b4b",
}


def test_the_tiny_built_ins_keep_their_directories():
    assert {name: BUILTIN_MODELS[name].directory_name() for name in DIRECTORIES} == DIRECTORIES


def test_tiny_spec_fills_the_tiny_defaults_and_sends_the_rest_to_extra():
    spec = tiny_spec("t", "llama", 3, num_hidden_layers=4, head_dim=16)
    assert (spec.hidden_size, spec.num_hidden_layers, spec.vocab_size, spec.tokenizer) == (64, 4, TINY_TOKENIZER.vocab_size, TINY_TOKENIZER)
    assert dict(spec.extra) == {"head_dim": 16} and not spec.tie_word_embeddings


def test_families_that_are_built_ins_under_another_seed_are_derived_from_them():
    for family, builtin in (("lfm2", "tiny-lfm2"), ("qwen3_next", "tiny-qwen3next")):
        assert FAMILIES[family] == dataclasses.replace(BUILTIN_MODELS[builtin], name=family, seed=FAMILIES[family].seed)
    gemma3 = FAMILIES["gemma3_text"]
    assert dict(gemma3.extra) == {**dict(BUILTIN_MODELS["tiny-gemma3"].extra), "sliding_window": 32}
    assert gemma3.directory_name() == "gemma3_text-29165e682116" and FAMILIES["lfm2"].directory_name() == "lfm2-4ce1277a0068"
