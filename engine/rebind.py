"""Rebinding a function mlx-lm's model modules import by name, for one model's modules only."""

from __future__ import annotations

import sys
from collections.abc import Callable


def rebind(model, name: str, original: Callable, replacement: Callable) -> list[str]:
    """Bind `name` to `replacement` in the modules `model`'s classes come from, where it is
    `original` (mlx-lm's own function, imported by name); returns the modules rebound. The
    replacement falls back to `original` for every caller it does not serve."""
    names = {type(model).__module__} | {type(module).__module__ for _, module in model.named_modules()}
    # (Never the module `original` is defined in: a model class of its own there, as gpt-oss's
    # `SwigluOAI` in `activations`, would rebind the function for every user of mlx-lm.)
    names.discard(getattr(original, "__module__", None))
    rebound = []
    for module_name in sorted(names):
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, name, None) is original:
            setattr(module, name, replacement)
            rebound.append(module_name)
    return rebound
