"""The public request and event types of the embedding API (and, later, the wire).

`Runtime.generate(GenerateRequest)` yields `TokenDelta`s, optional
`PrefillProgress` events, and exactly one `Finished`. Nothing here imports mlx
or anyio; validation of values happens in the runtime, which raises
`InvalidRequestError` with the offending field named.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import msgspec

from protocols.base import Message, Record

FinishReason = Literal["stop", "length", "cancelled", "error"]


def new_request_id() -> str:
    """An id for a request submitted without one."""
    return f"req-{uuid.uuid4().hex[:16]}"


class SamplingParams(Record, frozen=True):
    """Per-request sampling; the defaults decode greedily (mlx-lm's defaults)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Tokens (prompt included) the three penalties look back over, as in mlx-lm.
    penalty_context_size: int = 20
    seed: int | None = None
    # Logits processing (vLLM's and OpenAI's per-request controls). A request with any of these
    # does not speculate, fast-forward or jump forward (reasons in `Finished.spec`/`fill`), so
    # every token it generates is sampled under them. With a grammar they narrow its mask. When
    # they (and the grammar) leave no token at all, the request ends with an `invalid_request` error.
    # {token id: bias in [-100, 100]} added to the logits before penalties and sampling
    # (OpenAI's semantics, mlx-lm's order; at most 300 entries).
    logit_bias: dict[int, float] | None = None
    # End-of-sequence and `stop_token_ids` cannot be sampled before this many tokens were
    # generated (vLLM's semantics; stop strings still end the request). At most max_tokens.
    min_tokens: int = 0
    # Only these token ids may be sampled (a non-empty list of ids in the vocabulary).
    allowed_token_ids: list[int] | None = None
    # Strings whose tokens may not be generated (vLLM's semantics: each word is tokenized with
    # and without a leading space; a one-token word is banned outright, a longer word's last
    # token right after the generated tokens end with its others). At most 128 words.
    bad_words: list[str] | None = None

    @property
    def has_logit_controls(self) -> bool:
        """Whether any of logit_bias, min_tokens, allowed_token_ids, bad_words is set."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.allowed_token_ids is not None or bool(self.bad_words)


class DenoisingOptions(Record, frozen=True):
    """A denoising request's settings (diffusion language models; `docs/denoising.md`); None
    takes the model's default (its generation config, then mlx-vlm's)."""

    # Denoising steps per canvas at most (mlx-vlm's default 48).
    max_steps: int | None = None
    # Positions per canvas at most (the model's `canvas_length`); the last canvas is cut to
    # what `max_tokens` leaves (at least `min_canvas_length`).
    canvas_length: int | None = None
    min_canvas_length: int | None = None
    # A position is revealed once its token's probability reaches this (0.9).
    threshold: float | None = None


class GenerateRequest(Record, frozen=True):
    """One generation. Exactly one of `prompt`, `prompt_ids`, `messages` is set.

    `sampling` holds the sampler's settings and the per-request logits controls
    (`logit_bias`, `min_tokens`, `allowed_token_ids`, `bad_words`; see `SamplingParams`).
    """

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    # None: the runtime's `generation.default_max_tokens`.
    max_tokens: int | None = None
    sampling: SamplingParams = SamplingParams()
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    # Keep generating past the model's end-of-sequence tokens (benchmarks).
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Keep only the prompt's last this many tokens (after the chat template; vLLM's option).
    truncate_prompt_tokens: int | None = None
    # Score the prompt: each prompt token's log-probability given those before it, with this
    # many most likely alternatives (0-20), in the first `TokenDelta` (`prompt_logprobs`).
    # None: not scored. Such a request prefills its whole prompt (no prefix cache hit).
    prompt_logprobs: int | None = None
    request_id: str | None = None
    priority: int = 0
    # Background work (several choices or prompts of one call, scoring, batch jobs): while an
    # interactive request is live, bulk ones hold few batch slots and their prefill gets at most
    # `scheduler.bulk_share` of the engine's time, so interactive streams keep their pace.
    # A request scoring its prompt (`prompt_logprobs`) is bulk whatever this says.
    bulk: bool = False
    # Emit `PrefillProgress` events while the prompt is being processed (and, for a diffusion
    # model, a `DenoiseProgress` event per denoising step).
    report_progress: bool = False
    # Structured output, OpenAI's shapes as plain dicts: {"type": "json_schema", "json_schema":
    # {"name": ..., "schema": {...}}}, {"type": "json_object"}, plus {"type": "regex", "pattern": ...}
    # and {"type": "grammar", "ebnf": ...}.
    response_format: dict[str, Any] | None = None
    # OpenAI-style tools, rendered by the chat template; calls arrive as `ToolCall` events.
    tools: list[dict[str, Any]] | None = None
    # Also report each call as it is generated (`ToolCallDelta`s: its name, then its arguments'
    # text in fragments that add up to the `ToolCall`'s arguments).
    stream_tool_calls: bool = False
    # "auto" (the model decides), "none", "required", or {"type": "function", "function": {"name": ...}};
    # the last two constrain the output to the model's tool-call format.
    tool_choice: str | dict[str, Any] | None = None
    # Append tokens the grammar forces in one forward instead of sampling them one by one
    # (None: the runtime's default; never while logprobs or `sampling`'s logits controls are
    # requested: forced tokens would bypass them).
    jump_forward: bool | None = None
    # Keep the KV of the first `snapshot_at` prompt tokens as a prefix entry as soon as
    # prefill passes them (e.g. the end of a shared system prompt).
    snapshot_at: int | None = None
    # Save a durable checkpoint every this many generated tokens (needs `request_id`);
    # None: the runtime's `checkpoints.every_tokens` (0 there means off).
    checkpoint_every: int | None = None
    # Token fast-forwarding: "off", "strict" (the chat template's tool-call scaffold for this
    # request's tools is appended without sampling it) or "echo" (strict, plus spans copied
    # from earlier in the context, kept only as far as the model's own greedy choice agrees).
    # None: the runtime's `generation.fill`. Refused (reason in `Finished.fill`) with a
    # grammar, logprobs or `sampling`'s logits controls.
    fill: str | None = None
    # Speculative decoding: None follows the runtime (on when `[speculative]` has a draft
    # model or prompt lookup); False opts out. Never with logprobs or `sampling`'s logits
    # controls (reason in `Finished.spec`).
    speculative: bool | None = None
    # How drafted tokens are kept: "exact" (while they equal the tokens the request's own
    # sampler draws: the output is the one decoding without speculation gives, seeded sampling
    # included) or "rejection" (standard speculative sampling: the target's distribution,
    # higher acceptance). None: `speculative.acceptance`.
    acceptance: str | None = None
    # A LoRA adapter the runtime knows (`[[adapters]]` or `load_adapter`): the request's rows
    # add its delta, in the same batch as rows with other adapters or none.
    adapter: str | None = None
    # With a `ModelPool`: the model (`[[models]]` name) that serves it; None: the default one.
    model: str | None = None
    # A diffusion language model's denoising settings (refused for other models).
    denoising: DenoisingOptions | None = None


class ModelStatus(Record, frozen=True):
    """One model of a model pool (`ModelPool.models()`, the socket's `Stats.models`)."""

    name: str
    path: str
    pinned: bool
    state: Literal["resident", "loading", "unloaded"]
    # Bytes of its weights as loaded (an estimate from its files until it has been loaded once).
    weight_bytes: int
    live_requests: int
    loads: int
    # Requests it had running when it was swapped out.
    preempted: int


class AdapterInfo(Record, frozen=True):
    """A LoRA adapter the runtime knows: where it is, and (once loaded into a slot) its shape."""

    name: str
    path: str
    pinned: bool = False
    # Loaded into one of the `lora.max_resident` slots (an idle adapter may be evicted and is
    # loaded again when a request needs it).
    resident: bool = False
    rank: int = 0
    scale: float = 0.0
    # Linear layers it adds a delta to, and its weights' bytes.
    modules: int = 0
    num_bytes: int = 0
    digest: str = ""
    # Live requests holding it.
    users: int = 0


class TopLogprob(Record, frozen=True):
    token_id: int
    logprob: float


class TokenLogprob(Record, frozen=True):
    """Log-probability of a generated token, with the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[TopLogprob] | None = None
    # A scored prompt token's rank among the vocabulary (1: the most likely; `prompt_logprobs`).
    rank: int | None = None


class TokenDelta(Message, frozen=True):
    """New tokens of one request and the text they completed.

    With tools, tool-call markup is reported as `ToolCall`s instead of text; a leading
    `<think>` block goes to `reasoning`. `token_ids` always has every token.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    # In the first delta of a request that asked (`GenerateRequest.prompt_logprobs`): prompt
    # tokens 1 on, each scored given those before it (the first prompt token has no score).
    prompt_logprobs: list[TokenLogprob] | None = None


class ToolCall(Message, frozen=True):
    """A tool call parsed from the output; `arguments` is a JSON object as text."""

    request_id: str
    index: int
    id: str
    name: str
    arguments: str
    # The output ended inside the call (max_tokens): `arguments` is the text generated so far,
    # not valid JSON.
    truncated: bool = False


class ToolCallDelta(Message, frozen=True):
    """Part of the tool call `index` as it is generated (with `GenerateRequest.stream_tool_calls`):
    first its `id` and `name`, then fragments of its arguments' text; the `ToolCall` with the
    same index follows when the call is complete."""

    request_id: str
    index: int
    id: str
    name: str | None = None
    arguments: str = ""


class PrefillProgress(Message, frozen=True):
    """Prompt processing progress, sent only when the request asked for it."""

    request_id: str
    processed_tokens: int
    total_tokens: int


class DenoiseProgress(Message, frozen=True):
    """A denoising step's progress (a diffusion model's request that asked for progress): the
    canvas (or block) being denoised, counted from 1, its step, and how many of its positions
    are revealed (final) of how many."""

    request_id: str
    canvas: int
    step: int
    revealed: int
    positions: int


class Usage(Record, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Timings(Record, frozen=True):
    """Seconds and rates measured by the runtime for one request."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    # From the first prefill chunk (or admission) to the first token, and from the first
    # token to the last.
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # Prompt tokens actually prefilled (cached ones excluded) per prefill second.
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


class FillStats(Record, frozen=True):
    """What token fast-forwarding did for one request (`Finished.fill`)."""

    mode: str
    # Why fast-forwarding did not run at all (grammar, logprobs), or why echo spans did not.
    refused: str | None = None
    echo_refused: str | None = None
    # Spans that put at least one token into the output, and the tokens they put there.
    events: int = 0
    injected: int = 0
    strict: int = 0
    echo: int = 0
    span_lens: list[int] = msgspec.field(default_factory=list)
    # Spans shortened by a clamp (end of sequence, delimiter, maximum span, max_tokens).
    truncated: int = 0
    # Tokens the model sampled itself.
    decode_steps: int = 0
    # Echo spans that reached a forward, and their tokens the model agreed with or not.
    verify_events: int = 0
    verify_accepted: int = 0
    verify_rejected: int = 0


class SpecStats(Record, frozen=True):
    """What speculative decoding did for one request (`Finished.spec`)."""

    # "draft" (a draft model) or "lookup" (n-grams of the request's own context).
    method: str
    acceptance: str
    # Why the request did not speculate at all.
    refused: str | None = None
    # Rounds (a draft checked by one target forward), tokens proposed, kept and thrown away.
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    # accepted_by_position[i]: rounds that kept at least i + 1 drafted tokens.
    accepted_by_position: list[int] = msgspec.field(default_factory=list)
    # Tokens the request generated, and the target forwards that produced them (one per plain
    # step or round): their difference is the forwards speculation saved.
    generated: int = 0
    target_forwards: int = 0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.target_forwards if self.target_forwards else 0.0

    @property
    def forwards_saved(self) -> int:
        return self.generated - self.target_forwards


class SpecTotals(Record, frozen=True):
    """Speculative decoding over the requests that speculated and ended so far
    (`rt.stats().scheduler.spec`)."""

    requests: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    target_forwards: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.target_forwards if self.target_forwards else 0.0

    def add(self, stats: SpecStats) -> SpecTotals:
        return SpecTotals(
            requests=self.requests + 1,
            rounds=self.rounds + stats.rounds,
            drafted=self.drafted + stats.drafted,
            accepted=self.accepted + stats.accepted,
            generated=self.generated + stats.generated,
            target_forwards=self.target_forwards + stats.target_forwards,
        )


class CheckpointReport(Record, frozen=True):
    """What became of a request's durable checkpoints (`Finished.checkpoint`), as known when
    it ended: writes confirmed, writes that failed, and the last failure's reason."""

    written: int = 0
    failed: int = 0
    error: str | None = None


class Finished(Message, frozen=True):
    """The last event of every request."""

    request_id: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings = Timings()
    # The stop string that ended the request, when one did.
    stop_sequence: str | None = None
    error: str | None = None
    # Token fast-forwarding figures, when the request asked for it.
    fill: FillStats | None = None
    # Checkpoint writes, for requests that asked for checkpoints.
    checkpoint: CheckpointReport | None = None
    # Speculative decoding figures, when the runtime speculates.
    spec: SpecStats | None = None
    # With finish_reason "error": the error's code (`protocols.errors`), e.g. "unavailable"
    # when a rank of a distributed world died under the request.
    error_code: str | None = None
    # A denoising request (a diffusion model): the denoising steps its answer took.
    denoising_steps: int | None = None


Event = TokenDelta | ToolCall | ToolCallDelta | PrefillProgress | DenoiseProgress | Finished
