"""Incremental detokenization: text that always equals `decode(all tokens so far)`.

Fast (Rust) tokenizers use `tokenizers.decoders.DecodeStream`, which holds back
incomplete UTF-8 and matches `decode` exactly. Others fall back to mlx-lm's
streaming detokenizer (which drops a leading space of the first token).
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenizers.decoders import DecodeStream


class Detokenizer(Protocol):
    def add(self, token: int) -> str:
        """Feed one token; returns the text it completed (possibly empty)."""

    def flush(self) -> str:
        """Text still held back at the end of the stream."""


class _FastDetokenizer:
    def __init__(self, backend: Any):
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=False)
        self._tokens: list[int] = []
        self._emitted = 0

    def add(self, token: int) -> str:
        self._tokens.append(token)
        text = self._stream.step(self._backend, token) or ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        # What DecodeStream still holds (an unfinished character) decodes with a replacement mark.
        full = self._backend.decode(self._tokens, skip_special_tokens=False)
        return full[self._emitted :] if len(full) > self._emitted else ""


class _MlxLmDetokenizer:
    def __init__(self, detokenizer: Any):
        self._detokenizer = detokenizer

    def add(self, token: int) -> str:
        self._detokenizer.add_token(token)
        return self._detokenizer.last_segment

    def flush(self) -> str:
        self._detokenizer.finalize()
        return self._detokenizer.last_segment


def make_detokenizer(tokenizer: Any) -> Detokenizer:
    """A fresh detokenizer for one request; `tokenizer` is mlx-lm's wrapper or a HF tokenizer."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        return _FastDetokenizer(backend)
    return _MlxLmDetokenizer(tokenizer.detokenizer)
