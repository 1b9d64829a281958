"""The configuration's sections: frozen structs, each value's range stated on its type.

Pure data. `runtime.config.RuntimeConfig` is the tree of these sections and loads it from
TOML, the environment and flags; lower layers (the engine, the actors) take only the
sections they need. Ranges are `msgspec.Meta` constraints, checked on every decode.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from protocols.redaction import redact_key

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
# An IPv4 or IPv6 address, or a network of them in CIDR notation.
NETWORK_PATTERN = r"^(\d{1,3}(\.\d{1,3}){3}|[0-9A-Fa-f]{0,4}(:[0-9A-Fa-f]{0,4}){1,7}|[0-9A-Fa-f:]*:\d{1,3}(\.\d{1,3}){3})(/\d{1,3})?$"


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config table."""


class ModelConfig(Section, frozen=True):
    # A local mlx-lm model directory, a GGUF file, or "builtin:<name>" (see engine.builtin).
    path: Annotated[str, msgspec.Meta(min_length=1)]
    # "auto": float32 on the CPU backend (BLAS-backed), the model's own dtype elsewhere.
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # Longest prompt + generation; default: the model's max_position_embeddings.
    max_context: Annotated[int, msgspec.Meta(ge=2)] | None = None
    trust_remote_code: bool = False
    # Quantized weights on the CPU backend, where MLX's quantized matmul is slow: turned into
    # float32 at load ("always"), kept ("never"), or "auto": when they fit half the memory.
    cpu_dequantize: Literal["auto", "always", "never"] = "auto"


class SchedulerConfig(Section, frozen=True):
    # Requests decoded together in one batched step.
    max_batch_size: Positive = 32
    # Requests accepted but not yet admitted; beyond this, submissions are refused.
    max_queued_requests: Positive = 256
    # Prompt tokens a request forwards per step; running streams wait at most one
    # chunk (attention over a long prefix makes big chunks slow on CPU).
    prefill_chunk_size: Positive = 256
    # Tokens (decode rows + prefill chunks) one step may process; 0 = 4 chunks + batch size.
    step_token_budget: NonNegative = 0
    # A request whose caller has not read for this long is cancelled (it was paused, holding
    # its KV but no batch slot, since its caller fell behind); its stream ends `cancelled`.
    max_pause_s: Seconds = 300.0
    # A diffusion model's denoising steps take at most this share of the MLX thread while
    # another model on it (a model pool's) is working: after a step, its scheduler waits so
    # that the other model's decode keeps its pace. 1: no limit. Alone on the thread, none.
    denoise_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.25
    # Bulk requests (`GenerateRequest.bulk`: the choices of an `n` > 1 call, a list of prompts,
    # prompt scoring) and embedding forwards take at most this share of the engine while an
    # interactive request is live: they hold at most share / (1 - share) of the interactive
    # decode rows' slots (at least one) and this share of the time: after a step that did bulk
    # work (its rows' cost beyond an interactive step alone, or a bulk prefill chunk's whole
    # step) bulk waits until the others have had the rest. Alone, full speed. 1: no distinction.
    bulk_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.1
    # Rendering, tokenizing or decoding more than this (bytes of text, 4 per token id) for one
    # request runs in a worker process at low CPU priority (`runtime.offload`), so that it takes
    # only the cores the engine leaves idle; smaller jobs run in a thread. 0: always a thread.
    bulk_tokenize_bytes: NonNegative = 65536
    # The interpreter's GIL switch interval while the runtime runs (lowered, never raised; 0:
    # left as it is): how long the MLX thread may wait for the GIL behind the event loop's
    # Python work (a big body decoded, a response encoded) each time an evaluation returns.
    switch_interval_s: Annotated[float, msgspec.Meta(ge=0, le=0.1)] = 0.0005
    # While only decode rows run and steps take less than this, the scheduler queues the next
    # decode step before it handles the last one's tokens, so the device never waits on the
    # event loop between steps (the round trip is a share of a short step); a request arriving
    # meanwhile is admitted at most one such step later. 0: never.
    run_ahead_below_s: Annotated[float, msgspec.Meta(ge=0)] = 0.02
    # On a Linux CPU with mlxrt's kernels: the thread that runs the model's kernels gets a core
    # of its own, the MLX thread and the quantized products' helper keep to the others
    # (`engine.affinity`; not in a distributed world, whose ranks may share the machine).
    pin_kernel_thread: bool = True


