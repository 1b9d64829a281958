"""GGUF model files (llama.cpp's format) served directly: a safe header reader (`format`),
architectures mapped onto mlx-lm's classes (`arch`), tensors as MLX arrays (`tensors`), the
tokenizer rebuilt from metadata (`tokenizer`) and the loader (`model.load_gguf`)."""

from pathlib import Path

from engine.model.gguf.model import GGUFModel, load_gguf

SUFFIX = ".gguf"


def is_gguf(path: Path) -> bool:
    """Whether `path` names a GGUF file (by its name; the loader checks the contents)."""
    return path.suffix.lower() == SUFFIX


__all__ = ["SUFFIX", "GGUFModel", "is_gguf", "load_gguf"]
