"""Load a model on the MLX thread: an mlx-lm directory, a GGUF file, or a built-in one.

Casts floating weights to float32 on the CPU backend, where only float32 matmul
goes through BLAS (quantized ones per `engine.model.weights`), patches the layers that need it
(`engine.model.patches`), probes each layer's KV geometry with a one-token forward
(`engine.kv.layout`), and returns the model, its tokenizer and a plain-data `ModelInfo`
(`LoadedModel`); `with_kv_format` applies `kv.bits` and `kv.block_size` to its layout. Also the
digests that identify a model and its tokenizer. A draft model, the adapter bank and the
engine are built on it by `engine.build`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import msgspec
import structlog
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_tokenizer

from engine import native
from engine.builtin import PackagedModelMissingError, builtin_name, ensure_builtin
from engine.kv.layout import dtype_name, probe_layout
from engine.model.diffusion import canvas_length, diffusion_layout, is_block_diffusion, is_diffusion_config, load_diffusion
from engine.model.diffusion import vocab_size as diffusion_vocab_size
from engine.model.gguf import is_gguf, load_gguf
from engine.model.patches import adapt_for_batches
from engine.model.vision import VisionLanguageModel, is_vision_config, load_vision
from engine.model.weights import apply_cpu_policy, decode_weight_bytes, keeps_quantized, parameter_count
from engine.model.world import World, shard
from policies.layout import full_token_bytes, is_trimmable, with_kv_blocks, with_kv_quantization
from protocols.config import AUTO_BLOCK_SIZE, KvConfig, ModelConfig
from protocols.errors import ModelLoadError
from protocols.model import LayerLayout, ModelInfo

DEFAULT_CONTEXT = 4096

log = structlog.get_logger(actor="model")
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    layout: list[LayerLayout]
    info: ModelInfo


def block_size(loaded: LoadedModel, kv: KvConfig, *, sharded: bool = False) -> int:
    """`kv.block_size`, with "auto" resolved: `AUTO_BLOCK_SIZE` for a text model on one device
    (not `sharded`) where mlxrt's CPU kernels are loaded (paged decode steps at least as fast
    as rows there: docs/benchmarks/log.md), else 0 (rows)."""
    if kv.block_size != "auto":
        return kv.block_size
    text = not loaded.info.denoising and not isinstance(loaded.model, VisionLanguageModel)
    return AUTO_BLOCK_SIZE if text and not sharded and native.loaded() is not None and mx.default_device() == mx.cpu else 0


def with_kv_format(loaded: LoadedModel, kv: KvConfig, *, sharded: bool = False) -> LoadedModel:
    """The model with `kv.bits`-bit KV on the layers that can store it (`engine.kv.quantized`),
    and its float full-attention layers paged with `kv.block_size` (`engine.kv.paged`; "auto":
    `block_size`). A model none of whose layers can store quantized KV is refused: the
    configuration asks for what cannot be."""
    layout = loaded.layout
    blocks = block_size(loaded, kv, sharded=sharded)
    if loaded.info.denoising and (kv.bits or blocks):
        raise ModelLoadError("kv.bits and kv.block_size are not served for diffusion language models: leave them 0")
    if isinstance(loaded.model, VisionLanguageModel) and (kv.bits or blocks):
        # mlx-vlm's attention is not routed to the runtime's quantized and paged caches.
        raise ModelLoadError("kv.bits and kv.block_size are not served for vision-language models yet: leave them 0")
    if kv.bits:
        layout, kept_float = with_kv_quantization(layout, kv.bits, kv.group_size, kv.quantized_start)
        if layout == loaded.layout:
            raise ModelLoadError(f"kv.bits = {kv.bits}: no layer of this model can store quantized KV ({'; '.join(kept_float)})")
        for reason in kept_float:
            log.warning("kv_layer_kept_float", reason=reason)
    if blocks:
        layout = with_kv_blocks(layout, blocks)
    if layout == loaded.layout:
        return loaded
    assert is_trimmable(layout) == is_trimmable(loaded.layout)
    info = msgspec.structs.replace(loaded.info, layers=layout, kv_bytes_per_token=full_token_bytes(layout))
    return LoadedModel(model=loaded.model, tokenizer=loaded.tokenizer, layout=layout, info=info)


def resolve_model_path(path: str, builtin_root: Path, progress: Callable[[str], None] | None = None) -> Path:
    """A local model for `path`: an mlx-lm directory or a GGUF file (a packaged model's file,
    or a random-weight built-in built under `builtin_root`, when named `builtin:<name>`)."""
    name = builtin_name(path)
    if name is not None:
        try:
            return ensure_builtin(name, root=builtin_root, progress=progress)
        except (ValueError, PackagedModelMissingError) as exc:
            raise ModelLoadError(str(exc)) from exc
    source = Path(path).expanduser()
    kind = path_kind(source)  # (stat only: a FIFO is never opened here)
    if is_gguf(source):
        if kind == "nothing":
            raise ModelLoadError(f"{path}: no such GGUF file; models are never downloaded")
        if kind != "a regular file":
            raise ModelLoadError(f"{path}: is {kind}, not a GGUF file")
        return source
    if kind not in ("a directory", "nothing"):
        raise ModelLoadError(f"{path}: is {kind}, not an mlx-lm model directory nor a .gguf file")
    if not (source / "config.json").is_file():
        found = "no such directory" if kind == "nothing" else "no config.json"
        raise ModelLoadError(f"{path}: not an mlx-lm model directory ({found}) nor a .gguf file; models are never downloaded")
    return source


def path_kind(path: Path) -> str:
    """What is at `path`, following links, in words ("nothing" where nothing is, or a link's
    target is missing); from `stat`, which never blocks on a FIFO."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if path.is_symlink() else "nothing"
    except NotADirectoryError:
        return "nothing"
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    return next((name for test, name in _PATH_KINDS if test(mode)), "not a file or directory")


