"""The named built-in models (`builtin:<name>`): test, benchmark and draft-pair specs.

`ensure_builtin(name)` builds (once) and returns the directory of one of them; any other
`BuiltinSpec` goes through `models.ensure_model`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine.builtin.diffusion import DiffusionSpec
from engine.builtin.fields import config_fields
from engine.builtin.models import BUILTIN_PREFIX, BuiltinSpec, Progress, ensure_diffusion_model, ensure_model, ensure_vision_model
from engine.builtin.packaged import PACKAGED_MODELS, packaged_model_path
from engine.builtin.tokenizer import TokenizerSpec
from engine.builtin.vision import VisionSpec

TINY_TOKENIZER = TokenizerSpec(vocab_size=1024, corpus_chars=400_000)
BENCH_TOKENIZER = TokenizerSpec(vocab_size=32768, corpus_chars=4_000_000)


def tiny_spec(name: str, model_type: str, seed: int, **overrides: Any) -> BuiltinSpec:
    """A test-size spec: hidden size 64, 2 layers, 4 heads (2 for KV), the tiny tokenizer, 2,048
    positions, an untied head. `overrides` replaces named fields; the rest go to `extra`."""
    named = {field.name for field in dataclasses.fields(BuiltinSpec)}
    fields: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": TINY_TOKENIZER.vocab_size,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    extra = {key: value for key, value in overrides.items() if key not in named}
    fields.update({key: value for key, value in overrides.items() if key in named})
    if extra:
        fields["extra"] = config_fields(**extra)
    return BuiltinSpec(name=name, model_type=model_type, seed=seed, tokenizer=TINY_TOKENIZER, **fields)


# Llama-3.2-1B's shape (2,048 wide, 16 layers, 8,192 FFN, 32 heads over 8 KV heads), with
# the bench tokenizer's 32,768 tokens and a tied head: 1.04B weights, 4-bit in groups of 64
# (mlx-community's format), ~0.6 GB. Where weights, not scheduling, set a decode step's time.
_BENCH_1B = BuiltinSpec(
    name="bench-1b",
    model_type="llama",
    hidden_size=2048,
    num_hidden_layers=16,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32768,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    seed=21,
    tokenizer=BENCH_TOKENIZER,
    quantize=(4, 64),
)

# SmolLM-135M shape.
_BENCH = BuiltinSpec(
    name="bench",
    model_type="llama",
    hidden_size=576,
    num_hidden_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=32768,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    seed=2,
    tokenizer=BENCH_TOKENIZER,
)

# A target and draft pair for speculative decoding whose agreement is real: `bench-spec` is
# `bench`'s shape 48 layers deep with layers 2-47 writing 1% of their output into the
# residual stream, so its first two layers decide most of its choices; `bench-spec-draft`
# is those two layers (the same weights) with the same head: 13% of the target's
# parameters, agreeing with its greedy choice about 80% of the time (docs/benchmarks/log.md).
_SPEC_TARGET = dataclasses.replace(
    _BENCH, name="bench-spec", num_hidden_layers=48, scale=((r"model\.layers\.(?:[2-9]|[1-4]\d)\..*(?:o_proj|down_proj)\.weight", 0.01),)
)
# A model that copies its context (`engine.builtin.copying`: induction heads written by
# hand into `bench`'s width as a SmolLM3 with 128-dimensional heads, whose second layer
# attends without positions):
# prompt lookup's workload. Layers 2-29 are `bench`'s random layers damped to 1%.
_COPY = dataclasses.replace(
    _BENCH,
    name="bench-copy",
    model_type="smollm3",
    tie_word_embeddings=False,
    extra=config_fields(head_dim=128, no_rope_layers=[0 if i == 1 else 1 for i in range(30)]),
    scale=((r"model\.layers\.(?:[2-9]|[12]\d)\..*(?:o_proj|down_proj)\.weight", 0.01),),
    construct="copy",
)

# The copying circuit at test size (1,024-token vocabulary, three layers, the third damped).
_TINY_COPY = dataclasses.replace(
    _COPY,
    name="tiny-copy",
    hidden_size=384,
    num_hidden_layers=3,
    intermediate_size=256,
    num_attention_heads=9,
    vocab_size=1024,
    max_position_embeddings=2048,
    seed=10,
    tokenizer=TINY_TOKENIZER,
    extra=config_fields(head_dim=128, no_rope_layers=[1, 0, 1]),
    scale=((r"model\.layers\.2\..*(?:o_proj|down_proj)\.weight", 0.01),),
)

# The same idea at `tiny`'s width for tests: 4 layers, the last two damped to 10%; its draft
# is the first two. They agree on most greedy choices, not all (rewinds are exercised).
_TINY_SPEC = tiny_spec(
    "tiny-spec", "llama", 9, num_hidden_layers=4, tie_word_embeddings=True, scale=((r"model\.layers\.[23]\..*(?:o_proj|down_proj)\.weight", 0.1),)
)

_TINY = tiny_spec("tiny", "llama", 0, tie_word_embeddings=True)

# Sliding-window attention (window 16) on layers 0, 1 and 3, global on layer 2;
# the head is tied to the embeddings as in Gemma 3 checkpoints.
_TINY_GEMMA3 = tiny_spec(
    "tiny-gemma3",
    "gemma3_text",
    4,
    num_hidden_layers=4,
    num_key_value_heads=1,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=16,
    sliding_window_pattern=3,
    rope_local_base_freq=10000.0,
    hidden_activation="gelu_pytorch_tanh",
    omit_weights=("lm_head",),
)

# `tiny` and `tiny-gemma3` with 64-dimensional heads, so their KV can be quantized (MLX
# quantizes groups of 32, 64 or 128 elements along the head dim; `kv.bits`).
_TINY_KV = dataclasses.replace(_TINY, name="tiny-kv", extra=config_fields(head_dim=64))
_TINY_GEMMA3_KV = dataclasses.replace(
    _TINY_GEMMA3, name="tiny-gemma3-kv", extra=config_fields(**{**dict(_TINY_GEMMA3.extra), "head_dim": 64, "query_pre_attn_scalar": 64})
)

BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    spec.name: spec
    for spec in (
        _TINY,
        _TINY_KV,
        tiny_spec("tiny-qwen2", "qwen2", 1, intermediate_size=160, rope_theta=1000000.0),
        _TINY_GEMMA3,
        _TINY_GEMMA3_KV,
        # Three gated-delta (linear attention) layers, then one full attention layer;
        # every MLP a mixture of 4 experts (2 active) plus a shared expert.
        tiny_spec(
            "tiny-qwen3next",
            "qwen3_next",
            5,
            num_hidden_layers=4,
            rope_theta=10000000.0,
            head_dim=16,
            partial_rotary_factor=0.25,
            full_attention_interval=4,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=True,
        ),
        # Short-convolution layers with one attention layer (index 2), as in LFM2.
        tiny_spec(
            "tiny-lfm2",
            "lfm2",
            6,
            num_hidden_layers=4,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            norm_eps=1e-5,
            conv_bias=False,
            conv_L_cache=3,
            block_dim=64,
            block_ff_dim=128,
            block_multiple_of=16,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=True,
            layer_types=["conv", "conv", "full_attention", "conv"],
            full_attn_idxs=[2],
        ),
        _BENCH,
        _BENCH_1B,
        # Llama-3.2-3B's shape (3,072 wide, 28 layers, 24 heads over 8 KV heads), otherwise the 1B's:
        # 2.9B weights, ~1.8 GB (built matrix by matrix: its float32 weights alone would take ~12 GB).
        dataclasses.replace(_BENCH_1B, name="bench-3b", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, seed=22),
        BuiltinSpec(
            name="bench-qwen2",
            model_type="qwen2",
            hidden_size=512,
            num_hidden_layers=24,
            intermediate_size=1408,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=32768,
            max_position_embeddings=8192,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            seed=3,
            tokenizer=BENCH_TOKENIZER,
        ),
        # Gemma-3-270M shape (vocab 32768, window 128): 5 sliding layers to 1 global.
        BuiltinSpec(
            name="bench-gemma3",
            model_type="gemma3_text",
            hidden_size=640,
            num_hidden_layers=18,
            intermediate_size=2048,
            num_attention_heads=4,
            num_key_value_heads=1,
            vocab_size=32768,
            max_position_embeddings=8192,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            seed=7,
            tokenizer=BENCH_TOKENIZER,
            extra=config_fields(
                head_dim=256,
                query_pre_attn_scalar=256,
                sliding_window=128,
                sliding_window_pattern=6,
                rope_local_base_freq=10000.0,
                hidden_activation="gelu_pytorch_tanh",
            ),
            omit_weights=("lm_head",),
        ),
        # LFM2-350M layer pattern, narrower: 8 short-convolution and 4 attention layers.
        BuiltinSpec(
            name="bench-lfm2",
            model_type="lfm2",
            hidden_size=768,
            num_hidden_layers=12,
            intermediate_size=3840,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=32768,
            max_position_embeddings=8192,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            seed=8,
            tokenizer=BENCH_TOKENIZER,
            extra=config_fields(
                norm_eps=1e-5,
                conv_bias=False,
                conv_L_cache=3,
                block_dim=768,
                block_ff_dim=3840,
                block_multiple_of=256,
                block_ffn_dim_multiplier=1.0,
                block_auto_adjust_ff_dim=True,
                layer_types=[("full_attention" if i in (2, 5, 8, 10) else "conv") for i in range(12)],
                full_attn_idxs=[2, 5, 8, 10],
            ),
        ),
        # `bench` with the same initial weights, quantized like mlx-community's 4-bit models.
        dataclasses.replace(_BENCH, name="bench-4bit", quantize=(4, 64)),
        _TINY_SPEC,
        dataclasses.replace(_TINY_SPEC, name="tiny-spec-draft", keep_layers=2),
        _SPEC_TARGET,
        dataclasses.replace(_SPEC_TARGET, name="bench-spec-draft", keep_layers=2),
        _COPY,
        _TINY_COPY,
    )
}


# Vision-language built-ins (mlx-vlm's classes): a SmolVLM-shaped Idefics3 with the tiny tokenizer.
# Gemma 3's: a 32-pixel image pooled to 4 tokens, 8-position windows on every other layer.
VISION_MODELS: dict[str, VisionSpec] = {
    spec.name: spec
    for spec in (
        VisionSpec(name="tiny-idefics3", seed=32, tokenizer=TINY_TOKENIZER),
        VisionSpec(name="tiny-gemma3-vision", seed=31, tokenizer=TINY_TOKENIZER, family="gemma3", scale_factor=2),
        # Qwen2.5-VL's: 14-pixel patches merged 2x2, images up to 84x84 pixels (up to 9 tokens).
        VisionSpec(name="tiny-qwen2.5-vl", seed=33, tokenizer=TINY_TOKENIZER, family="qwen2_5_vl", patch_size=14, image_size=84),
        # SmolVLM-256M's shape (12-layer SigLIP at 512 pixels, 64 tokens per tile, 30-layer llama):
        # `mlxrt bench --vision`.
        VisionSpec(
            name="bench-idefics3",
            seed=32,
            tokenizer=BENCH_TOKENIZER,
            hidden_size=576,
            num_hidden_layers=30,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            vision_hidden_size=768,
            vision_layers=12,
            vision_heads=12,
            patch_size=16,
            image_size=512,
            scale_factor=4,
            longest_edge=1024,
        ),
    )
}


# Diffusion language built-ins (mlx-vlm's DiffusionGemma and LLaDA2-MoE classes), text only, the
# tiny tokenizer: a 16-position canvas, at most 12 denoising steps per canvas.
# The bench ones (`mlxrt bench --denoise`): 8 layers, 512 wide, 8 experts (2 active);
# `bench-diffusion-gemma` with a 64-position canvas.
_BENCH_DIFFUSION = DiffusionSpec(
    name="bench-diffusion",
    seed=0,
    tokenizer=BENCH_TOKENIZER,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=8,
    top_k_experts=2,
)
DIFFUSION_MODELS: dict[str, DiffusionSpec] = {
    spec.name: spec
    for spec in (
        DiffusionSpec(name="tiny-diffusion-gemma", seed=40, tokenizer=TINY_TOKENIZER),
        # A LLaDA2-MoE: a dense first layer, then 4 experts (2 active) and a shared one; blocks
        # of 32 positions (the family's default), at most 32 steps each.
        DiffusionSpec(name="tiny-llada2", seed=42, tokenizer=TINY_TOKENIZER, family="llada2_moe", canvas_length=32),
        dataclasses.replace(_BENCH_DIFFUSION, name="bench-llada2", seed=43, family="llada2_moe", canvas_length=32),
        dataclasses.replace(
            _BENCH_DIFFUSION,
            name="bench-diffusion-gemma",
            seed=41,
            num_global_key_value_heads=2,
            global_head_dim=128,
            sliding_window=128,
            canvas_length=64,
            max_denoising_steps=24,
        ),
    )
}


class UnknownBuiltinModelError(ValueError):
    """Raised for a name that is not a key of `BUILTIN_MODELS`."""

    def __init__(self, name: str) -> None:
        known = ", ".join(sorted([*BUILTIN_MODELS, *VISION_MODELS, *DIFFUSION_MODELS, *PACKAGED_MODELS]))
        super().__init__(f"unknown builtin model {name!r}; known models: {known}")
        self.name = name


def builtin_name(path: str) -> str | None:
    """``"builtin:tiny"`` -> ``"tiny"``; anything else -> None."""
    if path.startswith(BUILTIN_PREFIX) and len(path) > len(BUILTIN_PREFIX):
        return path[len(BUILTIN_PREFIX) :]
    return None


def ensure_builtin(name: str, *, root: Path | str, progress: Progress | None = None) -> Path:
    """Return the model `builtin:<name>`: a packaged model's installed file, or the directory
    of a random-weight built-in under `root` (the runtime's `MLXRT_HOME`), built first if needed."""
    if name in PACKAGED_MODELS:
        return packaged_model_path(name)
    if name in VISION_MODELS:
        return ensure_vision_model(VISION_MODELS[name], root=root, progress=progress)
    if name in DIFFUSION_MODELS:
        return ensure_diffusion_model(DIFFUSION_MODELS[name], root=root, progress=progress)
    spec = BUILTIN_MODELS.get(name)
    if spec is None:
        raise UnknownBuiltinModelError(name)
    return ensure_model(spec, root=root, progress=progress)
