"""Model memory, on the MLX thread: weight bytes before a load, buffers back after one."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import mlx.core as mx

from engine.builtin import BUILTIN_MODELS, PACKAGED_MODELS, builtin_name, packaged_model_path, parameter_count
from engine.model.gguf import is_gguf
from engine.model.gguf.format import GGUFFile

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def estimate_weight_bytes(path: str) -> int:
    """Weight bytes as the model will be loaded, before it has been: float32 on the CPU
    backend, from its parameter shapes where built in or in a GGUF header, else from its files
    (16-bit weights doubled)."""
    name = builtin_name(path)
    if name is not None and name in BUILTIN_MODELS:
        return 4 * parameter_count(BUILTIN_MODELS[name])
    source = packaged_model_path(name) if name in PACKAGED_MODELS else Path(path).expanduser()
    if is_gguf(source):
        with GGUFFile.open(source) as file:
            return sum(4 * math.prod(t.shape) for t in file.tensors.values())
    directory = source
    files = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    try:
        dtype = json.loads((directory / "config.json").read_text()).get("torch_dtype", "float32")
    except (OSError, ValueError):
        dtype = "float32"
    return files * (2 if dtype in ("float16", "bfloat16") else 1)


def release_memory() -> None:
    """On the MLX thread: return a swapped-out model's buffers to the system."""
    gc.collect()
    mx.clear_cache()
