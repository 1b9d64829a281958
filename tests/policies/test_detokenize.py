"""Streaming detokenization equals decoding the whole sequence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load as load_tokenizer

from policies.detokenize import make_detokenizer
from tests.support.config import builtin_dir


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(builtin_dir("tiny"))


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=60))
def test_stream_equals_decode(tokenizer, text):
    ids = tokenizer.encode(" " + text, add_special_tokens=False)
    detokenizer = make_detokenizer(tokenizer)
    streamed = "".join(detokenizer.add(t) for t in ids) + detokenizer.flush()
    assert streamed == tokenizer.decode(ids)


def test_split_multibyte_characters_are_held_back(tokenizer):
    ids = tokenizer.encode("日本語🙂", add_special_tokens=False)
    detokenizer = make_detokenizer(tokenizer)
    pieces = [detokenizer.add(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detokenizer.flush() == "日本語🙂"


def test_truncated_character_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detokenizer = make_detokenizer(tokenizer)
    assert "".join(detokenizer.add(t) for t in ids[:-1]) == ""
    assert detokenizer.flush() == tokenizer.decode(ids[:-1])
