"""Inbox of the model lease actor: step plans in, step outcomes out.

The scheduler sends one `RunStep` at a time and waits for its `StepOutcome`.
A plan names requests by id; the engine on the MLX thread owns their caches.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from protocols.api import AdapterInfo, DenoisingOptions, FillStats, SamplingParams, SpecStats, TokenLogprob
from protocols.base import Message, Record, Reply
from protocols.config import Pooling


class GrammarSpec(Record, frozen=True):
    """A grammar to constrain a request, as plain data (compiled by `runtime.grammar`)."""

    # "json_schema", "json_object", "regex", "ebnf" or "tool_call" (source: the tools, as JSON).
    kind: str
    source: str = ""


class FillRow(Record, frozen=True):
    """A strict fast-forward row: when the output ends with `trigger`, `emit` follows.

    Both are sliced out of a full chat-template rendering of a call of the request's
    tools (never encoded in isolation), so they are the tokens that rendering holds.
    """

    trigger: list[int]
    emit: list[int]
    # "scaffold" (the call's opening), "name" (a tool's name and what follows it up to the
    # arguments), or "close" (the end of a call whose one required argument is complete).
    kind: str


class FillPlan(Record, frozen=True):
    """A request's token fast-forwarding: strict rows, the echo source, and their clamps."""

    mode: str
    rows: list[FillRow]
    # End-of-sequence ids: a span is cut before the first one.
    eos: list[int]
    # Ids that may end an echo span (a closing quote after an argument value), never continue it.
    delimiters: list[int] = msgspec.field(default_factory=list)
    max_span: int = 32
    # Echo spans: copied after a `echo_k`-token anchor matches earlier context (0: off).
    echo_k: int = 0
    echo_candidates: int = 24
    echo_refused: str | None = None
    # For the tool-call context that guards strict rows.
    tools: list[dict] = msgspec.field(default_factory=list)
    tool_markers: tuple[str, str] | None = None
    think_markers: tuple[str, str] | None = None
    starts_in_reasoning: bool = False
    # Append one JSON line per span (proposed ids next to the model's own choices) here.
    trace_path: str | None = None


class ResumeState(Record, frozen=True):
    """Where a checkpointed request left off: its cache covers the prompt and all
    `generated` tokens but the last, which is the pending input of the next step."""

    generated: list[int]
    num_kv_tokens: int
    # safetensors bytes: keys_<layer>, values_<layer>, each [1, heads, num_kv_tokens, dim].
    kv_tensors: bytes


class DiskPrefix(Record, frozen=True):
    """A saved prefix read back from the disk tier (`kv.disk_cache_dir`): the KV of the first
    `num_tokens` prompt tokens, as the numpy arrays a checkpoint of `num_tokens` positions
    holds, by tensor name (`policies.layout.tensor_shapes`), assembled off the MLX thread from
    chunk files (full-attention models) or one whole entry saved at exactly `num_tokens`
    (windows and recurrent state are only valid where they were saved)."""

    num_tokens: int
    arrays: Any
    num_files: int = 1
    num_bytes: int = 0
    # When the read began and ended (monotonic seconds: the request's "disk_read" span).
    started: float = 0.0
    ended: float = 0.0


class SpecPlan(Record, frozen=True):
    """A request's speculative decoding: where drafts come from, how they are kept, and the
    longest draft per round."""

    method: Literal["draft", "lookup"]
    acceptance: Literal["exact", "rejection"] = "exact"
    max_draft: int = 6
    # Prompt lookup: the anchor (n-gram) a draft needs.
    lookup_anchor: int = 2
    # False: always draft `max_draft` tokens.
    adaptive: bool = True


