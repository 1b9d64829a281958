"""Random-weight diffusion language built-ins, made from mlx-vlm's own classes (MLX thread).

A directory mlx-vlm's `load_model` reads like a published checkpoint (text only): for
DiffusionGemma, config.json (`text_config`, `canvas_length`, `generation_config`); for LLaDA2-MoE,
its flat config with a mask token (added to the tokenizer as `<|mask|>`); model.safetensors and
the built-ins' trained tokenizer with their ChatML template. Deterministic: the same spec gives
the same files.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from engine.builtin.tokenizer import CHAT_TEMPLATE, ENDOFTEXT, IM_END, TokenizerSpec, spec_digest

# Bump when the files a diffusion built-in is made of change.
DIFFUSION_FORMAT = 1
DIFFUSION_FILES = ("config.json", "model.safetensors", "tokenizer.json")


MASK_TOKEN = "<|mask|>"


@dataclass(frozen=True)
class DiffusionSpec:
    """A DiffusionGemma (Gemma 4's mixture-of-experts backbone as an encoder over the prompt
    and a decoder that denoises a canvas of `canvas_length` positions), or with `family`
    "llada2_moe" a LLaDA2-MoE (one mixture-of-experts stack that unmasks blocks of 32 positions
    attending to the cache before them), text only."""

    name: str
    seed: int
    tokenizer: TokenizerSpec
    family: str = "diffusion_gemma"
    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_global_key_value_heads: int = 1
    head_dim: int = 16
    global_head_dim: int = 32
    sliding_window: int = 8
    num_experts: int = 4
    top_k_experts: int = 2
    canvas_length: int = 16
    max_denoising_steps: int = 12
    max_position_embeddings: int = 4096

    def digest(self) -> str:
        return spec_digest(self, DIFFUSION_FORMAT)

    def directory_name(self) -> str:
        return f"{self.name}-{self.digest()[:12]}"


def build_diffusion_model(spec: DiffusionSpec, tokenizer_json: Path, out: Path, say) -> None:
    """Write `spec`'s directory into the empty directory `out`."""
    from transformers import PreTrainedTokenizerFast

    started = time.perf_counter()
    say(f"building builtin diffusion model {spec.name!r}")
    shutil.copyfile(tokenizer_json, out / "base-tokenizer.json")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(out / "base-tokenizer.json"), eos_token=IM_END, pad_token=ENDOFTEXT)
    (out / "base-tokenizer.json").unlink()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = spec.max_position_embeddings
    if spec.family == "llada2_moe":
        tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    tokenizer.save_pretrained(out)
    config = _llada2_config(spec, tokenizer) if spec.family == "llada2_moe" else _diffusion_gemma_config(spec, tokenizer)
    num_parameters = _write_weights(spec, config, out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    say(f"built {spec.name!r} ({num_parameters / 1e6:.2f}M params, {spec.canvas_length}-position canvas) in {time.perf_counter() - started:.1f}s")


def _shape(spec: DiffusionSpec, tokenizer) -> dict:
    """The config keys both families name alike."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "num_experts": spec.num_experts,
        "max_position_embeddings": spec.max_position_embeddings,
        "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    }


def _llada2_config(spec: DiffusionSpec, tokenizer) -> dict:
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        **_shape(spec, tokenizer),
        "num_experts_per_tok": spec.top_k_experts,
        "num_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "tie_word_embeddings": False,
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "mask_token_id": tokenizer.convert_tokens_to_ids(MASK_TOKEN),
        "torch_dtype": "float32",
    }


def _write_weights(spec: DiffusionSpec, config: dict, out: Path) -> int:
    """The model made from mlx-vlm's classes with the config as its `load_model` makes it,
    seeded; its weights written. Returns its parameter count."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.models import diffusion_gemma, llada2_moe
    from mlx_vlm.utils import update_module_configs

    loading = json.loads(json.dumps(config))
    mx.random.seed(spec.seed)
    model: nn.Module
    if spec.family == "llada2_moe":
        model = llada2_moe.Model(llada2_moe.ModelConfig.from_dict(loading))
        for layer in model.language_model.model.layers[1:]:  # (routers start at zero: random ones route)
            gate = layer.mlp.gate
            gate.weight = 0.5 * mx.random.normal(gate.weight.shape)
    else:
        model_config = update_module_configs(diffusion_gemma.ModelConfig.from_dict(loading), diffusion_gemma, loading, ["text", "vision"])
        model = diffusion_gemma.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return sum(v.size for v in weights.values())


def _diffusion_gemma_config(spec: DiffusionSpec, tokenizer) -> dict:
    eos = [tokenizer.convert_tokens_to_ids(IM_END)]
    return {
        "architectures": ["DiffusionGemma4ForDiffusionLM"],
        "model_type": "diffusion_gemma",
        "canvas_length": spec.canvas_length,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "generation_config": {"max_denoising_steps": spec.max_denoising_steps, "eos_token_id": eos},
        "text_config": {
            "model_type": "diffusion_gemma_text",
            **_shape(spec, tokenizer),
            "num_global_key_value_heads": spec.num_global_key_value_heads,
            "global_head_dim": spec.global_head_dim,
            "sliding_window": spec.sliding_window,
            "layer_types": ["sliding_attention"] * (spec.num_hidden_layers - 1) + ["full_attention"],
            "top_k_experts": spec.top_k_experts,
            "eos_token_id": eos,
        },
        # (mlx-vlm builds a vision tower whatever the config says: a tiny one, unused: the
        # runtime serves this family's text prompts.)
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 16,
            "patch_size": 8,
            "position_embedding_size": 64,
        },
    }
