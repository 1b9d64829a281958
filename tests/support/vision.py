"""Images for vision tests, and mlx-vlm's own generation (the reference vision parity compares to)."""

from __future__ import annotations

import base64
import importlib
import io

import numpy as np
from PIL import Image

from tests.support.config import builtin_dir

VISION_MODEL = "builtin:tiny-idefics3"
# One built-in per family served (Idefics3: tiles and a global view, plain llama; Gemma 3: one
# pooled view, sliding windows between global layers; Qwen2.5-VL: tokens by the image's size,
# mRoPE positions).
VISION_MODELS = ("builtin:tiny-idefics3", "builtin:tiny-gemma3-vision", "builtin:tiny-qwen2.5-vl")
QUESTION = "Describe this picture."


def png(seed: int, width: int = 56, height: int = 40) -> bytes:
    """A PNG of random pixels (seeded)."""
    pixels = np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(image: bytes | str, question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


class VisionReference:
    """mlx-vlm's model and processor for the vision built-in, and its greedy `stream_generate`."""

    def __init__(self, model: str = VISION_MODEL) -> None:
        from mlx_vlm import load

        self.name = model
        self.model, self.processor = load(str(builtin_dir(model.removeprefix("builtin:"))))
        self.processor.tokenizer.stopping_criteria = lambda _token: False  # EOS ignored, as the requests do
        self._dispatch = importlib.import_module("mlx_vlm.generate.dispatch")

    @property
    def image_token_id(self) -> int:
        config = self.model.config
        return getattr(config, "image_token_id", None) or config.image_token_index

    def prompt_ids(self, messages: list[dict], images: list[bytes]) -> list[int]:
        pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        return [int(t) for t in self.processor(text=[self.prompt(messages)], images=[pictures], return_tensors="np")["input_ids"][0]]

    def prompt(self, messages: list[dict]) -> str:
        """`messages` rendered as the runtime renders them (image parts as placeholders)."""
        shown = [
            {**m, "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]} if isinstance(m["content"], list) else m for m in messages
        ]
        return self.processor.tokenizer.apply_chat_template(shown, add_generation_prompt=True, tokenize=False)

    def greedy(self, messages: list[dict], images: list[bytes], max_tokens: int) -> list[int]:
        pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        results = self._dispatch.stream_generate(
            self.model, self.processor, self.prompt(messages), image=pictures or None, max_tokens=max_tokens, temperature=0.0
        )
        # (Its last item repeats the last token.)
        return [r.token for r in results][:max_tokens]
