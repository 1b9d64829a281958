"""Random-weight vision-language built-ins, made from mlx-vlm's own classes (MLX thread).

A directory mlx-vlm's `load` reads like a published SmolVLM/Idefics3 checkpoint: config.json
(`vision_config`, `text_config`), model.safetensors, a tokenizer with the image tokens added and
a chat template that renders image parts as `<image>`, the image processor's
preprocessor_config.json and processor_config.json (`image_seq_len`). Deterministic: the same
spec gives the same files (the weights from MLX's seeded generator, the tokenizer from the
built-ins' trained one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from engine.builtin.tokenizer import CHAT_TEMPLATE, ENDOFTEXT, IM_END, TokenizerSpec

# Bump when the files a vision built-in is made of change.
VISION_FORMAT = 1
VISION_FILES = ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json", "processor_config.json")

# Image parts render as the processor's placeholder, which it expands to the image's tokens.
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}",
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- elif part.type == 'image' -%}{{- '<image>' -}}{%- endif -%}",
)
assert VISION_CHAT_TEMPLATE != CHAT_TEMPLATE

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
    vision_layers: int = 1
    vision_heads: int = 2
    patch_size: int = 8
    image_size: int = 32
    scale_factor: int = 2
    longest_edge: int = 64
    max_position_embeddings: int = 4096
    family: str = "idefics3"

    @property
    def image_seq_len(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2

    def digest(self) -> str:
        fields = {**dataclasses.asdict(self), "tokenizer": self.tokenizer.digest(), "format": VISION_FORMAT}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    def directory_name(self) -> str:
        return f"{self.name}-{self.digest()[:12]}"


def build_vision_model(spec: VisionSpec, tokenizer_json: Path, out: Path, say) -> None:
    """Write `spec`'s directory into the empty directory `out`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import idefics3
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    started = time.perf_counter()
    say(f"building builtin vision model {spec.name!r}")
    shutil.copyfile(tokenizer_json, out / "base-tokenizer.json")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(out / "base-tokenizer.json"), eos_token=IM_END, pad_token=ENDOFTEXT)
    (out / "base-tokenizer.json").unlink()
    tokenizer.add_tokens(list(IDEFICS3_TOKENS), special_tokens=True)
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    tokenizer.model_max_length = spec.max_position_embeddings
    tokenizer.save_pretrained(out)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": spec.longest_edge}, max_image_size={"longest_edge": spec.image_size})
    image_processor.save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"image_seq_len": spec.image_seq_len}, indent=2) + "\n")
    vocab = len(tokenizer)
    text = {
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": spec.max_position_embeddings,
    }
    vision = {
        "model_type": "idefics3_vision",
        "hidden_size": spec.vision_hidden_size,
        "num_attention_heads": spec.vision_heads,
        "patch_size": spec.patch_size,
        "num_hidden_layers": spec.vision_layers,
        "intermediate_size": 2 * spec.vision_hidden_size,
        "image_size": spec.image_size,
    }
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": spec.family,
        "scale_factor": spec.scale_factor,
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
        "vocab_size": vocab,
        "eos_token_id": [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids("<end_of_utterance>")],
        "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "max_position_embeddings": spec.max_position_embeddings,
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": vision,
    }
    model_config = idefics3.ModelConfig.from_dict(
        {**config, "text_config": idefics3.TextConfig.from_dict(text), "vision_config": idefics3.VisionConfig.from_dict(vision)}
    )
    mx.random.seed(spec.seed)
    model = idefics3.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    num_parameters = sum(v.size for v in weights.values())
    say(f"built {spec.name!r} ({num_parameters / 1e6:.2f}M params) in {time.perf_counter() - started:.1f}s")
