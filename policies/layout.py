"""What a model keeps per request, in bytes and tensors, by layer kind (pure).

A model's layers (`protocols.model.LayerLayout`) are full attention (bytes grow with every
token), sliding windows (bytes grow up to the window), recurrent state (fixed bytes), or a
list of those. The ledger budgets requests with `request_bytes`; checkpoints name and check
their tensors with `tensor_shapes`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

from protocols.model import LayerLayout, ModelInfo

# Positions a sliding-window ring keeps beyond its window: the most tokens one forward may
# append to a row (known tokens are appended in pieces of at most this many).
RING_MARGIN = 64

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4, "int8": 1, "uint8": 1, "float64": 8, "int64": 8}


def dtype_bytes(name: str) -> int:
    return _DTYPE_BYTES.get(name, 4)


def leaves(layers: Sequence[LayerLayout], prefix: str = "") -> Iterator[tuple[str, LayerLayout]]:
    """Every non-list layer, named by its path ("3", "5.0", ...)."""
    for index, layer in enumerate(layers):
        name = f"{prefix}{index}"
        if layer.kind == "list":
            yield from leaves(layer.parts, f"{name}.")
        else:
            yield name, layer


def token_bytes(layer: LayerLayout) -> int:
    """Bytes one token's float KV takes in an attention layer (0 for state layers)."""
    if layer.kind not in ("full", "window"):
        return 0
    return layer.heads * (layer.key_dim + layer.value_dim) * dtype_bytes(layer.dtype)


def packed_dim(dim: int, bits: int) -> int:
    """uint32 words holding `dim` elements of `bits` bits."""
    return dim * bits // 32


def quantized_token_bytes(layer: LayerLayout) -> int:
    """Bytes one token's quantized KV takes in a quantized full layer: packed words, and a
    scale and a bias (the model's dtype) per group."""
    groups = (layer.key_dim + layer.value_dim) // layer.kv_group_size
    return layer.heads * (packed_dim(layer.key_dim + layer.value_dim, layer.kv_bits) * 4 + 2 * groups * dtype_bytes(layer.dtype))


