"""Tiny random-weight models of many mlx-lm model families, for conformance tests.

`FAMILIES` maps a name (the mlx-lm model type, or ``<type>-<n>bit`` for quantized
copies) to a `BuiltinSpec`: hidden size 64, 2-4 layers, the tiny built-ins' tokenizer
(vocab 1024), at least 2048 positions, each family's own defaults wherever mlx-lm
has them. Sliding windows are 32 tokens, so prompts of a few hundred tokens exceed
them. `build(name, root)` builds one into ``<root>/models`` with the built-in
models' builder (the same deterministic weights, digest-named directories and
lock-then-rename), training the shared tokenizer once per root.

``EXPECTED_CACHES`` gives, per family, the caches ``make_prompt_cache`` returns:
one letter per cache, K for ``KVCache``, R for ``RotatingKVCache`` (window 32),
A for ``ArraysCache`` (SSM, gated-delta and convolution state).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine.builtin import TINY_TOKENIZER, BuiltinSpec, config_fields, ensure_model
from engine.builtin.models import Progress

SLIDING_WINDOW = 32


def _tiny(name: str, model_type: str, seed: int, **overrides: Any) -> BuiltinSpec:
    """A spec with the tiny defaults; `overrides` replaces named fields, the rest go to `extra`."""
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

_LLAMA = _tiny("llama", "llama", 100, tie_word_embeddings=True)
_QWEN3 = _tiny("qwen3", "qwen3", 101, rope_theta=1000000.0, tie_word_embeddings=True, head_dim=16)
_QWEN3_MOE = _tiny(
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
        # Sliding window on layers 0, 1 and 3, global attention on layer 2; tied head.
        dataclasses.replace(
            _tiny(
                "gemma3_text",
                "gemma3_text",
                103,
                num_hidden_layers=4,
                num_key_value_heads=1,
                rope_theta=1000000.0,
                tie_word_embeddings=True,
                head_dim=16,
                query_pre_attn_scalar=16,
                sliding_window=SLIDING_WINDOW,
                sliding_window_pattern=3,
                rope_local_base_freq=10000.0,
                hidden_activation="gelu_pytorch_tanh",
            ),
            omit_weights=("lm_head",),
        ),
        # Attention sinks, 4 experts (2 active), sliding and full layers alternating.
        _tiny(
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
            _tiny("mistral3", "mistral3", 105, max_position_embeddings=32768, rms_norm_eps=1e-5),
            layout="text_config",
            extra=config_fields(
                text_config={"model_type": "ministral3", "rope_parameters": _MINISTRAL3_ROPE},
            ),
        ),
        # Mistral Small 3.x's layout: text_config of model_type "mistral" (llama in mlx-lm).
        dataclasses.replace(
            _tiny("mistral3-mistral", "mistral3", 106, rope_theta=1000000000.0, rms_norm_eps=1e-5),
            layout="text_config",
            extra=config_fields(text_config={"model_type": "mistral"}),
        ),
        _tiny(
            "ministral3",
            "ministral3",
            107,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            head_dim=16,
            rope_parameters=_MINISTRAL3_ROPE,
        ),
        _tiny("phi3", "phi3", 108, rms_norm_eps=1e-5, max_position_embeddings=4096),
        _tiny("olmo2", "olmo2", 109, rope_theta=500000.0),
        # Layer 3 has no rotary embedding (no_rope_layer_interval 4).
        _tiny("smollm3", "smollm3", 110, num_hidden_layers=4, rope_theta=5000000.0, tie_word_embeddings=True, no_rope_layer_interval=4),
        # Multi-head latent attention; layer 0 dense, layer 1 a mixture of 4 routed
        # experts (2 active, sigmoid scores, noaux_tc) and a shared expert.
        _tiny(
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
        # Gated-delta linear attention on layers 0-2, full attention on layer 3; MoE MLPs.
        _tiny(
            "qwen3_next",
            "qwen3_next",
            112,
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
        # Short convolutions on layers 0, 1 and 3, attention on layer 2.
        _tiny(
            "lfm2",
            "lfm2",
            113,
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
        # Mamba-2, attention, Mamba-2, MLP (the MLP layer has no cache).
        _tiny(
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
        _tiny(
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
        dataclasses.replace(_LLAMA, name="llama-4bit", quantize=(4, 32)),
        dataclasses.replace(_QWEN3, name="qwen3-8bit", quantize=(8, 64)),
        dataclasses.replace(_QWEN3_MOE, name="qwen3_moe-4bit", quantize=(4, 64)),
    )
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
    "llama-4bit": "KK",
    "qwen3-8bit": "KK",
    "qwen3_moe-4bit": "KK",
}


def build(name: str, root: Path | str, progress: Progress | None = None) -> Path:
    """Build (or find) family `name` under `root`; returns its model directory."""
    return ensure_model(FAMILIES[name], root=root, progress=progress)
