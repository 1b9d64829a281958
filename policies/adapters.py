"""LoRA adapter decisions (pure): identity, the prefix cache's namespaces, slot admission.

- `adapter_digest`: what ties KV and checkpoints to an adapter's exact weights (its config
  and weights files, hashed; `digest_of` the bytes already read): an adapter reloaded from
  changed files is another adapter.
- `prefix_namespace`: KV computed under an adapter seeds only requests of that adapter.
- `AdapterSlots`: a request whose adapter is not held by a live request starts only while a
  slot is left for it (`lora.max_resident`): the others wait, like requests waiting for KV.
- `AdapterRegistry`: the adapters known, by name, on the async side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from protocols.api import AdapterInfo

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapters.safetensors"
_READ = 1 << 20


def adapter_digest(directory: str | Path) -> str:
    """sha256 over the adapter's config and weights files (blocking: run off the event loop)."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(Path(directory) / name, "rb") as f:
            while chunk := f.read(_READ):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def digest_of(config: bytes, weights: bytes) -> str:
    """`adapter_digest` of files already read (the digest of the very bytes that are parsed)."""
    digest = hashlib.sha256()
    for data in (config, weights):
        digest.update(data)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def prefix_namespace(adapter: str | None, digest: str) -> str | None:
    """The prefix cache's namespace for KV computed under `adapter` (None: the base model)."""
    return None if adapter is None else f"{adapter}@{digest}"


class AdapterSlots:
    """Whether a request with `adapter` may start while `live` adapters are held (pinned
    adapters, from `registry`, hold a slot each whether used or not)."""

    def __init__(self, max_resident: int, registry: AdapterRegistry | None = None):
        self.max_resident = max_resident
        self.registry = registry

    def allows(self, adapter: str | None, live: Iterable[str | None]) -> bool:
        if adapter is None:
            return True
        held = {name for name in live if name is not None}
        if self.registry is not None:
            held |= {a.name for a in self.registry.list() if a.pinned}
        return adapter in held or len(held) < self.max_resident


class AdapterRegistry:
    """The adapters the runtime knows, as the model actor last reported them (async side):
    what admission checks a request's `adapter` against, and the digest it is admitted with."""

    def __init__(self, adapters: Iterable[AdapterInfo] = ()):
        self._by_name = {a.name: a for a in adapters}

    def update(self, adapters: Iterable[AdapterInfo]) -> None:
        self._by_name = {a.name: a for a in adapters}

    def get(self, name: str) -> AdapterInfo | None:
        return self._by_name.get(name)

    def list(self) -> list[AdapterInfo]:
        return [self._by_name[name] for name in sorted(self._by_name)]