AUTO_BLOCK_SIZE = 16


class KvConfig(Section, frozen=True):
    # Bytes of KV cache the runtime may hold, prefix cache included; 0 = no limit.
    budget_bytes: NonNegative = 0
    # Bytes the prefix cache may keep (least recently used entries go first); 0 disables it.
    prefix_cache_bytes: NonNegative = 1 << 30
    # Shorter sequences are not worth keeping.
    prefix_min_tokens: NonNegative = 16
    # Quantized KV for full-attention layers: 0 (float, the model's dtype), 8 or 4 bits per
    # element, with a scale and a bias per `group_size` elements (as mlx-lm's QuantizedKVCache).
    # Sliding-window layers stay float (mlx-lm has no quantized rotating cache); so does a layer
    # whose head dims `group_size` does not divide (the load log names such layers).
    bits: Literal[0, 4, 8] = 0
    group_size: Literal[32, 64, 128] = 64
    # Each request's first `quantized_start` positions are kept in full precision as well, and
    # attention reads those (a system prompt, attention sinks); later positions are quantized.
    quantized_start: NonNegative = 0
    # Paged KV: float full-attention layers keep positions in one pool of `block_size`-position
    # blocks, each request holding the blocks it uses (no padding to the longest row) and
    # requests seeded from a saved prefix sharing its full blocks instead of copying them.
    # 0 keeps a padded row per request. (Quantized layers keep rows.) "auto": blocks of
    # `AUTO_BLOCK_SIZE` where paged KV costs nothing (a text model on one device, with mlxrt's
    # CPU kernels loaded: `engine.native`), rows elsewhere (vision and diffusion models, a
    # distributed world, Metal and CPUs without the kernels, where paged steps are slower).
    block_size: Literal["auto", 0, 8, 16, 32, 64, 128, 256] = "auto"
    # The prefix cache's disk tier ("" = off): saved prefixes of at least `disk_min_tokens`
    # tokens are also written here (off the event loop and the MLX thread), kept across
    # restarts, and read back when a prompt starts with one and RAM holds less of it. At most
    # `disk_cache_bytes` (least recently used files go first). Full-attention models store
    # `disk_chunk_tokens`-position chunks, so a prefix shared by many prompts is stored once.
    disk_cache_dir: str = ""
    disk_cache_bytes: NonNegative = 16 << 30
    disk_chunk_tokens: Literal[64, 128, 256, 512, 1024] = 256
    disk_min_tokens: NonNegative = 256


class GenerationConfig(Section, frozen=True):
    # max_tokens for requests that do not set it.
    default_max_tokens: Positive = 256
    # Jump-forward decoding for grammar requests that do not say (never with logprobs).
    jump_forward: bool = False
    # Token fast-forwarding for requests that do not say: "off", "strict" (tool-call scaffolds
    # from the chat template) or "echo" (strict, plus spans copied from the context, kept as
    # far as the model's greedy choice agrees). Never with a grammar or logprobs.
    fill: Literal["off", "strict", "echo"] = "off"
    # Longest span appended at once, and the anchor an echo span needs (tokens).
    fill_max_span: Annotated[int, msgspec.Meta(ge=2)] = 32
    fill_echo_k: Annotated[int, msgspec.Meta(ge=2)] = 8
    # Append one JSON line per fast-forwarded span to this file ("" = no trace).
    fill_trace: str = ""
    # Seed of the generator that draws seeds for requests that do not set one.
    seed: int | None = None


