"""Random-weight vision-language built-ins, made from mlx-vlm's own classes (MLX thread).

A directory mlx-vlm's `load` reads like a published SmolVLM/Idefics3 checkpoint: config.json
(`vision_config`, `text_config`), model.safetensors, a tokenizer with the image tokens added and
a chat template that renders image parts as `<image>`, the image processor's
preprocessor_config.json and processor_config.json (`image_seq_len`). Deterministic: the same
spec gives the same files (the weights from MLX's seeded generator, the tokenizer from the
built-ins' trained one).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from engine.builtin.tokenizer import CHAT_TEMPLATE, ENDOFTEXT, IM_END, TokenizerSpec, spec_digest

# Bump when the files a vision built-in is made of change.
VISION_FORMAT = 2
VISION_FILES = ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json", "processor_config.json")


def vision_chat_template(placeholder: str) -> str:
    """The built-ins' ChatML template with image parts rendered as the processor's
    placeholder, which the processor expands to the image's tokens."""
    template = CHAT_TEMPLATE.replace(
        "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}",
        "{%- if part.type == 'text' -%}{{- part.text -}}{%- elif part.type == 'image' -%}{{- '" + placeholder + "' -}}{%- endif -%}",
    )
    assert template != CHAT_TEMPLATE
    return template


IDEFICS3_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)


@dataclass(frozen=True)
class VisionSpec:
    """An Idefics3 (SmolVLM's architecture): a SigLIP-style vision tower, pixel shuffle by
    `scale_factor`, a llama text model. Images are split into tiles of `image_size` pixels (at
    most `longest_edge` on the long side) plus a global view, each `(image_size / patch_size)^2
    / scale_factor^2` tokens."""

    name: str
    seed: int
    tokenizer: TokenizerSpec
    hidden_size: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vision_hidden_size: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    patch_size: int = 8
    image_size: int = 32
    scale_factor: int = 2
    longest_edge: int = 64
    max_position_embeddings: int = 4096
    # "idefics3", or "gemma3" (then `sliding_window` positions on all but every
    # `sliding_window_pattern`-th layer, and `image_size`/`patch_size` patches pooled to
    # `image_seq_len` tokens per image, no tiles).
    family: str = "idefics3"
    sliding_window: int = 8
    sliding_window_pattern: int = 2

    @property
    def image_seq_len(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2

    @property
    def placeholder(self) -> str:
        return {"gemma3": "<start_of_image>", "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}.get(self.family, "<image>")

    def digest(self) -> str:
        return spec_digest(self, VISION_FORMAT)

    def directory_name(self) -> str:
        return f"{self.name}-{self.digest()[:12]}"


def build_vision_model(spec: VisionSpec, tokenizer_json: Path, out: Path, say) -> None:
    """Write `spec`'s directory into the empty directory `out`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    started = time.perf_counter()
    say(f"building builtin vision model {spec.name!r}")
    module, config, parts = {"gemma3": _gemma3, "qwen2_5_vl": _qwen2_5_vl}.get(spec.family, _idefics3)(spec, tokenizer_json, out)
    from mlx_vlm.utils import update_module_configs

    # As mlx-vlm's `load_model` makes the config (some families' `from_dict` rewrites its input).
    loading = json.loads(json.dumps(config))
    model_config = update_module_configs(module.ModelConfig.from_dict(loading), module, loading, ["text", "vision"])
    mx.random.seed(spec.seed)
    model = module.Model(model_config)
    projector = getattr(model, "multi_modal_projector", None)
    if projector is not None and hasattr(projector, "mm_input_projection_weight"):
        # Gemma 3 initialises its projection to ones (every image alike); a random one lets
        # tests tell images apart.
        shape = projector.mm_input_projection_weight.shape
        projector.mm_input_projection_weight = mx.random.normal(shape) / shape[0] ** 0.5
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    num_parameters = sum(v.size for v in weights.values())
    say(f"built {spec.name!r} ({num_parameters / 1e6:.2f}M params, {parts}) in {time.perf_counter() - started:.1f}s")


def _tokenizer(spec: VisionSpec, tokenizer_json: Path, out: Path, **extra):
    """The built-ins' trained tokenizer with the image tokens added and the chat template."""
    from transformers import PreTrainedTokenizerFast

    shutil.copyfile(tokenizer_json, out / "base-tokenizer.json")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(out / "base-tokenizer.json"), eos_token=IM_END, pad_token=ENDOFTEXT, **extra)
    (out / "base-tokenizer.json").unlink()
    return tokenizer


def _save_tokenizer(spec: VisionSpec, tokenizer, out: Path) -> None:
    tokenizer.chat_template = vision_chat_template(spec.placeholder)
    tokenizer.model_max_length = spec.max_position_embeddings
    tokenizer.save_pretrained(out)


def _top_config(spec: VisionSpec, tokenizer, architecture: str, end_tokens: list[str]) -> dict:
    return {
        "architectures": [architecture],
        "model_type": spec.family,
        "vocab_size": len(tokenizer),
        "eos_token_id": [tokenizer.convert_tokens_to_ids(t) for t in end_tokens],
        "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "max_position_embeddings": spec.max_position_embeddings,
        "torch_dtype": "float32",
    }


def _text_config(spec: VisionSpec, model_type: str, vocab: int, **extra) -> dict:
    return {
        "model_type": model_type,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": spec.max_position_embeddings,
        **extra,
    }


def _vision_config(spec: VisionSpec, model_type: str) -> dict:
    return {
        "model_type": model_type,
        "hidden_size": spec.vision_hidden_size,
        "num_attention_heads": spec.vision_heads,
        "patch_size": spec.patch_size,
        "num_hidden_layers": spec.vision_layers,
        "intermediate_size": 2 * spec.vision_hidden_size,
        "image_size": spec.image_size,
    }


def _idefics3(spec: VisionSpec, tokenizer_json: Path, out: Path):
    from mlx_vlm.models import idefics3
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _tokenizer(spec, tokenizer_json, out)
    tokenizer.add_tokens(list(IDEFICS3_TOKENS), special_tokens=True)
    _save_tokenizer(spec, tokenizer, out)
    Idefics3ImageProcessorPil(size={"longest_edge": spec.longest_edge}, max_image_size={"longest_edge": spec.image_size}).save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"image_seq_len": spec.image_seq_len}, indent=2) + "\n")
    config = {
        **_top_config(spec, tokenizer, "Idefics3ForConditionalGeneration", [IM_END, "<end_of_utterance>"]),
        "scale_factor": spec.scale_factor,
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
        "text_config": _text_config(spec, "llama", len(tokenizer)),
        "vision_config": _vision_config(spec, "idefics3_vision"),
    }
    return idefics3, config, f"{spec.image_seq_len} tokens per tile"


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def _gemma3(spec: VisionSpec, tokenizer_json: Path, out: Path):
    from mlx_vlm.models import gemma3
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = _tokenizer(spec, tokenizer_json, out, extra_special_tokens=GEMMA3_TOKENS)
    _save_tokenizer(spec, tokenizer, out)
    Gemma3ImageProcessorPil(size={"height": spec.image_size, "width": spec.image_size}).save_pretrained(out)
    processor = {"image_seq_length": spec.image_seq_len, "processor_class": "Gemma3Processor"}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    head_dim = spec.hidden_size // spec.num_attention_heads
    text = _text_config(
        spec,
        "gemma3_text",
        len(tokenizer),
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=spec.sliding_window,
        sliding_window_pattern=spec.sliding_window_pattern,
        mm_tokens_per_image=spec.image_seq_len,
    )
    config = {
        **_top_config(spec, tokenizer, "Gemma3ForConditionalGeneration", [IM_END]),
        # Image features are scaled by 1 / sqrt(this), mlx-vlm's top-level hidden_size.
        "hidden_size": spec.hidden_size,
        "image_token_index": tokenizer.convert_tokens_to_ids(GEMMA3_TOKENS["image_token"]),
        "mm_tokens_per_image": spec.image_seq_len,
        "text_config": text,
        "vision_config": _vision_config(spec, "gemma3_vision"),
    }
    return gemma3, config, f"{spec.image_seq_len} tokens per image"


QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _qwen2_5_vl(spec: VisionSpec, tokenizer_json: Path, out: Path):
    """Qwen2.5-VL: `patch_size` patches merged 2x2 into tokens (an image's token count follows
    its size, within `image_size`^2 pixels), mRoPE positions (time, height, width) over the
    image, and a windowed vision tower."""
    from mlx_vlm.models import qwen2_5_vl
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

    tokenizer = _tokenizer(spec, tokenizer_json, out)
    tokenizer.add_tokens(list(QWEN_VL_TOKENS), special_tokens=True)
    _save_tokenizer(spec, tokenizer, out)
    unit = spec.patch_size * 2
    Qwen3VLImageProcessor(
        patch_size=spec.patch_size, temporal_patch_size=2, merge_size=2, min_pixels=unit * unit, max_pixels=spec.image_size * spec.image_size
    ).save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}, indent=2) + "\n")
    head_dim = spec.hidden_size // spec.num_attention_heads
    section = [head_dim // 8, 3 * head_dim // 16, head_dim // 2 - head_dim // 8 - 3 * head_dim // 16]
    text = _text_config(spec, "qwen2_5_vl", len(tokenizer), rope_scaling={"type": "mrope", "mrope_section": section}, tie_word_embeddings=False)
    vision = {
        "model_type": "qwen2_5_vl",
        "depth": spec.vision_layers,
        "hidden_size": spec.vision_hidden_size,
        "intermediate_size": 2 * spec.vision_hidden_size,
        "out_hidden_size": spec.hidden_size,
        "num_heads": spec.vision_heads,
        "patch_size": spec.patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 4 * spec.patch_size,
        "fullatt_block_indexes": [spec.vision_layers - 1],
    }
    ids = tokenizer.convert_tokens_to_ids
    config = {
        **_top_config(spec, tokenizer, "Qwen2_5_VLForConditionalGeneration", [IM_END]),
        # (Qwen2.5-VL checkpoints keep the language model's fields at the top level.)
        **{k: v for k, v in text.items() if k != "model_type"},
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
        "text_config": text,
        "vision_config": vision,
    }
    return qwen2_5_vl, config, "an image's tokens by its size"
