"""GGUF tensor bytes as MLX arrays, on the MLX thread.

Q4_0, Q4_1 and Q8_0 blocks (32 elements, one float16 scale, Q4_1 also a minimum) are exactly
MLX's affine quantization with group 32, so they become (weight, scales, biases) triples
without changing a value: Q4_0 `d * (q - 8)` is scale `d`, bias `-8 d`; Q4_1 `d * q + m` is
scale `d`, bias `m`; Q8_0 `d * q` (signed) is scale `d`, bias `-128 d` over `q + 128`.
F32, F16 and BF16 stay as they are. Every other type (K-quants, IQ-quants, Q5_x, ...) is
dequantized to float32 by the `gguf` package's reference dequantizers; the caller decides
whether to keep that or requantize it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from engine.model.gguf.format import GGUFFile, TensorInfo

GROUP = 32
# Affine types: bits, bytes of one block, and its header (scale, and for Q4_1 a minimum).
_AFFINE = {Q.Q4_0: (4, 18, 2), Q.Q4_1: (4, 20, 4), Q.Q8_0: (8, 34, 2)}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
AFFINE_TYPES = tuple(_AFFINE)


def is_supported(qtype: Q) -> bool:
    """Whether a tensor of this type can be read: floats, affine blocks, or a type the `gguf`
    package dequantizes (integer tensors and formats it has no dequantizer for cannot)."""
    if qtype in FLOAT_TYPES or qtype in _AFFINE:
        return True
    try:  # one block of zeros: the package raises for types it cannot dequantize
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


def read_float(file: GGUFFile, info: TensorInfo) -> mx.array:
    """A float tensor as stored, or any other type dequantized to float32."""
    raw = file.raw(info.name)
    if info.qtype == Q.F32:
        return mx.array(raw.view(np.float32).reshape(info.shape))
    if info.qtype == Q.F16:
        return mx.array(raw.view(np.float16).reshape(info.shape))
    if info.qtype == Q.BF16:
        return mx.array(raw.view(np.uint16).reshape(info.shape)).view(mx.bfloat16)
    return mx.array(dequantize(raw, info.qtype).astype(np.float32, copy=False).reshape(info.shape))


def read_affine(file: GGUFFile, info: TensorInfo) -> tuple[mx.array, mx.array, mx.array, int]:
    """A Q4_0/Q4_1/Q8_0 tensor as MLX's packed weight, scales and biases (group 32), and its bits."""
    bits, block_bytes, header = _AFFINE[info.qtype]
    *outer, cols = info.shape
    blocks = file.raw(info.name).reshape(-1, block_bytes)
    scales = np.ascontiguousarray(blocks[:, :2]).view(np.float16)[:, 0]
    payload = blocks[:, header:]
    if bits == 4:
        # Element j of a block is the low nibble of byte j, element j + 16 its high nibble;
        # MLX packs element i into bits 4 (i % 8) of word i // 8.
        values = np.concatenate([payload & 0x0F, payload >> 4], axis=1)
        packed = values[:, 0::2] | (values[:, 1::2] << 4)
        minimum = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16)[:, 0] if info.qtype == Q.Q4_1 else None
        biases = minimum if minimum is not None else scales * np.float16(-8)
    else:
        packed = (payload.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        biases = scales * np.float16(-128)
    words = np.ascontiguousarray(packed).view("<u4").reshape(*outer, cols * bits // 32)
    groups = (*outer, cols // GROUP)
    return mx.array(words), mx.array(scales.reshape(groups)), mx.array(biases.reshape(groups)), bits


def unpermute_rows(array: mx.array, num_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (its rotary embedding pairs adjacent dims; mlx-lm's
    and Hugging Face's pair the two halves of each head). Rows move whole, so a packed
    quantized weight moves with its scales and biases."""
    rows = array.shape[0]
    return array.reshape(num_heads, rows // num_heads // 2, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