class LimitsConfig(Section, frozen=True):
    """What one request may ask for; beyond these it is refused before any compute."""

    # Prompt text (or rendered chat) bytes; 0 = derived from the context: max_context times the
    # longest token's bytes, so nothing refused could have fitted. Checked before tokenizing.
    max_prompt_bytes: NonNegative = 0
    # Stop strings per request, and their total bytes.
    max_stop_strings: Positive = 64
    max_stop_bytes: Positive = 8192
    # Source bytes of a response_format or of a request's tools, and their nesting depth.
    max_grammar_bytes: Positive = 65536
    max_grammar_depth: Positive = 64
    # Bytes of compiled grammars kept for reuse; a grammar whose compiled form alone exceeds
    # this is refused. Compiling one may take at most `grammar_compile_timeout_s`.
    grammar_cache_bytes: Positive = 512 * 1024 * 1024
    grammar_compile_timeout_s: Seconds = 10.0
    # Images (vision-language models): per request, bytes per image (as sent), and pixels per
    # image (read from its header: a decompression bomb is refused before it is decoded).
    max_images: Positive = 8
    max_image_bytes: Positive = 10 * 1024 * 1024
    max_image_pixels: Positive = 25_000_000
    # Decoded pixels of all of one request's images together (from their headers, before any is
    # decoded): 50M RGB pixels are ~150 MB decoded, at most one request's at once per render.
    max_request_pixels: Positive = 50_000_000
    # Denoising steps per canvas (or block) a diffusion model's request may ask for
    # (`denoising.max_steps`): each step is a forward over the whole canvas.
    max_denoise_steps: Positive = 1024
    # Responses in one `previous_response_id` chain (the Responses API), the new one included: each
    # turn renders the whole conversation again, so a chain is a bound on messages rendered per turn.
    max_response_chain: Positive = 1024
    # JSON bytes of the stored conversation a `previous_response_id` continues, checked before it
    # is decoded: 16 MiB is ~4M tokens of text, past any served context (1M tokens: ~4 MiB).
    max_response_history_bytes: Positive = 16 * 1024 * 1024
    # With several API keys: the share of the Responses store (`server.responses_store_max` and
    # `_bytes`) one key's responses may hold; past it a key's own oldest go first, not others'.
    max_response_store_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    # HTTP: choices one completion or chat request asks for (prompts x n), each a request of its own.
    max_choices: Positive = 64
    # HTTP: prompt tokens scored for prompt logprobs (echo with logprobs, prompt_logprobs) in one
    # completion request, all its choices together (each scores its prompt with up to 20 alternatives).
    max_prompt_logprobs_tokens: Positive = 8192
    # HTTP: messages in one chat, Messages, Responses or /tokenize request (each rendered by the
    # chat template), and their content parts (text, image, tool_result blocks) in all.
    max_messages: Positive = 4096
    max_content_parts: Positive = 8192
    # HTTP: text /tokenize takes (413 beyond), and token ids /detokenize takes.
    max_tokenize_bytes: Positive = 1024 * 1024
    max_detokenize_tokens: Positive = 262144


