"""The memory-bandwidth roofline of one decode step: bytes read per token over measured read bandwidth.

A single-stream decode step reads every weight the model multiplies by once, plus the KV of every
position so far, so `bandwidth / bytes` bounds its tokens per second. Bytes are counted as each
engine holds them: llama.cpp reads a GGUF's quantized blocks as stored (KV in float16, its default);
mlxrt on the CPU keeps quantized weights in MLX's affine format for its quantized kernels
(`model.cpu_dequantize` "auto" where the kernels serve; float32 scales and biases per group of 32,
the biases unread where they are the scales times a power of two: Q4_0, Q8_0),
else dequantizes them to float32 at load while they fit half the memory, and keeps KV in the model's dtype (float32) unless `kv.bits` is set.
An embedding table is read one row per token, unless it is tied to the output (read whole).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

# mlxrt's "auto" keeps quantized weights quantized when their float32 form is over this share of memory
# (engine.model.weights.AUTO_MEMORY_SHARE; restated here so the bench process never imports mlx).
AUTO_MEMORY_SHARE = 0.5
FLOAT32_BYTES = 4
FLOAT16_BYTES = 2
_EMBEDDING = "token_embd.weight"
_OUTPUT = "output.weight"
# ggml types that are blocks of quantized values (F32, F16, BF16 are not).
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True)
class Tensor:
    """One GGUF tensor as the roofline needs it: its element count and its stored bytes."""

    name: str
    elements: int
    nbytes: int
    qtype: str  # ggml type name, e.g. "Q4_1", "F32"

    @property
    def quantized(self) -> bool:
        return self.qtype not in _FLOAT_TYPES


@dataclass(frozen=True)
class Attention:
    """What sizes the KV read per position: layers, KV heads and their width."""

    layers: int
    kv_heads: int
    head_dim: int

    def kv_bytes_per_position(self, element_bytes: float) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


def gguf_tensors(path: str) -> tuple[list[Tensor], Attention]:
    """The tensors and attention shape of a GGUF file (its header only)."""
    from engine.model.gguf.format import GGUFFile

    with GGUFFile.open(path) as file:
        tensors = [Tensor(t.name, int(np.prod(t.shape)), t.nbytes, t.qtype.name) for t in file.tensors.values()]
        meta = file.metadata
        arch = meta["general.architecture"]
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads))
        return tensors, Attention(int(meta[f"{arch}.block_count"]), kv_heads, head_dim)


def _read_per_token(tensors: Iterable[Tensor]) -> list[Tensor]:
    """The tensors a decode step reads whole: all but an untied embedding table (one row of it is read)."""
    listed = list(tensors)
    tied = not any(t.name == _OUTPUT for t in listed)
    return [t for t in listed if t.name != _EMBEDDING or tied]


def llamacpp_weight_bytes(tensors: Iterable[Tensor]) -> int:
    """llama.cpp multiplies by the stored blocks: the bytes as in the file."""
    return sum(t.nbytes for t in _read_per_token(tensors))


def mlxrt_kernels_serve() -> bool:
    """Whether mlxrt's quantized CPU kernel can serve on this machine (`engine.native`: Linux
    x86-64 with AVX2 and FMA, not turned off by `MLXRT_NATIVE=0`), read without importing mlx."""
    from engine import native

    if not native.supported_platform() or os.environ.get("MLXRT_NATIVE", "1") == "0":
        return False
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def mlxrt_dequantizes(tensors: Iterable[Tensor], policy: str, memory_bytes: int, kernels: bool = False) -> bool:
    """Whether mlxrt on the CPU turns this model's quantized weights into float32 (`model.cpu_dequantize`;
    "auto" keeps them for its quantized kernels where those serve, `kernels`)."""
    quantized = [t for t in tensors if t.quantized]
    if not quantized or policy == "never" or (policy == "auto" and kernels):
        return False
    float_bytes = FLOAT32_BYTES * sum(t.elements for t in quantized)
    return policy == "always" or not memory_bytes or float_bytes <= AUTO_MEMORY_SHARE * memory_bytes


# Bytes per weight a lone row reads of a kept quantized tensor as mlxrt holds it: MLX's affine
# format, groups of 32 with a float32 scale and bias each (on the CPU every float is float32): Q4_0
# and Q4_1 as 4 bits, every other quantized type as 8 (Q8_0 as stored, K-quants requantized by the
# GGUF reader). Q4_0's and Q8_0's biases are -8 and -128 times their scales, which a lone row's
# product takes their term from (`engine.lanes.bias_ratio`): it reads their scales only.
_KEPT_BYTES = {"Q4_0": 0.5 + 4 / 32, "Q4_1": 0.5 + 8 / 32, "Q8_0": 1 + 4 / 32}
_KEPT_8BIT = 1 + 8 / 32


def mlxrt_weight_bytes(tensors: Iterable[Tensor], dequantized: bool) -> int:
    """mlxrt's CPU weights: float32 throughout, or the quantized tensors kept in MLX's affine format."""
    total = 0.0
    for t in _read_per_token(tensors):
        if t.quantized and not dequantized:
            total += t.elements * _KEPT_BYTES.get(t.qtype, _KEPT_8BIT)
        else:
            total += FLOAT32_BYTES * t.elements
    return int(total)


def bytes_per_token(weight_bytes: float, kv_bytes_per_position: float, prompt_tokens: int, new_tokens: int) -> float:
    """Bytes one decode step reads, averaged over a request's decode: KV at its mean length."""
    mean_positions = prompt_tokens + new_tokens / 2
    return weight_bytes + kv_bytes_per_position * mean_positions


def roofline_tok_s(bandwidth_bytes_s: float, per_token_bytes: float) -> float:
    return bandwidth_bytes_s / per_token_bytes if per_token_bytes > 0 else 0.0


def fraction_of_roofline(measured_tok_s: float, bandwidth_bytes_s: float, per_token_bytes: float) -> float:
    bound = roofline_tok_s(bandwidth_bytes_s, per_token_bytes)
    return measured_tok_s / bound if bound > 0 else 0.0


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, threads: int | None = None) -> float:
    """Bytes per second summing an `nbytes` float32 array, split over `threads` (default: the
    machine's cores; NumPy's reduction releases the GIL), best of `repeats`."""
    threads = threads or os.cpu_count() or 1
    data = np.ones(nbytes // FLOAT32_BYTES, dtype=np.float32)  # written once: every page is resident
    chunks = np.array_split(data, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            total = sum(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - start)
            assert total > 0  # keeps the reduction from being skipped
    return data.nbytes / best
