"""One admitted request's engine-side state, a dispatched step not read yet, the
checkpoints of rows that are due one, and the prompt-end KV of rows that want it kept."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import structlog

from engine.errors import EngineInvariantError
from engine.kv import caches
from engine.sampler import SampleResult
from policies.fill_session import FillSession, Proposal
from policies.speculation import LookupSource, SpecRow
from protocols.api import TokenLogprob
from protocols.model import AdmitRequest, CheckpointData, LayerLayout

if TYPE_CHECKING:
    from engine.batch import DecodeBatch

log = structlog.get_logger(actor="engine")


@dataclass
class Sequence:
    """One admitted request's engine-side state."""

    admit: AdmitRequest
    stop_ids: frozenset[int]
    # Its KV while it is out of the decode batch (prefilling, parked): per-layer caches.
    cache: list | None = None
    # Paged KV (`engine.kv.paged`): the blocks holding its positions, from admission to release
    # (the batch row reads this very list), the first `num_shared` a prefix entry's too.
    table: list[int] = field(default_factory=list)
    num_shared: int = 0
    # The latest prefix entry kept from it, and how many of its table's blocks that holds.
    saved_entry: tuple[str, int] | None = None
    num_prefilled: int = 0
    num_generated: int = 0
    in_batch: bool = False
    joined: bool = False
    # Its caller is not reading: kept out of the batch (KV in `cache`) until unparked.
    parked: bool = False
    # Grammar state, and known tokens after the last sampled one (fed with it next step):
    # grammar-forced or fast-forwarded ones, already emitted, or an echo span to verify.
    matcher: Any = None
    extra: list[int] = field(default_factory=list)
    fill: FillSession | None = None
    verify: Proposal | None = None
    # A strict span whose model choices the trace wants from the next step.
    trace: Proposal | None = None
    generated: list[int] = field(default_factory=list)
    # A checkpoint was asked for and is taken at the first step end that can (no known
    # tokens waiting to be forwarded).
    checkpoint_due: bool = False
    # Models whose prefix entries are used whole: the KV of the whole prompt is to be offered
    # to the prefix cache once a step has forwarded its last token (`capture_prompt_ends`).
    prompt_end_due: bool = False
    # Why this request failed on its own (its grammar, its fill session); it ends with
    # `error` when its in-flight token is collected, and the batch goes on.
    failure: str | None = None
    # An echo span on a model with recurrent state: the state before the span and the tokens
    # forwarded from there, to replay the accepted prefix if the span's tail is rejected.
    snapshot: list | None = None
    replay: list[int] = field(default_factory=list)
    # Speculative decoding: the row's adaptive state, its prompt-lookup index, and the draft
    # forwarded this step for the sampler to check (also in `extra`).
    spec: SpecRow | None = None
    # The adapter slot its forwards are routed to (0: none).
    adapter_slot: int = 0
    # An image prompt's vision tower being evaluated a unit at a time (`engine.model.vision.
    # TowerRun`), then its input embeddings (1, prompt, hidden), kept until prefill has passed
    # the last image position.
    tower: Any = None
    vision_embeds: Any = None
    # Models with explicit rotary positions (Qwen-VL's mRoPE): the prompt's positions (3, 1,
    # prompt), and what positions after it add to the cache position (the image's delta).
    vision_positions: Any = None
    position_shift: int = 0
    lookup: LookupSource | None = None
    draft: list[int] | None = None
    # The prompt tokens its prefill scored (`AdmitRequest.prompt_logprobs`), token 1 on.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def tokens_with_kv(self, length: int) -> list[int]:
        """The tokens whose KV the first `length` cache positions hold."""
        tokens = self.admit.cache_ids + self.generated
        if length > len(tokens):
            raise EngineInvariantError(f"cache of {length} positions but only {len(tokens)} tokens known")
        return tokens[:length]

    @property
    def request_id(self) -> str:
        return self.admit.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.admit.prompt_ids)

    @property
    def context(self) -> list[int]:
        """Prompt and generated tokens; the last one is the next decode input until the row joins."""
        return self.admit.prompt_ids + self.generated

    @property
    def is_ready(self) -> bool:
        """Prefill is done: the cache covers the prompt but its last token (more, after a park)."""
        return not self.joined and not self.parked and self.prompt_len - 1 <= self.num_prefilled <= len(self.context) - 1

    @property
    def needs_token_before_next_step(self) -> bool:
        """Its next step depends on the token in flight: a grammar mask, a fast-forward span,
        an echo span's verdict (the rejected tail is rewound before anything else is written),
        or a checkpoint that is due."""
        needs = self.matcher is not None or (self.fill is not None and self.fill.active) or self.verify is not None or self.draft is not None
        needs = needs or (self.spec is not None and self.spec.drafts_next)
        # A checkpoint is captured between a step's read and the next dispatch.
        return needs or self.checkpoint_due


