"""LoRA adapters built with mlx-lm's own LoRA layers and saved in its format, for tests and
benchmarks (deterministic: the weights come from a seed).

`mlx_lm.lora` freezes the model, turns the linear layers of the last `num_layers` blocks into
`LoRALinear`s and saves the trainable parameters with `adapter_config.json`; this does the same
without training: A is mlx-lm's own initialization, B (zero at mlx-lm's start) is drawn so the
adapter changes the model's choices.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model


def make_lora_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int = 8,
    scale: float = 20.0,
    num_layers: int = 16,
    seed: int = 0,
    b_std: float = 0.02,
    keys: list[str] | None = None,
) -> Path:
    """Write `adapter_config.json` and `adapters.safetensors` to `out_dir`; returns it."""
    mx.random.seed(seed)
    model, _ = load_model(Path(model_dir))
    model.freeze()
    parameters: dict = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        parameters["keys"] = keys
    linear_to_lora_layers(model, num_layers, parameters)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    weights = {}
    for name, value in trainable.items():
        if name.endswith(".lora_b"):
            value = b_std * mx.random.normal(value.shape)
        weights[name] = value.astype(mx.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": parameters}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