class ServerConfig(Section, frozen=True):
    # Unix socket path; "" = $XDG_RUNTIME_DIR/mlxrt/mlxrt.sock, else /tmp/mlxrt-<uid>/mlxrt.sock.
    socket: str = ""
    # "0600": owner only; "0660": also the owner's group (the directory becomes 0750).
    socket_mode: Literal["0600", "0660"] = "0600"
    # Peers with these uids may connect besides the server's own uid (Linux SO_PEERCRED).
    allowed_uids: list[int] = msgspec.field(default_factory=list)
    # Largest frame accepted from a client; the length prefix is checked before reading.
    max_frame_bytes: Positive = 8 * 1024 * 1024
    max_connections: Positive = 64
    # Seconds a new connection has to send Hello.
    handshake_timeout_s: Seconds = 10.0
    # Seconds a client may leave a frame (HTTP: a response) unread before the server drops
    # the connection.
    client_stall_timeout_s: Seconds = 60.0
    # A connection with no live request that sends no complete frame for this long is closed.
    idle_timeout_s: Seconds = 300.0
    # Once a frame has begun, the rest of it must arrive within this many seconds.
    frame_timeout_s: Seconds = 10.0
    # Frames queued per connection before its requests wait for the client.
    send_buffer_frames: Positive = 64
    # The OpenAI-compatible HTTP API: "host:port", or just "port" for 127.0.0.1; "" = off.
    http: str = ""
    # Bearer key the HTTP API requires (every route but /health) when set; compared in
    # constant time. Better given as MLXRT_SERVER_API_KEY than written in a file.
    api_key: str = ""
    # More keys, each as good as `api_key` (MLXRT_SERVER_API_KEYS='["k1", "k2"]'). What one key
    # stores (Responses API responses) the others cannot see: another key's id answers 404.
    api_keys: list[Annotated[str, msgspec.Meta(min_length=1)]] = msgspec.field(default_factory=list)
    # Largest HTTP request body: a larger Content-Length is refused before the body is read,
    # and a chunked body is refused as soon as it passes this.
    max_body_bytes: Positive = 4 * 1024 * 1024
    # A request body must arrive completely within this many seconds.
    body_timeout_s: Seconds = 10.0
    # Images given by http(s) URL in a prompt are fetched only when this is set (off: a server
    # that fetches what a prompt names lets any client reach the addresses the server can);
    # all of a request's fetches (DNS, connect, redirects, body) are bounded by
    # `limits.max_image_bytes` each and this many seconds together.
    allow_remote_images: bool = False
    remote_image_timeout_s: Seconds = 10.0
    # Only public addresses are fetched (the address the name resolves to, which is the one
    # connected to): loopback, private, link-local, multicast, reserved addresses are refused
    # unless in these networks ("127.0.0.1", "10.0.0.0/8", "fd00::/8").
    remote_image_allowed_networks: list[Annotated[str, msgspec.Meta(pattern=NETWORK_PATTERN)]] = msgspec.field(default_factory=list)
    # Image fetches in flight at once, in threads of their own (a slow image host never holds
    # the threads that render prompts); beyond this, fetches wait within their time limit.
    remote_image_max_fetches: Positive = 16
    # Browser origins allowed to call the HTTP API (CORS); [] = CORS off, ["*"] = any.
    cors_origins: list[str] = msgspec.field(default_factory=list)
    # The model name HTTP clients send and /v1/models lists; "" = the model path's last
    # component (or "builtin:<name>").
    served_model_name: str = ""
    # HTTP API requests in flight at once; beyond this, 503 with Retry-After (/health and
    # /metrics are always answered).
    http_max_connections: Positive = 256
    # Open HTTP connections, idle ones included; a connection beyond this evicts the idle one
    # that waited longest (lowered to what the process's descriptor limit leaves).
    http_max_open_connections: Positive = 512
    # A connection that opens, or has sent its last response, must deliver a complete request
    # head within this many seconds (bytes trickling in do not extend it).
    http_header_timeout_s: Seconds = 10.0
    # Seconds an idle keep-alive HTTP connection stays open.
    http_keepalive_s: Seconds = 5.0
    # Host names the HTTP API answers (the Host header, port ignored): [] = the loopback names
    # (localhost, 127.0.0.1, ::1) when bound to loopback, any otherwise; ["*"] = any. A page
    # that rebinds its own DNS name to 127.0.0.1 is refused.
    http_allowed_hosts: list[str] = msgspec.field(default_factory=list)
    # vLLM's runtime LoRA routes, POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
    # /v1/unload_lora_adapter {"lora_name"}: off by default (they read a path on this machine;
    # set `api_key` too when the port is reachable by others).
    http_adapter_updates: bool = False
    # Per-client pacing (a client: the API key it proves, else its address): its 4xx answers past
    # `client_refusals_per_s` (bursts of `client_refusal_burst`) are held back until their turn,
    # at most `client_max_delay_s` each, and while `client_max_held` are held its new requests
    # are refused at once (429); 0 = off. A client resending refused requests as fast as they
    # are answered is held to that rate.
    client_refusals_per_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    client_refusal_burst: Positive = 20
    client_max_delay_s: Seconds = 2.0
    client_max_held: Positive = 8
    # Requests a second per client (bursts of `client_request_burst`); a request past it waits its
    # turn up to `client_max_delay_s`, else 429. 0 = off (keyless clients on one host are one
    # client: a local load generator would be held to it).
    client_requests_per_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    client_request_burst: Positive = 100
    # The Responses API's store (`POST /v1/responses` with `store: true`, its default): responses kept
    # in memory for `previous_response_id` and GET/DELETE /v1/responses/{id}, at most this many
    # (0 = none kept) of at most this many bytes in all; the least recently used go first.
    responses_store_max: NonNegative = 256
    responses_store_bytes: NonNegative = 64 * 1024 * 1024

    def __repr__(self) -> str:
        # A config printed (a log line, a traceback) never shows its API keys.
        fields = {name: getattr(self, name) for name in self.__struct_fields__}
        fields |= {"api_key": redact_key(self.api_key), "api_keys": [redact_key(key) for key in self.api_keys]}
        return f"ServerConfig({', '.join(f'{name}={value!r}' for name, value in fields.items())})"


