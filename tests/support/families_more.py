"""More tiny families for `tests.support.families.FAMILIES` (the later half of its table, kept
in its own module for size; `FAMILIES` lists them in this order after its own).

Each is a `BuiltinSpec` at the tiny built-ins' size (`engine.builtin.catalog.tiny_spec`).
"""

from __future__ import annotations

import dataclasses

from engine.builtin import TINY_TOKENIZER, BuiltinSpec, config_fields
from engine.builtin.catalog import tiny_spec

# The sliding window of every windowed family: prompts of a few hundred tokens exceed it.
SLIDING_WINDOW = 32

MORE_FAMILIES: tuple[BuiltinSpec, ...] = (
    # Qwen 2.5: biased q/k/v projections; tied head.
    tiny_spec("qwen2", "qwen2", 132, intermediate_size=160, rope_theta=1000000.0, tie_word_embeddings=True),
    # Mixtral: every MLP a mixture of 4 experts (2 active).
    tiny_spec(
        "mixtral",
        "mixtral",
        133,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # StarCoder2: layer norms and biases everywhere, a GELU MLP; tied head.
    tiny_spec(
        "starcoder2",
        "starcoder2",
        134,
        max_position_embeddings=16384,
        rope_theta=999999.4420358813,
        tie_word_embeddings=True,
        norm_epsilon=1e-5,
        use_bias=True,
        hidden_act="gelu_pytorch_tanh",
    ),
    # GLM-4.5: layer 0 dense, layer 1 a mixture of 4 routed experts (2 active,
    # sigmoid scores, noaux_tc) and a shared expert; partial rope, q/k norms.
    tiny_spec(
        "glm4_moe",
        "glm4_moe",
        135,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        head_dim=32,
        partial_rotary_factor=0.5,
        rope_scaling=None,
        use_qk_norm=True,
        attention_bias=True,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
    ),
    # Granite 3: embedding, attention, residual and logit multipliers.
    tiny_spec(
        "granite",
        "granite",
        136,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
        # Granite's 12, 0.22 and 8 make random weights echo one token.
        embedding_multiplier=1.0,
        attention_multiplier=0.0625,
        residual_multiplier=1.0,
        logits_scaling=4.0,
    ),
    # MiniCPM 3: multi-head latent attention with LongRoPE; scaled embeddings,
    # residuals and logits.
    tiny_spec(
        "minicpm3",
        "minicpm3",
        137,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        dim_model_base=16,
        scale_depth=1.4,
        scale_emb=12,
        rope_scaling={
            "type": "longrope",
            "rope_type": "longrope",
            "original_max_position_embeddings": 2048,
            "short_factor": [1.0, 1.05, 1.1, 1.2],
            "long_factor": [1.0, 1.5, 2.5, 4.0],
        },
    ),
    # Kimi Linear: Kimi delta attention (with short convolutions) on layers 0-2,
    # multi-head latent attention without rope on layer 3; layers 1-3 a mixture of
    # 4 experts (2 active, sigmoid scores) and a shared expert.
    tiny_spec(
        "kimi_linear",
        "kimi_linear",
        138,
        num_hidden_layers=4,
        num_key_value_heads=4,
        max_position_embeddings=1048576,
        rms_norm_eps=1e-5,
        head_dim=16,
        linear_attn_config={
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        model_max_length=1048576,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mla_use_nope=True,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        moe_router_activation_func="sigmoid",
        moe_renormalize=True,
        routed_scaling_factor=2.446,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
    ),
    # PLaMo 2: Mamba-2 on layers 0 and 2, attention on layers 1 and 3 (mamba_step 2).
    tiny_spec(
        "plamo2",
        "plamo2",
        139,
        num_hidden_layers=4,
        tie_word_embeddings=True,
        hidden_size_per_head=16,
        attention_window_size=2048,
        full_attention_idx=[],
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_num_heads=8,
        mamba_step=2,
        mamba_chunk_size=256,
        mamba_enabled=True,
    ),
    # RecurrentGemma (Griffin): RG-LRU recurrent blocks on layers 0, 1 and 3, local
    # attention (window 32) on layer 2; soft-capped logits.
    tiny_spec(
        "recurrent_gemma",
        "recurrent_gemma",
        140,
        num_hidden_layers=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        attention_bias=False,
        conv1d_width=4,
        logits_soft_cap=30.0,
        attention_window_size=SLIDING_WINDOW,
        lru_width=64,
        partial_rotary_factor=0.5,
        embeddings_scale_by_sqrt_dim=True,
        block_types=["recurrent", "recurrent", "attention"],
        hidden_activation="gelu_pytorch_tanh",
    ),
    # RWKV-7: time mixing (WKV state, token shift) and channel mixing state on every layer.
    tiny_spec(
        "rwkv7",
        "rwkv7",
        141,
        intermediate_size=256,
        norm_eps=1e-5,
        head_dim=16,
        a_low_rank_dim=16,
        v_low_rank_dim=16,
        gate_low_rank_dim=32,
        decay_low_rank_dim=16,
    ),
    # Gemma 2: attention and final logit soft-capping; mlx-lm ignores its sliding
    # window (every layer full attention); grouped queries (2 per KV head).
    dataclasses.replace(
        tiny_spec(
            "gemma2",
            "gemma2",
            131,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            head_dim=16,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=SLIDING_WINDOW,
            hidden_activation="gelu_pytorch_tanh",
        ),
        omit_weights=("lm_head",),
    ),
    # Gemma 3n (language model in text_config): sliding layers 0 and 2, full layers
    # 1 and 3; layers 2-3 reuse layers 0-1's KV; AltUp, LAuReL, per-layer inputs and
    # sparse activations on layers 0-1.
    dataclasses.replace(
        tiny_spec("gemma3n", "gemma3n", 142, num_hidden_layers=4, tie_word_embeddings=True),
        layout="text_config",
        extra=config_fields(
            architectures=["Gemma3nForConditionalGeneration"],
            text_config={
                "model_type": "gemma3n_text",
                "head_dim": 16,
                "num_kv_shared_layers": 2,
                "vocab_size_per_layer_input": TINY_TOKENIZER.vocab_size,
                "sliding_window": SLIDING_WINDOW,
                "rope_local_base_freq": 10000.0,
                "rope_theta": 1000000.0,
                "final_logit_softcapping": 30.0,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0],
                "hidden_size_per_layer_input": 16,
                "altup_num_inputs": 4,
                "altup_coef_clip": 120.0,
                "altup_correct_scale": True,
                "altup_active_idx": 0,
                "laurel_rank": 16,
                "hidden_activation": "gelu_pytorch_tanh",
            },
        ),
    ),
)