_PATH_KINDS: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def load_model(config: ModelConfig, builtin_root: Path, progress: Callable[[str], None] | None = None, world: World | None = None) -> LoadedModel:
    """With a `world`: this rank's shard only (a directory is loaded lazily, split, then read;
    a GGUF file is read whole, then split)."""
    started = time.perf_counter()
    source = resolve_model_path(config.path, builtin_root, progress)
    if progress:
        progress(f"loading {source}" + (f" (rank {world.rank} of {world.size}, {world.config.mode} parallel)" if world else ""))
    if is_gguf(source):
        model, tokenizer, identity = _load_gguf(source, config, builtin_root, progress)
    else:
        model, tokenizer, identity = _load_directory(source, config, lazy=world is not None)
    if world is not None:
        if is_diffusion_config(identity.config):
            raise ModelLoadError(f"{source}: a diffusion language model is not served in a distributed world")
        shard(model, identity.config.get("model_type", "?"), world)
    if is_diffusion_config(identity.config):
        return _inspect_diffusion(model, tokenizer, source, identity, config, started)
    try:
        return _inspect(model, tokenizer, source, identity, config, started, progress)
    except ModelLoadError:
        raise
    except Exception as exc:  # a model mlx-lm loads must never fail here untyped
        raise ModelLoadError(f"{source}: cannot serve this model: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class _Identity:
    """What a model's source says about it: its config (as `config.json`) and digests."""

    config: dict[str, Any]
    model_id: str
    tokenizer_id: str


def _load_directory(directory: Path, config: ModelConfig, lazy: bool) -> tuple[nn.Module, TokenizerWrapper, _Identity]:
    hf_config = _read_config(directory)
    if is_diffusion_config(hf_config):
        model = load_diffusion(directory, hf_config, lazy)
        return model, _tokenizer(directory, hf_config), _Identity(hf_config, model_digest(directory), tokenizer_digest(directory))
    if is_vision_config(hf_config):
        return _load_vision(directory, hf_config, lazy)
    try:
        model, tokenizer = cast(tuple[nn.Module, TokenizerWrapper], mlx_lm_load(str(directory), trust_remote_code=config.trust_remote_code, lazy=lazy))
    except Exception as exc:  # mlx-lm reports unknown types, missing files and bad weights variously
        raise ModelLoadError(f"{directory}: mlx-lm cannot load it: {type(exc).__name__}: {exc}") from exc
    return model, tokenizer, _Identity(hf_config, model_digest(directory), tokenizer_digest(directory))


def _read_config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory}: no readable config.json: {type(exc).__name__}: {exc}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{directory}: config.json is not an object")
    return config


