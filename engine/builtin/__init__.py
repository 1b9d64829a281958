"""Deterministic, random-weight mlx-lm model directories for tests, demos and benchmarks.

``ensure_builtin("tiny")`` returns a directory that ``mlx_lm.utils.load`` loads offline
(model + tokenizer with a ChatML chat template), building and caching it on first use.
"""

from engine.builtin.models import (
    BUILTIN_MODELS,
    BuiltinSpec,
    UnknownBuiltinModelError,
    builtin_name,
    ensure_builtin,
)

__all__ = [
    "BUILTIN_MODELS",
    "BuiltinSpec",
    "UnknownBuiltinModelError",
    "builtin_name",
    "ensure_builtin",
]
