"""A `ModelInfo` for policy tests that need a model's figures but no model."""

from __future__ import annotations

from typing import Any

from protocols.model import ModelInfo


def model_info(**fields: Any) -> ModelInfo:
    """A 1,024-token-vocabulary llama of 512 positions (end of sequence 2), with `fields` replaced."""
    base: dict[str, Any] = dict(
        path="m",
        model_type="llama",
        vocab_size=1024,
        max_context=512,
        num_layers=1,
        kv_bytes_per_token=1,
        dtype="float32",
        device="cpu",
        eos_token_ids=[2],
        num_parameters=1,
        load_s=0.0,
    )
    return ModelInfo(**{**base, **fields})