class TracingConfig(Section, frozen=True):
    # Append one JSON line per span (queue, prefill chunk, decode, fast-forward, checkpoint
    # write, and the request around them) to this file; "" = none. OpenTelemetry spans are
    # exported whenever an OpenTelemetry SDK tracer provider is installed, regardless.
    span_log: str = ""


class SpeculativeConfig(Section, frozen=True):
    # A draft model (an mlx-lm directory, a GGUF file or "builtin:<name>") sharing the model's tokenizer:
    # requests then speculate by default, drafting with it. "" = none.
    draft: str = ""
    # Without a draft model: draft from n-grams of each request's own context (prompt lookup).
    lookup: bool = False
    # "exact": a drafted token is kept while it equals the token the request's own sampler
    # draws there (output identical to decoding without speculation, seeded sampling too);
    # "rejection": standard speculative sampling (the target's distribution, more kept).
    acceptance: Literal["exact", "rejection"] = "exact"
    # Longest draft per round; each request adapts its own below this to its acceptance.
    max_draft_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 6
    # false: every round drafts max_draft_tokens, whatever the acceptance (mlx-lm's way).
    adaptive: bool = True
    # Prompt lookup: tokens of the context's tail that must match earlier context.
    lookup_anchor: Annotated[int, msgspec.Meta(ge=1, le=8)] = 2
    # Prompt lookup's longest draft (its proposals cost nothing to make, so it can reach
    # further than a draft model's; each request adapts below it).
    lookup_max_draft_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 8
    # Batches of more rows than this do not speculate (a verify forward then costs more than
    # it saves); 0 = the crossover measured on this machine (see docs/benchmarks/log.md).
    max_batch: NonNegative = 0


# The variable every rank of a world with `distributed.control` reads its shared secret from
# (`runtime.env.world_secret`): kept out of the config tree, so no file or `mlxrt config show` holds it.
WORLD_SECRET_VARIABLE = "MLXRT_DISTRIBUTED_SECRET"


class DistributedConfig(Section, frozen=True):
    # The mlx.distributed backend the world was launched with (`mlxrt launch` or `mlx.launch`);
    # "" = one process. Rank 0 serves; every other rank follows its steps on its shard.
    backend: Literal["", "ring", "mpi", "jaccl", "nccl", "any"] = ""
    # "tensor": every layer split across the ranks (mlx-lm's `shard()`); "pipeline": the
    # layers split into consecutive stages (mlx-lm's `pipeline()`).
    mode: Literal["tensor", "pipeline"] = "tensor"
    # The hosts for `mlxrt launch` (mlx.launch's hostfile: JSON); "" = this machine only.
    hostfile: str = ""
    # "host:port" rank 0 listens on (every rank must reach it) for a wake-up before each
    # plan: MLX's ring backend spins a core while a rank waits in a collective, so an idle
    # follower sleeps on this socket instead. `mlxrt launch` on one machine sets it; "" =
    # followers wait in the collective. Each connection must prove the world's secret
    # (`WORLD_SECRET_VARIABLE`, never a key here) before rank 0 counts it as a rank.
    control: str = ""
    # A step every rank has not finished within this ends the requests in it with an
    # `unavailable` error, and the runtime refuses requests until relaunched.
    step_timeout_s: Seconds = 60.0


