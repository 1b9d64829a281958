"""A new request's engine-side state, and giving it back (MLX thread).

`RequestStarts.start` takes what an admitted request needs before its first forward: its
grammar matcher, fill session, KV (from a checkpoint, a prefix entry or the disk tier),
rotary shift, speculation and adapter slot. `free` gives back what it holds, at its end and
after a failed start alike.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.errors import EngineInvariantError
from engine.kv import caches
from engine.kv.prefixes import PrefixEntries
from engine.kv.tables import RequestBlocks
from engine.lora import AdapterBank
from engine.sequence import Sequence
from engine.speculation import Speculator
from policies.fill_session import FillSession
from protocols.api import FillStats
from protocols.model import GrammarSpec, LayerLayout


class Grammars(Protocol):
    """What the engine needs of the grammar compiler: matchers for grammars compiled (and
    pinned) before their requests were admitted (a follower rank compiles when first asked)."""

    vocab_size: int

    def matcher(self, spec: GrammarSpec) -> Any: ...


class RequestStarts:
    """Starts and frees requests against the engine's long-lived parts (none is replaced by
    `Engine.reset`, so these references stay valid)."""

    def __init__(
        self,
        model,
        layout: list[LayerLayout],
        *,
        grammars: Grammars | None,
        to_text: Any,
        blocks: RequestBlocks,
        prefixes: PrefixEntries,
        speculator: Speculator,
        adapters: AdapterBank,
    ):
        self.model = model
        self.layout = layout
        self.grammars = grammars
        # Token ids to text, for fast-forwarding's tool-call context and trace (as `Engine`'s `decode`).
        self.to_text = to_text
        self.blocks = blocks
        self.prefixes = prefixes
        self.speculator = speculator
        self.adapters = adapters

    def start(self, seq: Sequence) -> None:
        """A new request's state: grammar, fill session, its KV (from a checkpoint or a prefix
        entry), speculation, its adapter slot. Each thing taken is recorded on `seq` as it is
        taken, so `free` gives back exactly what was, wherever this stops."""
        admit = seq.admit
        if admit.grammar is not None:
            if self.grammars is None:
                raise EngineInvariantError("a grammar request reached an engine without grammars")
            seq.matcher = self.grammars.matcher(admit.grammar)
        resumed = admit.resume.generated if admit.resume is not None else []
        if admit.fill is not None:
            stats = FillStats(mode=admit.fill.mode, echo_refused=admit.fill.echo_refused)
            seq.fill = FillSession(admit.fill, stats, admit.prompt_ids, self.to_text)
            seq.fill.replay(resumed)
        for token in resumed:  # a resumed request's grammar state: its output so far, replayed
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                raise ValueError(f"the checkpoint's output does not follow its grammar at token {token}")
        if admit.resume is not None:
            seq.generated = list(resumed)
            seq.num_generated = len(resumed)
            if admit.resume.num_kv_tokens != len(admit.context_ids) - 1:
                raise EngineInvariantError(f"checkpoint covers {admit.resume.num_kv_tokens} tokens, expected {len(admit.context_ids) - 1}")
            restored = caches.from_tensors(admit.resume.kv_tensors, self.layout, admit.resume.num_kv_tokens)
            seq.cache = self.blocks.into_pool(seq, restored, admit.resume.num_kv_tokens)
            seq.num_prefilled = admit.resume.num_kv_tokens
        elif admit.prefix_entry is not None:
            n = admit.prefix_tokens
            seq.cache = self.prefixes.seed(admit.prefix_entry, n, seq)
            seq.num_prefilled = n
        elif admit.disk_prefix is not None:
            disk, n = admit.disk_prefix, admit.disk_prefix.num_tokens
            if not 0 < n < seq.prompt_len:
                raise EngineInvariantError(f"a disk prefix of {n} tokens cannot seed a {seq.prompt_len}-token prompt")
            restored = caches.from_arrays(disk.arrays, self.layout, n)
            seq.cache = self.blocks.into_pool(seq, restored, n)
            seq.num_prefilled = n
            if admit.save_prefix:  # kept in RAM too: the next request with this prefix need not read it
                self.prefixes.save(seq, caches.trimmed(seq.cache, n), n)
        if admit.vision is not None and getattr(self.model, "explicit_positions", False):
            if admit.vision.arrays:
                seq.vision_positions, seq.position_shift = self.model.prompt_positions(admit.prompt_ids, admit.vision.arrays)
            else:  # resumed: its KV holds the prompt; only the shift after it is needed
                seq.position_shift = admit.vision.position_shift
        if admit.spec is not None:
            self.speculator.start(seq)
        if admit.adapter is not None:
            seq.adapter_slot = self.adapters.acquire(admit.adapter, admit.adapter_digest)

    def free(self, seq: Sequence) -> None:
        """Give back what a request holds: its blocks (the prefix entry's shared ones among
        them), its draft model state, its adapter slot. The one place for this, at a request's
        end and after a failed admission alike (a grammar matcher holds nothing of the engine's)."""
        self.blocks.release(seq)
        self.speculator.release(seq.request_id)
        if seq.adapter_slot and seq.admit.adapter is not None:
            self.adapters.release(seq.admit.adapter)
            seq.adapter_slot = 0