def full_layer_bytes(layer: LayerLayout, num_tokens: int) -> int:
    """A full-attention layer's bytes for `num_tokens` positions: float (paged: in whole
    blocks), or quantized plus the float copy of the first `kv_start` positions."""
    if layer.kv_block:
        return token_bytes(layer) * -(-num_tokens // layer.kv_block) * layer.kv_block
    if not layer.kv_bits:
        return token_bytes(layer) * num_tokens
    return quantized_token_bytes(layer) * num_tokens + token_bytes(layer) * min(num_tokens, layer.kv_start)


def kv_format(layers: Sequence[LayerLayout]) -> str:
    """How the layers store KV, for checkpoint headers and stats: "float", or e.g.
    "int8/g64/start0" (any quantized layer: they share one setting)."""
    for _, layer in leaves(layers):
        if layer.kind == "full" and layer.kv_bits:
            return f"int{layer.kv_bits}/g{layer.kv_group_size}/start{layer.kv_start}"
    return "float"


def checkpoint_format(info: ModelInfo) -> str:
    """`kv_format`, and the world's sharding in a distributed one (each rank's checkpoint
    holds its shard: a resume needs the same world)."""
    return kv_format(info.layers) + (f", sharded {info.world}" if info.world else "")


def with_kv_quantization(layers: Sequence[LayerLayout], bits: int, group_size: int, start: int) -> tuple[list[LayerLayout], list[str]]:
    """The layers with `bits`-bit KV on every full-attention layer that can take it, and why
    the others cannot (by layer name). Windows stay float: mlx-lm has no quantized ring."""
    refused: list[str] = []

    def convert(layer: LayerLayout, name: str) -> LayerLayout:
        if layer.kind == "list":
            return msgspec.structs.replace(layer, parts=[convert(part, f"{name}.{j}") for j, part in enumerate(layer.parts)])
        if layer.kind == "window":
            refused.append(f"layer {name}: sliding window (kept float: no quantized rotating cache)")
        if layer.kind != "full":
            return layer
        if layer.key_dim % group_size or layer.value_dim % group_size:
            refused.append(f"layer {name}: head dims {layer.key_dim}/{layer.value_dim} not divisible by kv.group_size {group_size} (kept float)")
            return layer
        return msgspec.structs.replace(layer, kv_bits=bits, kv_group_size=group_size, kv_start=start)

    if not bits:
        return list(layers), []
    return [convert(layer, str(i)) for i, layer in enumerate(layers)], refused


def with_kv_blocks(layers: Sequence[LayerLayout], block_size: int) -> list[LayerLayout]:
    """The layers with every float full-attention layer paged in `block_size`-position blocks."""

    def convert(layer: LayerLayout) -> LayerLayout:
        if layer.kind == "list":
            return msgspec.structs.replace(layer, parts=[convert(part) for part in layer.parts])
        if layer.kind == "full" and not layer.kv_bits:
            return msgspec.structs.replace(layer, kv_block=block_size)
        return layer

    return [convert(layer) for layer in layers]


def kv_block_size(layers: Sequence[LayerLayout]) -> int:
    """The paged layers' block size (`kv.block_size`; 0: nothing is paged)."""
    return max((layer.kv_block for _, layer in leaves(layers) if layer.kind == "full"), default=0)


def paged_block_bytes(layers: Sequence[LayerLayout]) -> int:
    """Bytes of one pool block: `kv_block` positions of every paged layer."""
    return sum(token_bytes(layer) * layer.kv_block for _, layer in leaves(layers) if layer.kind == "full" and layer.kv_block)


def state_bytes(layer: LayerLayout) -> int:
    total = 0
    for array in layer.states:
        if array.dtype:
            count = 1
            for size in array.shape:
                count *= size
            total += count * dtype_bytes(array.dtype)
    return total


def ring_capacity(layer: LayerLayout) -> int:
    return layer.window + RING_MARGIN


def request_bytes(layers: Sequence[LayerLayout], num_tokens: int) -> int:
    """The KV bytes one request of `num_tokens` tokens holds (a sliding window's ring is
    bounded by its capacity, state is fixed)."""
    total = 0
    for _, layer in leaves(layers):
        if layer.kind == "full":
            total += full_layer_bytes(layer, num_tokens)
        elif layer.kind == "window":
            total += token_bytes(layer) * min(num_tokens, ring_capacity(layer))
        else:
            total += state_bytes(layer)
    return total


def full_token_bytes(layers: Sequence[LayerLayout]) -> int:
    """Bytes per token of the layers whose KV grows without bound (past `kv_start`)."""
    return sum(quantized_token_bytes(layer) if layer.kv_bits else token_bytes(layer) for _, layer in leaves(layers) if layer.kind == "full")


def is_trimmable(layers: Sequence[LayerLayout]) -> bool:
    """Whether any prefix of a saved sequence can seed a request: only when every layer keeps
    every position (a window forgets old ones, a state cannot be rewound)."""
    return all(layer.kind == "full" for _, layer in leaves(layers))


def has_state(layers: Sequence[LayerLayout]) -> bool:
    return any(layer.kind == "state" for _, layer in leaves(layers))


def tensor_shapes(layers: Sequence[LayerLayout], num_tokens: int) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of `num_tokens` positions holds, by name, with their shapes."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, layer in leaves(layers):
        if layer.kind == "full" and layer.kv_bits:
            shapes.update(_quantized_shapes(name, layer, num_tokens))
        elif layer.kind in ("full", "window"):
            length = num_tokens if layer.kind == "full" else min(num_tokens, layer.window)
            shapes[f"{name}.keys"] = (1, layer.heads, length, layer.key_dim)
            shapes[f"{name}.values"] = (1, layer.heads, length, layer.value_dim)
        else:
            for j, array in enumerate(layer.states):
                if array.dtype:
                    shapes[f"{name}.state{j}"] = (1, *array.shape)
    return shapes


def _quantized_shapes(name: str, layer: LayerLayout, num_tokens: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for field, dim in (("keys", layer.key_dim), ("values", layer.value_dim)):
        shapes[f"{name}.{field}.packed"] = (1, layer.heads, num_tokens, packed_dim(dim, layer.kv_bits))
        shapes[f"{name}.{field}.scales"] = (1, layer.heads, num_tokens, dim // layer.kv_group_size)
        shapes[f"{name}.{field}.biases"] = (1, layer.heads, num_tokens, dim // layer.kv_group_size)
        if layer.kv_start:
            shapes[f"{name}.{field}"] = (1, layer.heads, min(num_tokens, layer.kv_start), dim)
    return shapes
