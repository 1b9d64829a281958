"""Tiny random-weight models of many mlx-lm model families, for conformance tests.

`FAMILIES` maps a name (the mlx-lm model type, or ``<type>-<n>bit`` for quantized
copies) to a `BuiltinSpec`: hidden size 64, 2-4 layers, the tiny built-ins' tokenizer
(vocab 1024), at least 2048 positions (`engine.builtin.catalog.tiny_spec`), each family's own defaults wherever mlx-lm
has them. Sliding windows are 32 tokens, so prompts of a few hundred tokens exceed
them. `build(name, root)` builds one into ``<root>/models`` with the built-in
models' builder (the same deterministic weights, digest-named directories and
lock-then-rename), training the shared tokenizer once per root.

``EXPECTED_CACHES`` gives, per family, the caches ``make_prompt_cache`` returns:
one letter per cache, K for ``KVCache``, R for ``RotatingKVCache`` (window 32),
A for ``ArraysCache`` (SSM, gated-delta, RG-LRU, WKV and convolution state), L for
``CacheList`` (one layer holding several: Falcon-H1's SSM state and KV). Families whose
later layers reuse earlier layers' KV (Gemma 4's shared-KV layers) have fewer caches
than layers.

``UNSUPPORTED`` holds families that build but whose caches the runtime refuses at load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine.builtin import BUILTIN_MODELS, TINY_TOKENIZER, BuiltinSpec, config_fields, ensure_model
from engine.builtin.catalog import tiny_spec
from engine.builtin.models import Progress
from tests.support.families_more import MORE_FAMILIES, SLIDING_WINDOW

_MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 2048,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}

# Qwen 3.5's language model: every 4th layer full attention, the others gated-delta.
_QWEN3_5_TEXT = {
    "head_dim": 16,
    "full_attention_interval": 4,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
}


def _with_extra(spec: BuiltinSpec, *, name: str, seed: int, **extra: Any) -> BuiltinSpec:
    """A built-in's spec under another name and seed, with some of its `extra` fields changed."""
    return dataclasses.replace(spec, name=name, seed=seed, extra=config_fields(**{**dict(spec.extra), **extra}))


_LLAMA = tiny_spec("llama", "llama", 100, tie_word_embeddings=True)
_QWEN3 = tiny_spec("qwen3", "qwen3", 101, rope_theta=1000000.0, tie_word_embeddings=True, head_dim=16)
_QWEN3_MOE = tiny_spec(
    "qwen3_moe",
    "qwen3_moe",
    102,
    rope_theta=1000000.0,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    moe_intermediate_size=32,
    norm_topk_prob=True,
)

