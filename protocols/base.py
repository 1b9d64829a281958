"""Base classes shared by every message in the project.

Messages are immutable `msgspec.Struct`s tagged with their class name so that a
union of them decodes without ambiguity, on the wire and in tests alike.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import msgspec


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True):
    """A tagged, immutable message; the tag is the class name."""


class Record(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An immutable, untagged value embedded in messages."""


T_contra = TypeVar("T_contra", contravariant=True)


class Reply(Protocol[T_contra]):
    """Where a request's single answer goes; `send_nowait` never blocks."""

    def send_nowait(self, value: T_contra, /) -> None: ...