class LoraConfig(Section, frozen=True):
    # Adapter slots on the device: rows of this many distinct adapters (plus base rows) share
    # a batch; a request for another waits until an adapter no live request holds can be
    # evicted (least recently used; pinned adapters are never evicted and take a slot each).
    max_resident: Annotated[int, msgspec.Meta(ge=1, le=256)] = 8
    # Adapters of a higher rank are refused (every slot is padded to the largest rank loaded).
    max_rank: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 64


class PoolModelConfig(Section, frozen=True):
    """One `[[models]]` entry: another model a `ModelPool` serves; the `[model]` options it does
    not set are `[model]`'s."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    path: Annotated[str, msgspec.Meta(min_length=1)]
    # Never swapped out (it must fit `model_pool.memory_bytes` beside the largest other model).
    pinned: bool = False
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None
    max_context: Annotated[int, msgspec.Meta(ge=2)] | None = None
    trust_remote_code: bool | None = None
    cpu_dequantize: Literal["auto", "always", "never"] | None = None

    def model_config(self, defaults: ModelConfig) -> ModelConfig:
        """This model's `[model]` options: its own where set, the defaults' elsewhere."""
        own = {name: getattr(self, name) for name in ("dtype", "max_context", "trust_remote_code", "cpu_dequantize") if getattr(self, name) is not None}
        return msgspec.structs.replace(defaults, path=self.path, **own)


class ModelPoolConfig(Section, frozen=True):
    # Weights of the models resident at once (bytes as loaded: float32 on the CPU backend);
    # 0 = no limit. Loading one more swaps out the least recently used unpinned models.
    memory_bytes: NonNegative = 0
    # A model stays resident at least this long after it is loaded before another request's
    # model may swap it out (no thrashing between two busy models).
    min_resident_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0
    # Requests served by a pool checkpoint every this many tokens (a swapped-out model's requests
    # resume from their checkpoint); 0 = they are regenerated from the start, skipping what the
    # caller already has.
    checkpoint_every: NonNegative = 16


class AdapterConfig(Section, frozen=True):
    """One `[[adapters]]` entry: a LoRA adapter directory in mlx-lm's format, loaded at start."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    path: str
    # Never evicted from its slot.
    pinned: bool = False


class CheckpointConfig(Section, frozen=True):
    # Where checkpoints are written; "" = $MLXRT_HOME/checkpoints (default ~/.cache/mlxrt/checkpoints).
    dir: str = ""
    # Default tokens between checkpoints for requests that do not say; 0 = off.
    every_tokens: NonNegative = 0
    # Checkpoints older than this are deleted (at start and hourly).
    max_age_s: Seconds = 86400.0


class LoggingConfig(Section, frozen=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    # "auto": human-readable on a terminal, JSON lines otherwise.
    format: Literal["auto", "json", "console"] = "auto"


# How one input's final hidden states become its embedding: the last token's, or their mean.
Pooling = Literal["last", "mean"]


class EmbeddingsConfig(Section, frozen=True):
    """`POST /v1/embeddings` and `Runtime.embed`: the model's final hidden states, pooled."""

    # "last" suits decoder LMs (the last position has seen the whole input); "mean" averages.
    pooling: Pooling = "last"
    # Scale each vector to unit L2 length.
    normalize: bool = True
    # Inputs per call, and their tokens in all.
    max_inputs: Annotated[int, msgspec.Meta(ge=1, le=2048)] = 256
    max_tokens: Positive = 65536
    # Tokens one forward takes: inputs are batched (right-padded) up to it and longer ones go in
    # chunks of it, each forward between two engine steps (the longest stall decoding streams see:
    # by default a prefill chunk's, `scheduler.prefill_chunk_size`).
    batch_tokens: Annotated[int, msgspec.Meta(ge=16)] = 256