def _load_vision(directory: Path, hf_config: dict[str, Any], lazy: bool) -> tuple[nn.Module, TokenizerWrapper, _Identity]:
    """A vision-language model (`engine.model.vision`); its processor rides on the tokenizer
    wrapper (`processor`), which the runtime hands to admission."""
    model, processor = load_vision(directory, hf_config, lazy)
    tokenizer = _tokenizer(directory, hf_config)
    tokenizer.processor = processor
    return model, tokenizer, _Identity(hf_config, model_digest(directory), tokenizer_digest(directory))


def _tokenizer(directory: Path, hf_config: dict[str, Any]) -> TokenizerWrapper:
    """An mlx-vlm model's tokenizer, with config.json's end tokens."""
    eos = hf_config.get("eos_token_id")
    try:
        with _transformers_quiet():  # (a model type transformers has no class for: it warns, harmlessly)
            return load_tokenizer(directory, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    except Exception as exc:
        raise ModelLoadError(f"{directory}: its tokenizer cannot be loaded: {type(exc).__name__}: {exc}") from exc


def _inspect_diffusion(model: nn.Module, tokenizer: TokenizerWrapper, source: Path, identity: _Identity, config: ModelConfig, started: float) -> LoadedModel:
    """A diffusion model's facts (`engine.denoise` serves it: no decode batch; its encoder
    cache's layout is what the KV budget counts)."""
    dtype = _target_dtype(config.dtype)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    text_config = identity.config.get("text_config") or identity.config
    layout = diffusion_layout(model)
    info = ModelInfo(
        path=str(source),
        model_type=str(identity.config.get("model_type")),
        vocab_size=diffusion_vocab_size(model),
        max_context=config.max_context or int(text_config.get("max_position_embeddings") or DEFAULT_CONTEXT),
        num_layers=len(model.layers),
        kv_bytes_per_token=full_token_bytes(layout),
        layers=layout,
        **_facts(model, tokenizer, identity, started),
        denoising=True,
        canvas_length=canvas_length(model),
        denoises_blocks=is_block_diffusion(str(identity.config.get("model_type"))),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, layout=[], info=info)


def _load_gguf(path: Path, config: ModelConfig, cache_root: Path, progress: Callable[[str], None] | None) -> tuple[nn.Module, TokenizerWrapper, _Identity]:
    try:
        loaded = load_gguf(path, cache_root=cache_root, keeps_quantized=lambda need: keeps_quantized(config.cpu_dequantize, need), progress=progress)
    except ModelLoadError:
        raise
    except Exception as exc:  # anything the checks did not foresee is still the file's fault
        raise ModelLoadError(f"{path}: cannot load this GGUF file: {type(exc).__name__}: {exc}") from exc
    for note in loaded.notes:
        log.warning("gguf_tensors_converted", path=str(path), note=note)
    return loaded.model, loaded.tokenizer, _Identity(loaded.config, loaded.model_id, loaded.tokenizer_id)


def _inspect(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    source: Path,
    identity: _Identity,
    config: ModelConfig,
    started: float,
    progress: Callable[[str], None] | None,
) -> LoadedModel:
    """Dtype and quantization policy applied, layers probed, facts gathered."""
    dtype = _target_dtype(config.dtype)
    if progress:
        progress(f"preparing the weights ({dtype_name(dtype) if dtype is not None else 'as stored'}, model.cpu_dequantize = {config.cpu_dequantize})")
    if dtype is not None:
        model.set_dtype(dtype)
    quantization = apply_cpu_policy(model, config.cpu_dequantize, dtype or mx.float32)
    mx.eval(model.parameters())
    if progress:
        progress("probing the layers")
    adapt_for_batches(model)
    layout = probe_layout(model)
    hf_config = identity.config
    text_config: dict[str, Any] = hf_config["text_config"] if isinstance(hf_config.get("text_config"), dict) else {}
    info = ModelInfo(
        path=str(source),
        model_type=str(hf_config.get("model_type", "unknown")),
        vocab_size=_output_size(model),
        max_context=config.max_context or int(hf_config.get("max_position_embeddings") or text_config.get("max_position_embeddings") or DEFAULT_CONTEXT),
        num_layers=len(layout),
        kv_bytes_per_token=full_token_bytes(layout),
        layers=layout,
        quantization=quantization.reason if quantization.quantized_modules else "",
        **_facts(model, tokenizer, identity, started),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, layout=layout, info=info)


def _facts(model: nn.Module, tokenizer: TokenizerWrapper, identity: _Identity, started: float) -> dict[str, Any]:
    """The `ModelInfo` fields every kind of model reports alike."""
    return {
        "dtype": _float_dtype(model),
        "device": str(mx.default_device()),
        "eos_token_ids": sorted(tokenizer.eos_token_ids),
        "num_parameters": parameter_count(model),
        "decode_weight_bytes": decode_weight_bytes(model),
        "load_s": time.perf_counter() - started,
        "model_id": identity.model_id,
        "tokenizer_id": identity.tokenizer_id,
        "max_token_bytes": max_token_bytes(tokenizer),
        "has_chat_template": bool(getattr(tokenizer, "has_chat_template", False)),
    }


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of one token's text: the longest vocabulary entry
    as spelled in the vocabulary (byte-level and byte-fallback spellings are never shorter)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    vocab = hf.get_vocab()
    return max((len(piece.encode()) for piece in vocab), default=1)


def _target_dtype(name: str) -> mx.Dtype | None:
    if name != "auto":
        return _DTYPES[name]
    return mx.float32 if mx.default_device() == mx.cpu else None


def _output_size(model: nn.Module) -> int:
    """The number of logits the model produces per position: its vocabulary as sampled (read
    from the model, not config.json, where nested layouts keep it under `text_config`)."""
    logits = model(mx.array([[0]]))
    return int(logits.shape[-1])


def _float_dtype(model: nn.Module) -> str:
    for _, value in cast(list[tuple[str, Any]], tree_flatten(model.parameters())):
        if mx.issubdtype(value.dtype, mx.floating):
            return dtype_name(value.dtype)
    return "float32"


def digest_files(paths: list[Path]) -> str:
    """sha256 over the given files' names and contents (missing files count as absent)."""
    h = hashlib.sha256()
    for path in sorted(paths):
        if path.is_file():
            h.update(path.name.encode() + b"\0")
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def model_digest(directory: Path) -> str:
    """Identity of a model directory: its config and the names and sizes of its weight files
    (hashing gigabytes of weights at every start would be too slow)."""
    h = hashlib.sha256((directory / "config.json").read_bytes())
    for weights in sorted(directory.glob("*.safetensors")):
        h.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return h.hexdigest()


def tokenizer_digest(directory: Path) -> str:
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
    return digest_files([directory / name for name in names])


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """transformers' own warnings off for a while (its logger, restored after)."""
    from transformers.utils import logging as transformers_logging

    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(level)