class VisionPrompt(Record, frozen=True):
    """An image prompt's inputs (vision-language models): the processor's arrays (numpy:
    pixel values and masks, by the names the model's `get_input_embeddings` takes), the images'
    sha256 digests in prompt order, and the prompt ids as the prefix cache keys them (each
    image position an id past the vocabulary named by the digests: `policies.images.key_ids`)."""

    arrays: dict[str, Any]
    digests: list[str]
    key_ids: list[int]
    # A resumed image prompt (no arrays): what its rotary positions add after the prompt
    # (Qwen-VL's mRoPE delta; 0 for other models).
    position_shift: int = 0

    def image_end(self, prompt_ids: list[int]) -> int:
        """One past the last image position (where the cache keys differ from the ids)."""
        return 1 + max((i for i, (key, token) in enumerate(zip(self.key_ids, prompt_ids)) if key != token), default=-1)

    def needs_tower(self, prompt_ids: list[int], num_prefilled: int) -> bool:
        """Whether prefill from `num_prefilled` reaches image positions the KV lacks."""
        return bool(self.arrays) and num_prefilled < self.image_end(prompt_ids)


class AdmitRequest(Record, frozen=True):
    """A request entering the engine; no compute happens until it is prefilled."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    # The seed actually used (the request's, or one the runtime drew for it).
    seed: int
    # Sampling one of these ends the request (EOS ids plus the request's own).
    stop_token_ids: list[int]
    # `sampling.bad_words` as token-id sequences (each word with and without a leading space,
    # tokenized at admission): a one-token sequence is never sampled, a longer one's last
    # token not right after the generated tokens end with the rest.
    bad_words_ids: list[list[int]] = msgspec.field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    # Score the prompt in its prefill: each prompt token's log-probability given the tokens
    # before it, with this many alternatives (None: not scored; such a request never starts
    # from a saved prefix, whose positions would not be forwarded).
    prompt_logprobs: int | None = None
    # Start from the first `prefix_tokens` of this saved prefix entry instead of prefilling them.
    prefix_entry: str | None = None
    prefix_tokens: int = 0
    # Or start from KV read back from the disk tier (kept as a prefix entry once seeded).
    disk_prefix: DiskPrefix | None = None
    # Offer the request's KV to the prefix cache when it ends, and the first
    # `snapshot_at` prompt tokens' KV as soon as prefill reaches them.
    save_prefix: bool = True
    snapshot_at: int | None = None
    resume: ResumeState | None = None
    grammar: GrammarSpec | None = None
    # Append grammar-forced tokens in one multi-token forward (jump-forward decoding).
    jump_forward: bool = False
    fill: FillPlan | None = None
    spec: SpecPlan | None = None
    # The LoRA adapter its rows add (None: the base model), and the digest it was admitted
    # with (KV and checkpoints belong to those weights).
    adapter: str | None = None
    adapter_digest: str = ""
    vision: VisionPrompt | None = None
    # A diffusion language model's request: its answer is denoised a canvas at a time.
    denoise: DenoisingOptions | None = None

    @property
    def cache_ids(self) -> list[int]:
        """The prompt as the prefix cache keys it: its ids, or an image prompt's key ids."""
        return self.vision.key_ids if self.vision is not None else self.prompt_ids

    @property
    def context_ids(self) -> list[int]:
        """Every token the request has seen: the prompt, then what it generated before a resume."""
        return self.prompt_ids + self.resume.generated if self.resume is not None else self.prompt_ids


class SavedPrefix(Record, frozen=True):
    """KV the engine kept when a request ended: `tokens` exactly cover it."""

    entry_id: str
    tokens: list[int]
    num_bytes: int
    # The adapter the KV was computed under (None: the base model).
    adapter: str | None = None
    # Paged KV: the entry whose first blocks this one shares (the one its request was seeded
    # from, or an earlier entry of the same request), and those blocks' bytes, which
    # `num_bytes` leaves out (the parent counts them while it is kept).
    parent: str | None = None
    shared_bytes: int = 0


