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
        # Gated-delta linear attention on layers 0-2, full attention on layer 3; MoE MLPs:
        # the built-in `tiny-qwen3next` with its own seed.
        dataclasses.replace(BUILTIN_MODELS["tiny-qwen3next"], name="qwen3_next", seed=112),
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
        # Qwen 3.5 (language model in text_config): gated-delta linear attention on
        # layers 0-2, gated full attention on layer 3; dense MLPs; tied head.
        dataclasses.replace(
            _tiny("qwen3_5", "qwen3_5", 121, num_hidden_layers=4, tie_word_embeddings=True),
            layout="text_config",
            extra=config_fields(
                architectures=["Qwen3_5ForConditionalGeneration"],
                text_config={"model_type": "qwen3_5_text", **_QWEN3_5_TEXT},
            ),
        ),
        # Qwen 3.5 MoE: as qwen3_5, every MLP a mixture of 4 experts (2 active) plus a shared expert.
        dataclasses.replace(
            _tiny("qwen3_5_moe", "qwen3_5_moe", 122, num_hidden_layers=4),
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        # Qwen 2.5: biased q/k/v projections; tied head.
        _tiny("qwen2", "qwen2", 132, intermediate_size=160, rope_theta=1000000.0, tie_word_embeddings=True),
        # Mixtral: every MLP a mixture of 4 experts (2 active).
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
        _tiny(
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
            _tiny(
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
            _tiny("gemma3n", "gemma3n", 142, num_hidden_layers=4, tie_word_embeddings=True),
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
        dataclasses.replace(_LLAMA, name="llama-4bit", quantize=(4, 32)),
        dataclasses.replace(_QWEN3, name="qwen3-8bit", quantize=(8, 64)),
        dataclasses.replace(_QWEN3_MOE, name="qwen3_moe-4bit", quantize=(4, 64)),
    )
}

# Families whose caches the batch cannot hold yet: opening one is refused with ModelLoadError.
# Llama 4 attends within fixed 32-token chunks on 3 layers of 4 (ChunkedKVCache).
UNSUPPORTED: dict[str, BuiltinSpec] = {
    "llama4": dataclasses.replace(
        _tiny("llama4", "llama4", 120, num_hidden_layers=4),
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