@dataclass
class InFlight:
    """A dispatched decode step whose tokens have not been read yet.

    Rows are the `Sequence` objects themselves, not ids: a request id may be
    reused once its request has ended, and a stale token must not reach the new one.
    """

    rows: list[Sequence]
    result: SampleResult | None = None
    # Rows that appended known tokens first, with each position's greedy choice (for the
    # fast-forward trace), and the rows whose spans the sampler checked (echo spans, drafts)
    # with how many of each span's tokens it kept.
    appended: list[Sequence] = field(default_factory=list)
    choices: mx.array | None = None
    verified: list[Sequence] = field(default_factory=list)
    verified_sampling: list[Any] = field(default_factory=list)
    accepted: mx.array | None = None

    @property
    def has_first_tokens(self) -> bool:
        """Some row samples its first token in this step (read it at once: early token zero)."""
        return any(seq.num_generated == 0 for seq in self.rows)

    @property
    def must_be_read_first(self) -> bool:
        """Some row needs this step's token before the next step can be built."""
        return any(seq.needs_token_before_next_step for seq in self.rows)


def capture_checkpoints(seqs: Iterable[Sequence], batch: DecodeBatch, layout: list[LayerLayout], in_flight: list[Sequence]) -> list[CheckpointData]:
    """The checkpoints that are due and possible now, between a step's read and the next
    dispatch: a row's state then covers exactly its context but the last token (the pending
    input). A row with a token in flight or known tokens waiting is taken at the next chance. A
    failed capture skips that checkpoint and is logged, never fails the step."""
    flying = {id(seq) for seq in in_flight}
    taken = []
    for seq in seqs:
        if not (seq.checkpoint_due and seq.in_batch and seq.generated and not seq.extra) or id(seq) in flying:
            continue
        seq.checkpoint_due = False
        num_kv = len(seq.context) - 1
        try:
            held = batch.lengths[batch.index(seq.request_id)]
            if held != num_kv:
                raise EngineInvariantError(f"row holds {held} positions, expected {num_kv}")
            tensors = caches.to_tensors(batch.extract(seq.request_id), layout, num_kv)
        except Exception:
            log.exception("checkpoint_failed", request_id=seq.request_id)
            continue
        admit = seq.admit
        taken.append(
            CheckpointData(seq.request_id, list(seq.generated), num_kv, tensors, adapter_digest=admit.adapter_digest, position_shift=seq.position_shift)
        )
    return taken


def capture_prompt_ends(seqs: Iterable[Sequence], batch: DecodeBatch, in_flight: list[Sequence]) -> list[tuple[Sequence, list]]:
    """The rows that want their prompt's KV kept (`Sequence.prompt_end_due`) and hold exactly
    the prompt now, between a step's read and the next dispatch (after their first token is
    read: the last prompt token is forwarded, the first generated one pending), each with its
    row's caches (`DecodeBatch.extract`). A row with a token in flight is taken at the next
    chance; one already past its prompt (it fed more than a token in a step) never is. A
    failed capture is logged and skipped, never fails the step."""
    flying = {id(seq) for seq in in_flight}
    taken = []
    for seq in seqs:
        if not (seq.prompt_end_due and seq.in_batch) or id(seq) in flying:
            continue
        held = batch.lengths[batch.index(seq.request_id)]
        if held < seq.prompt_len:
            continue  # its last prompt token is still the pending input
        seq.prompt_end_due = False
        if held > seq.prompt_len:
            continue
        try:
            taken.append((seq, batch.extract(seq.request_id)))
        except Exception:
            log.exception("prompt_end_capture_failed", request_id=seq.request_id)
    return taken