class CheckpointData(Record, frozen=True):
    """A request's exact decode state, captured at a step boundary."""

    request_id: str
    generated: list[int]
    num_kv_tokens: int
    kv_tensors: bytes
    # The digest of the LoRA adapter the KV was computed under ("" for none).
    adapter_digest: str = ""
    # An image prompt's rotary shift after the prompt (`VisionPrompt.position_shift`).
    position_shift: int = 0


class PrefillWork(Record, frozen=True):
    """Forward the next `num_tokens` prompt tokens of one request into its cache; or, with
    `encode`, run a unit of an image prompt's vision tower worth about `num_tokens` of them."""

    request_id: str
    num_tokens: int
    encode: bool = False


class StepPlan(Record, frozen=True):
    """What one engine step does, in this order: release, admit, park/unpark,
    prefill, decode, then checkpoints of the rows still decoding."""

    release: list[str] = msgspec.field(default_factory=list)
    admit: list[AdmitRequest] = msgspec.field(default_factory=list)
    prefill: list[PrefillWork] = msgspec.field(default_factory=list)
    # Run one batched decode step over every request whose prompt is done.
    decode: bool = False
    # Capture these decoding requests' state at the end of the step.
    checkpoint: list[str] = msgspec.field(default_factory=list)
    # Stop decoding these (their callers are not reading), keeping their KV; restart these.
    park: list[str] = msgspec.field(default_factory=list)
    unpark: list[str] = msgspec.field(default_factory=list)
    # Checkpoints deleted since the last step (the engine ignores this; in a distributed world
    # each follower deletes its shard of them).
    forget_checkpoints: list[str] = msgspec.field(default_factory=list)
    # Denoising requests (diffusion models) that run one denoising step each.
    denoise: list[str] = msgspec.field(default_factory=list)
    # Every live request is bulk work (`GenerateRequest.bulk`): embedding forwards need not yield
    # to this step's (after any other step they keep to `scheduler.bulk_share` of the thread for
    # a while). The engine ignores this.
    bulk_only: bool = False


class RowOutput(Record, frozen=True):
    """Tokens a request produced in a step, and whether it ended there."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    # "error": the request failed on its own (its grammar, its fill plan, its checkpoint);
    # the rest of the batch goes on.
    finish_reason: Literal["stop", "length", "error"] | None = None
    # The stop token that ended the request; it is not part of `token_ids`.
    stop_token_id: int | None = None
    # The request's fast-forwarding figures so far, for rows that fast-forward.
    fill: FillStats | None = None
    # Its speculative decoding figures so far, for rows that speculate.
    spec: SpecStats | None = None
    error: str | None = None
    # The error's code when the request itself is at fault (`protocols.errors`: an adapter
    # unloaded while it waited is `adapter_not_found`); None: the server's own failure.
    error_code: str | None = None


class DenoiseReport(Record, frozen=True):
    """A denoising step of a request: its canvas (from 1), the step (from 1), revealed positions."""

    request_id: str
    canvas: int
    step: int
    revealed: int
    positions: int


class PrefillReport(Record, frozen=True):
    request_id: str
    processed_tokens: int
    total_tokens: int
    # With `AdmitRequest.prompt_logprobs`: the prompt tokens this chunk scored, in order.
    prompt_logprobs: list[TokenLogprob] | None = None
    # After a vision tower unit (`PrefillWork.encode`): whether units remain.
    encoding: bool = False


class DeviceMemory(Record, frozen=True):
    """MLX's memory figures (`mx.get_active_memory` and friends), in bytes."""

    active: int = 0
    peak: int = 0
    cache: int = 0


class KvPool(Record, frozen=True):
    """The paged KV pool (`kv.block_size`), in blocks: allocated, held by requests and prefix
    entries, free, held by more than one holder (a prefix entry and the requests seeded from
    it), and the positions held blocks leave unused past their holders' ends (internal
    fragmentation; the pool's one scratch block, for padding, is in `capacity` only)."""

    block_size: int
    capacity: int
    used: int
    free: int
    shared: int
    unused_positions: int
    block_bytes: int = 0