FAMILIES: dict[str, BuiltinSpec] = {
    spec.name: spec
    for spec in (
        _LLAMA,
        _QWEN3,
        _QWEN3_MOE,
        # Sliding window on layers 0, 1 and 3, global attention on layer 2; tied head: the
        # built-in `tiny-gemma3` with its own seed and a longer window.
        _with_extra(BUILTIN_MODELS["tiny-gemma3"], name="gemma3_text", seed=103, sliding_window=SLIDING_WINDOW),
        # Attention sinks, 4 experts (2 active), sliding and full layers alternating.
        tiny_spec(
            "gpt_oss",
            "gpt_oss",
            104,
            num_hidden_layers=4,
            intermediate_size=64,
            max_position_embeddings=131072,
            rope_theta=150000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        # A Ministral 3 checkpoint's layout: the language model only in text_config.
        dataclasses.replace(
            tiny_spec("mistral3", "mistral3", 105, max_position_embeddings=32768, rms_norm_eps=1e-5),
            layout="text_config",
            extra=config_fields(
                text_config={"model_type": "ministral3", "rope_parameters": _MINISTRAL3_ROPE},
            ),
        ),
        # Mistral Small 3.x's layout: text_config of model_type "mistral" (llama in mlx-lm).
        dataclasses.replace(
            tiny_spec("mistral3-mistral", "mistral3", 106, rope_theta=1000000000.0, rms_norm_eps=1e-5),
            layout="text_config",
            extra=config_fields(text_config={"model_type": "mistral"}),
        ),
        tiny_spec(
            "ministral3",
            "ministral3",
            107,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            head_dim=16,
            rope_parameters=_MINISTRAL3_ROPE,
        ),
        tiny_spec("phi3", "phi3", 108, rms_norm_eps=1e-5, max_position_embeddings=4096),
        tiny_spec("olmo2", "olmo2", 109, rope_theta=500000.0),
        # Layer 3 has no rotary embedding (no_rope_layer_interval 4).
        tiny_spec("smollm3", "smollm3", 110, num_hidden_layers=4, rope_theta=5000000.0, tie_word_embeddings=True, no_rope_layer_interval=4),
        # Multi-head latent attention; layer 0 dense, layer 1 a mixture of 4 routed
        # experts (2 active, sigmoid scores, noaux_tc) and a shared expert.
        tiny_spec(
            "deepseek_v3",
            "deepseek_v3",
            111,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            moe_layer_freq=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
        ),
        # Gated-delta linear attention on layers 0-2, full attention on layer 3; MoE MLPs:
        # the built-in `tiny-qwen3next` with its own seed.
        dataclasses.replace(BUILTIN_MODELS["tiny-qwen3next"], name="qwen3_next", seed=112),
        # Short convolutions on layers 0, 1 and 3, attention on layer 2: the built-in `tiny-lfm2`
        # with its own seed.
        dataclasses.replace(BUILTIN_MODELS["tiny-lfm2"], name="lfm2", seed=113),
        # Mamba-2, attention, Mamba-2, MLP (the MLP layer has no cache).
        tiny_spec(
            "nemotron_h",
            "nemotron_h",
            114,
            num_hidden_layers=4,
            head_dim=16,
            hybrid_override_pattern="M*M-",
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            conv_kernel=4,
            n_groups=1,
            mamba_proj_bias=False,
            use_bias=False,
            use_conv_bias=True,
            attention_bias=False,
            mlp_bias=False,
            layer_norm_epsilon=1e-5,
        ),
        # Granite 4.0 hybrid: Mamba-2 and one attention layer (no position embedding),
        # every MLP a mixture of 4 experts (2 active) plus a shared MLP.
        tiny_spec(
            "granitemoehybrid",
            "granitemoehybrid",
            115,
            num_hidden_layers=4,
            intermediate_size=32,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            layer_types=["mamba", "attention", "mamba", "mamba"],
            attention_bias=False,
            # Granite's 12 and 0.22 make random weights echo the last prompt token.
            embedding_multiplier=1.0,
            attention_multiplier=0.0625,
            logits_scaling=4.0,
            residual_multiplier=1.0,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_n_groups=1,
            mamba_proj_bias=False,
            mamba_conv_bias=True,
            position_embedding_type="nope",
        ),
        # Qwen 3.5 (language model in text_config): gated-delta linear attention on
        # layers 0-2, gated full attention on layer 3; dense MLPs; tied head.
        dataclasses.replace(
            tiny_spec("qwen3_5", "qwen3_5", 121, num_hidden_layers=4, tie_word_embeddings=True),
            layout="text_config",
            extra=config_fields(
                architectures=["Qwen3_5ForConditionalGeneration"],
                text_config={"model_type": "qwen3_5_text", **_QWEN3_5_TEXT},
            ),
        ),
        # Qwen 3.5 MoE: as qwen3_5, every MLP a mixture of 4 experts (2 active) plus a shared expert.
        dataclasses.replace(
            tiny_spec("qwen3_5_moe", "qwen3_5_moe", 122, num_hidden_layers=4),
            layout="text_config",
            extra=config_fields(
                architectures=["Qwen3_5MoeForConditionalGeneration"],
                text_config={
                    "model_type": "qwen3_5_moe_text",
                    **_QWEN3_5_TEXT,
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 64,
                    "norm_topk_prob": True,
                },
            ),
        ),
        # Gemma 4 (E2B/E4B shape): sliding layers 0 and 2, full layer 1 and 3 (wider heads,
        # partial proportional rope); layers 2-3 reuse layers 0-1's KV (no caches of their
        # own); per-layer input embeddings; tied, soft-capped head.
        tiny_spec(
            "gemma4_text",
            "gemma4_text",
            123,
            num_hidden_layers=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            head_dim=16,
            global_head_dim=32,
            sliding_window=SLIDING_WINDOW,
            sliding_window_pattern=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=TINY_TOKENIZER.vocab_size,
            hidden_activation="gelu_pytorch_tanh",
        ),
        # Cohere Command R7B / A: sliding window on layers 0-2, full attention (no rope) on layer 3.
        tiny_spec(
            "cohere2",
            "cohere2",
            124,
            num_hidden_layers=4,
            rope_theta=50000.0,
            tie_word_embeddings=True,
            head_dim=16,
            layer_norm_eps=1e-5,
            logit_scale=0.25,
            sliding_window=SLIDING_WINDOW,
            sliding_window_pattern=4,
        ),
        # Pure Mamba-2 (SSM state and convolution on every layer).
        tiny_spec(
            "mamba2",
            "mamba2",
            125,
            num_heads=8,
            head_dim=16,
            state_size=16,
            n_groups=1,
            conv_kernel=4,
            expand=2,
            use_bias=False,
            use_conv_bias=True,
            layer_norm_epsilon=1e-5,
            residual_in_fp32=True,
            time_step_limit=[0.0, 1e9],
            time_step_rank="auto",
        ),
        # Gemma 4 (26B-A4B shape): sliding layers 0 and 2; full layers 1 and 3 with keys
        # as values (attention_k_eq_v) and fewer KV heads; dense MLP plus a mixture of
        # 4 experts (2 active) on every layer.
        tiny_spec(
            "gemma4_text-moe",
            "gemma4_text",
            126,
            num_hidden_layers=4,
            intermediate_size=64,
            tie_word_embeddings=True,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=SLIDING_WINDOW,
            sliding_window_pattern=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=0,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
            hidden_activation="gelu_pytorch_tanh",
        ),
        # Falcon-H1: every layer runs attention and Mamba-2 side by side (a CacheList of
        # SSM state and KV per layer). Untied head: mlx-lm folds the muP multipliers into
        # Hugging Face weights when it converts them, so these mlx weights run without them.
        tiny_spec(
            "falcon_h1",
            "falcon_h1",
            127,
            rope_theta=100000000000.0,
            rms_norm_eps=1e-5,
            head_dim=16,
            mamba_d_conv=4,
            mamba_d_head=16,
            mamba_d_ssm=128,
            mamba_d_state=16,
            mamba_expand=2,
            mamba_n_groups=1,
            mamba_n_heads=8,
            mamba_chunk_size=128,
        ),
        # Jamba: Mamba on layers 0, 1 and 3, attention (no rope) on layer 2; layers 1
        # and 3 a mixture of 4 experts (2 active).
        tiny_spec(
            "jamba",
            "jamba",
            128,
            num_hidden_layers=4,
            tie_word_embeddings=True,
            attn_layer_offset=2,
            attn_layer_period=4,
            expert_layer_offset=1,
            expert_layer_period=2,
            mamba_d_conv=4,
            mamba_d_state=16,
            mamba_expand=2,
            mamba_dt_rank="auto",
            mamba_proj_bias=False,
            mamba_conv_bias=True,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        # OLMo 3: sliding window on layers 0-2, full attention on layer 3; q/k norms.
        tiny_spec(
            "olmo3",
            "olmo3",
            129,
            num_hidden_layers=4,
            num_key_value_heads=4,
            rope_theta=500000.0,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
        # EXAONE 4.0: sliding window (with rope) on layers 0-2, full attention without
        # rope on layer 3; llama3 rope scaling.
        tiny_spec(
            "exaone4",
            "exaone4",
            130,
            num_hidden_layers=4,
            max_position_embeddings=131072,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            head_dim=16,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 16.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
            sliding_window=SLIDING_WINDOW,
            sliding_window_pattern="LLLG",
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
        *MORE_FAMILIES,
        dataclasses.replace(_LLAMA, name="llama-4bit", quantize=(4, 32)),
        dataclasses.replace(_QWEN3, name="qwen3-8bit", quantize=(8, 64)),
        dataclasses.replace(_QWEN3_MOE, name="qwen3_moe-4bit", quantize=(4, 64)),
    )
}

# Families whose caches the batch cannot hold yet: opening one is refused with ModelLoadError.
# Llama 4 attends within fixed 32-token chunks on 3 layers of 4 (ChunkedKVCache).
UNSUPPORTED: dict[str, BuiltinSpec] = {
    "llama4": dataclasses.replace(
        tiny_spec("llama4", "llama4", 120, num_hidden_layers=4),
        layout="text_config",
        extra=config_fields(
            text_config={
                "model_type": "llama4_text",
                "attention_bias": False,
                "attention_chunk_size": 32,
                "head_dim": 16,
                "interleave_moe_layer_step": 1,
                "intermediate_size_mlp": 128,
                "num_experts_per_tok": 1,
                "num_local_experts": 2,
                "rms_norm_eps": 1e-5,
                "rope_scaling": None,
                "use_qk_norm": True,
            }
        ),
    ),
}

EXPECTED_CACHES: dict[str, str] = {
    "llama": "KK",
    "qwen3": "KK",
    "qwen3_moe": "KK",
    "gemma3_text": "RRKR",
    "gpt_oss": "RKRK",
    "mistral3": "KK",
    "mistral3-mistral": "KK",
    "ministral3": "KK",
    "phi3": "KK",
    "olmo2": "KK",
    "smollm3": "KKKK",
    "deepseek_v3": "KK",
    "qwen3_next": "AAAK",
    "lfm2": "AAKA",
    "nemotron_h": "AKA",
    "granitemoehybrid": "AKAA",
    "qwen3_5": "AAAK",
    "qwen3_5_moe": "AAAK",
    "gemma4_text": "RK",
    "cohere2": "RRRK",
    "mamba2": "AA",
    "gemma4_text-moe": "RKRK",
    "falcon_h1": "LL",
    "jamba": "AAKA",
    "olmo3": "RRRK",
    "exaone4": "RRRK",
    "qwen2": "KK",
    "mixtral": "KK",
    "starcoder2": "KK",
    "glm4_moe": "KK",
    "granite": "KK",
    "minicpm3": "KK",
    "kimi_linear": "AAAK",
    "plamo2": "AKAK",
    "recurrent_gemma": "AARA",
    "rwkv7": "AA",
    "gemma2": "KK",
    "gemma3n": "RK",
    "llama-4bit": "KK",
    "qwen3-8bit": "KK",
    "qwen3_moe-4bit": "KK",
}


def build(name: str, root: Path | str, progress: Progress | None = None) -> Path:
    """Build (or find) family `name` under `root`; returns its model directory."""
    return ensure_model(FAMILIES.get(name) or UNSUPPORTED[name], root=root, progress=progress)
