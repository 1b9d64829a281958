"""Durable decode checkpoints: the file format, atomic writes, validated reads.

A checkpoint file is

    b"MLXRTCK1" | uint32 BE header length | header (JSON) | KV tensors (safetensors)

The header (`CheckpointHeader`) names the format version, the model and tokenizer
digests, the request as submitted, the resolved prompt ids and seed, the tokens
generated so far, and the sha256 of the tensor bytes. Reads reject a wrong magic,
a truncated or altered file, another format version, or another model, each with
its own exception type. Blocking I/O: call from a worker thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import time
from pathlib import Path

import msgspec
import safetensors.numpy

from protocols.api import GenerateRequest
from protocols.base import Record
from runtime.errors import MlxrtError

MAGIC = b"MLXRTCK1"
FORMAT_VERSION = 1
_LENGTH = struct.Struct(">I")
_SUFFIX = ".ckpt"
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,200}$")


class CheckpointError(MlxrtError):
    """A checkpoint cannot be used to resume."""


class CheckpointNotFoundError(CheckpointError):
    pass


class CorruptCheckpointError(CheckpointError):
    """Truncated, altered, or not a checkpoint at all."""


class UnsupportedCheckpointError(CheckpointError):
    """Written by another format version."""


class ForeignCheckpointError(CheckpointError):
    """Written for another model or tokenizer."""


class CheckpointHeader(Record):
    format_version: int
    model_id: str
    tokenizer_id: str
    request: GenerateRequest
    prompt_ids: list[int]
    seed: int
    max_tokens: int
    stop_token_ids: list[int]
    generated: list[int]
    num_kv_tokens: int
    created_at: float
    tensors_sha256: str


def path_for(directory: Path, request_id: str) -> Path:
    if not _SAFE_ID.match(request_id):
        raise CheckpointError(f"request_id {request_id!r} cannot name a checkpoint file (letters, digits, . _ : @ - only)")
    return directory / f"{request_id}{_SUFFIX}"


def encode(header: CheckpointHeader, tensors: bytes) -> bytes:
    body = msgspec.json.encode(header)
    return MAGIC + _LENGTH.pack(len(body)) + body + tensors


def write_atomic(directory: Path, request_id: str, data: bytes) -> Path:
    """Write to a temporary file, fsync it, rename it over the old one, fsync the directory."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    final = path_for(directory, request_id)
    temporary = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, final)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def read(directory: Path, request_id: str, *, model_id: str, tokenizer_id: str) -> tuple[CheckpointHeader, bytes]:
    """The header and tensor bytes of a checkpoint that this model can resume."""
    path = path_for(directory, request_id)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint for request {request_id!r} in {directory}") from None
    header, tensors = decode(data, source=str(path))
    if header.model_id != model_id or header.tokenizer_id != tokenizer_id:
        raise ForeignCheckpointError(f"{path} was written for another model or tokenizer")
    if header.request.request_id != request_id:
        raise CorruptCheckpointError(f"{path} belongs to request {header.request.request_id!r}")
    return header, tensors


def decode(data: bytes, *, source: str = "<checkpoint>") -> tuple[CheckpointHeader, bytes]:
    prefix = len(MAGIC) + _LENGTH.size
    if len(data) < prefix or not data.startswith(MAGIC):
        raise CorruptCheckpointError(f"{source} is not an mlxrt checkpoint")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    if len(data) < prefix + length:
        raise CorruptCheckpointError(f"{source} is truncated")
    try:
        version = msgspec.json.decode(data[prefix : prefix + length]).get("format_version")
    except (msgspec.DecodeError, AttributeError):
        raise CorruptCheckpointError(f"{source} has an unreadable header") from None
    if version != FORMAT_VERSION:
        raise UnsupportedCheckpointError(f"{source} has format version {version!r}; this runtime reads {FORMAT_VERSION}")
    try:
        header = msgspec.json.decode(data[prefix : prefix + length], type=CheckpointHeader)
    except msgspec.ValidationError as exc:
        raise CorruptCheckpointError(f"{source} has an invalid header: {exc}") from None
    tensors = data[prefix + length :]
    if hashlib.sha256(tensors).hexdigest() != header.tensors_sha256:
        raise CorruptCheckpointError(f"{source} is truncated or altered (tensor checksum mismatch)")
    return header, tensors


def check_tensors(header: CheckpointHeader, tensors: bytes, kv_shapes: list[tuple[int, int, int]]) -> None:
    """The tensors hold a cache of `num_kv_tokens` positions shaped for this model."""
    expected_len = len(header.prompt_ids) + len(header.generated) - 1
    if not header.generated or header.num_kv_tokens != expected_len:
        raise CorruptCheckpointError(f"checkpoint covers {header.num_kv_tokens} tokens, expected {expected_len}")
    try:
        arrays = safetensors.numpy.load(tensors)
    except Exception as exc:  # safetensors reports malformed data with several exception types
        raise CorruptCheckpointError(f"unreadable checkpoint tensors: {exc}") from None
    if len(arrays) != 2 * len(kv_shapes):
        raise CorruptCheckpointError(f"checkpoint has {len(arrays)} tensors, the model needs {2 * len(kv_shapes)}")
    for layer, (heads, key_dim, value_dim) in enumerate(kv_shapes):
        keys, values = arrays.get(f"keys_{layer}"), arrays.get(f"values_{layer}")
        n = header.num_kv_tokens
        if keys is None or values is None or keys.shape != (1, heads, n, key_dim) or values.shape != (1, heads, n, value_dim):
            raise CorruptCheckpointError(f"checkpoint layer {layer} does not fit the model")


def delete(directory: Path, request_id: str) -> None:
    try:
        path_for(directory, request_id).unlink()
    except (FileNotFoundError, CheckpointError):
        pass


def expire(directory: Path, max_age_s: float, now: float | None = None) -> list[str]:
    """Remove checkpoints (and leftover temporary files) older than `max_age_s`."""
    now = time.time() if now is None else now
    removed = []
    if not directory.is_dir():
        return removed
    for path in directory.iterdir():
        if (path.suffix == _SUFFIX or path.name.endswith(".tmp")) and now - path.stat().st_mtime > max_age_s:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


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