class StepOutcome(Record, frozen=True):
    """Everything a step produced. Requests in `outputs` with a finish reason are gone."""

    outputs: list[RowOutput]
    prefilled: list[PrefillReport]
    released: list[str]
    num_decode_rows: int
    # KV tokens held per live request, and bytes held by all caches (prefix entries included).
    kv_tokens: dict[str, int]
    kv_bytes: int
    step_s: float
    saved_prefixes: list[SavedPrefix] = msgspec.field(default_factory=list)
    checkpoints: list[CheckpointData] = msgspec.field(default_factory=list)
    # Bytes of the resident LoRA adapters' stacks.
    adapter_bytes: int = 0
    # MLX's own figures after the step: memory in use, its peak, and freed buffers it keeps.
    device: DeviceMemory | None = None
    # Of kv_bytes, quantized KV (packed words, scales and biases; `kv.bits`).
    kv_quantized_bytes: int = 0
    # The paged pool (`kv.block_size`; its held blocks' bytes are in kv_bytes), and the
    # most KV bytes held after any step so far.
    kv_pool: KvPool | None = None
    kv_peak_bytes: int = 0
    # The denoising steps this step ran (a diffusion model's).
    denoised: list[DenoiseReport] = msgspec.field(default_factory=list)


class StateArray(Record, frozen=True):
    """One array of a recurrent layer's state: its shape without the batch axis, and dtype
    ("" and no shape: the model leaves it unset)."""

    shape: list[int]
    dtype: str


class LayerLayout(Record, frozen=True):
    """What one layer keeps per request, as the model's own `make_cache()` says.

    - "full": attention over every position (mlx-lm `KVCache`): `heads` x (`key_dim` +
      `value_dim`) per token;
    - "window": sliding-window attention (`RotatingKVCache`): the same per token, for at
      most `window` positions;
    - "state": recurrent or convolution state (`ArraysCache`): `states`, fixed per request;
    - "list": several of the above in one layer (`CacheList`): `parts`.

    A "full" layer with `kv_bits` (4 or 8, `kv.bits`) stores every position's keys and values
    quantized per `kv_group_size` elements (packed, scales, biases: `engine.kv.quantized`), and its
    first `kv_start` positions in full precision too, which attention reads instead. A float
    "full" layer with `kv_block` keeps its positions in a block pool of `kv_block`-position
    blocks shared by every request (`kv.block_size`: `engine.kv.paged`).
    """

    kind: Literal["full", "window", "state", "list"]
    heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    dtype: str = ""
    window: int = 0
    states: list[StateArray] = msgspec.field(default_factory=list)
    parts: list[LayerLayout] = msgspec.field(default_factory=list)
    kv_bits: int = 0
    kv_group_size: int = 0
    kv_start: int = 0
    kv_block: int = 0


class ModelInfo(Record, frozen=True):
    """Facts about the loaded model that the async side needs."""

    path: str
    model_type: str
    vocab_size: int
    max_context: int
    num_layers: int
    kv_bytes_per_token: int
    dtype: str
    device: str
    eos_token_ids: list[int]
    num_parameters: int
    load_s: float
    # The bytes of weights one decode step reads as held (`engine.model.weights.decode_weight_bytes`;
    # 0: not a fixed count, as in a mixture of experts).
    decode_weight_bytes: int = 0
    # Digests that tie checkpoints to this model and tokenizer.
    model_id: str = ""
    tokenizer_id: str = ""
    # What each layer keeps per request (attention KV, sliding windows, recurrent state).
    layers: list[LayerLayout] = msgspec.field(default_factory=list)
    # The most UTF-8 bytes one token's text can have (bounds prompt text by the context).
    max_token_bytes: int = 0
    # What the load did with quantized weights ("" for a model that is not quantized).
    quantization: str = ""
    # In a distributed world: how it is sharded, e.g. "tensor/2" (rank 0's shard is described).
    world: str = ""
    # Whether the tokenizer renders `messages` (a chat template came with the model).
    has_chat_template: bool = False
    # The width of the final hidden states (`Embed`'s vectors); 0: the model's body (the model
    # without its LM head) was not found, or a distributed world (embeddings are refused).
    embedding_size: int = 0
    # A diffusion language model (its requests are denoised: `AdmitRequest.denoise`), and its
    # positions per canvas.
    denoising: bool = False
    canvas_length: int = 0
    # A block-diffusion model (LLaDA2-MoE): `canvas_length` is its block length; blocks sit at
    # fixed positions from the sequence's start (no least canvas to ask for).
    denoises_blocks: bool = False


