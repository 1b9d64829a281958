"""Recording what code under test touches, to assert what it did not do (instead of timing it)."""

from __future__ import annotations

import builtins
import io
from pathlib import Path

import pytest


def record_opens(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file opened through `open`, `io.open` or `Path.open` from now on (any thread), resolved,
    in order; the files still open normally."""
    opened: list[Path] = []
    real_open = builtins.open

    def recording_open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, Path)):
            opened.append(Path(file.decode() if isinstance(file, bytes) else file).resolve())
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    monkeypatch.setattr(io, "open", recording_open)
    return opened