class StepFailed(Record, frozen=True):
    """The step raised; the engine dropped every request it held."""

    error: str
    # The error code the requests end with ("unavailable": the distributed world lost a rank).
    code: str = "internal"


class RunStep(Message, frozen=True):
    plan: StepPlan
    reply: Reply[StepOutcome | StepFailed]


class DropPrefixes(Message, frozen=True):
    """Forget these prefix entries (the KV store evicted them)."""

    entry_ids: list[str]


class AdapterCall(Message, frozen=True):
    """Load (and know by name), unload, or list LoRA adapters; answered with the adapters
    known afterwards, or the typed error that refused the call."""

    op: Literal["load", "unload", "list"]
    reply: Reply[list[AdapterInfo] | Exception]
    name: str = ""
    path: str = ""
    pinned: bool = False


class Embed(Message, frozen=True):
    """The final hidden states of these token-id lists, pooled per input (and L2-normalized),
    as float32 values; computed between steps on fresh state (never a request's KV). Answered
    with one vector per input, in order, or the typed error that refused the call."""

    inputs: list[list[int]]
    pooling: Pooling
    normalize: bool
    reply: Reply[list[list[float]] | Exception]
    # Tokens one forward takes (`embeddings.batch_tokens`).
    batch_tokens: int = 256


class PrefixExport(Record, frozen=True):
    """A prefix entry's KV copied out for the disk tier: per requested span, its arrays by
    tensor name (numpy, float32 or packed words), or why none could be copied; and the
    seconds the MLX thread spent copying."""

    keys: list[str]
    arrays: list[Any]
    error: str | None = None
    export_s: float = 0.0


class ExportPrefix(Message, frozen=True):
    """Copy positions of a prefix entry out for the disk tier (before any drop of it):
    `spans` (start, end) of full-attention chunks, or the whole entry (`whole`, one span
    `(0, length)`). `keys` name the files the spans become; answered with a `PrefixExport`."""

    entry_id: str
    keys: list[str]
    spans: list[tuple[int, int]]
    whole: bool
    reply: Reply[PrefixExport]


ModelInbox = RunStep | DropPrefixes | AdapterCall | Embed | ExportPrefix


# -- a distributed world: rank 0's calls, made by every rank (`engine.model.world`) ------------------


class WorldStep(Message, frozen=True):
    plan: StepPlan


class WorldDrop(Message, frozen=True):
    entry_ids: list[str]


class WorldReset(Message, frozen=True):
    """The engine dropped everything (after a failed step)."""


class WorldStop(Message, frozen=True):
    """A clean shutdown: followers leave their loops and exit."""


WorldCommand = WorldStep | WorldDrop | WorldReset | WorldStop


class WorldStats(Record, frozen=True):
    """The world as rank 0 sees it."""

    size: int
    backend: str
    mode: str
    # False once a rank died or stalled: requests are refused until the world is relaunched.
    available: bool
    error: str | None = None
    steps: int = 0
    # Seconds in steps (all ranks' work, communication included) and in broadcasting plans.
    step_s: float = 0.0
    broadcast_s: float = 0.0
