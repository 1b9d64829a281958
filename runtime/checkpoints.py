"""Durable decode checkpoints: the file format, atomic writes, validated reads.

A checkpoint file is

    b"MLXRTCK" + format version digit | sha256 of what follows | the header (JSON) as a frame
    (`protocols.frames`: uint32 BE length, then the bytes) | KV tensors (safetensors)

(a signed file, `runtime.signed_files`). The header (`CheckpointHeader`) names the model and tokenizer digests, the request as
submitted, the resolved prompt ids and seed, and the tokens generated so far. The digest
covers the header too, so a damaged header is caught before it is parsed. Reads open
without following links or blocking, accept only a regular file under a size cap, and
reject a wrong magic, a truncated or altered file, another format version, or another
model, each with its own exception type (`protocols.errors`). Files are 0600 in a 0700
directory that no one else may write. Blocking I/O: call from a worker thread.
"""

from __future__ import annotations

import math
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import safetensors.numpy

from policies.images import without_image_bytes
from policies.layout import tensor_shapes
from policies.validation import check_request_id
from protocols.api import GenerateRequest
from protocols.base import Record
from protocols.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    InvalidRequestError,
    UnsupportedCheckpointError,
)
from protocols.model import LayerLayout
from runtime import private_files
from runtime.signed_files import AlteredFileError, ForeignFileError, OtherVersionError, SignedFormat, TruncatedFileError

# 5: the header is a `protocols.frames` frame after the digest (4: its length before the digest).
FORMAT_VERSION = 5
FORMAT = SignedFormat(b"MLXRTCK", FORMAT_VERSION)
MAGIC = FORMAT.magic
_SUFFIX = ".ckpt"
# Header bytes beyond the token lists: the request as submitted (messages, tools, ...).
HEADER_BYTES = 16 * 1024 * 1024


class CheckpointHeader(Record, frozen=True):
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
    # The LoRA adapter (`request.adapter`) the KV was computed under: its digest.
    adapter_digest: str = ""
    # How the KV tensors are stored (`policies.layout.kv_format`: "float", "int8/g64/start0"...).
    kv_format: str = "float"
    # An image prompt: its images' sha256 digests and the ids the prefix cache keys the prompt
    # by (`policies.images.key_ids`). The images themselves are not kept: the KV holds them, and
    # `request`'s image parts carry only their digests.
    image_digests: list[str] = msgspec.field(default_factory=list)
    key_ids: list[int] | None = None
    # What rotary positions add after the prompt (Qwen-VL's mRoPE delta), for the resume.
    position_shift: int = 0


class CheckpointDirError(CheckpointError):
    """The checkpoint directory is unusable (not ours, open to others, not writable)."""


def path_for(directory: Path, request_id: str) -> Path:
    check_request_id(request_id)
    return directory / f"{request_id}{_SUFFIX}"


def max_file_bytes(max_context: int, layers: Sequence[LayerLayout]) -> int:
    """The largest checkpoint a model can have written: its tensors at the longest context (as
    float32), the ids, the request."""
    tensor_bytes = sum(4 * math.prod(shape) for shape in tensor_shapes(layers, max_context).values())
    return FORMAT.min_bytes + HEADER_BYTES + 32 * max_context + tensor_bytes + 1024 * 1024


def encode(header: CheckpointHeader, tensors: bytes) -> bytes:
    return b"".join(FORMAT.encode(msgspec.json.encode(header), tensors))


def prepare_directory(directory: Path) -> None:
    """Create the directory (0700) or check an existing one; then prove it is writable.

    Raises `CheckpointDirError` for a directory that is not ours, that others can write,
    or that cannot be written (read-only, full, not a directory).
    """
    try:
        private_files.prepare_directory(directory)
    except private_files.PrivateDirError as exc:
        raise CheckpointDirError(str(exc)) from None


def write_atomic(directory: Path, request_id: str, data: bytes) -> Path:
    """Write a temporary 0600 file, fsync it, rename it over the old one, fsync the directory.

    On failure (a full disk, say) the temporary file is removed and the old checkpoint stays.
    """
    return private_files.write_atomic(path_for(directory, request_id), data)


def read(directory: Path, request_id: str, *, model_id: str, tokenizer_id: str, max_bytes: int, kv_format: str = "float") -> tuple[CheckpointHeader, bytes]:
    """The header and tensor bytes of a checkpoint that this model, storing KV as
    `kv_format`, can resume."""
    path = path_for(directory, request_id)
    header, tensors = decode(_read_regular(path, max_bytes, request_id), source=str(path))
    if header.model_id != model_id or header.tokenizer_id != tokenizer_id:
        raise ForeignCheckpointError(f"{path} was written for another model or tokenizer")
    if header.kv_format != kv_format:
        raise ForeignCheckpointError(
            f"{path} holds {header.kv_format} KV; this runtime stores {kv_format} KV (kv.bits, kv.group_size, kv.quantized_start, the distributed world)"
        )
    if header.request.request_id != request_id:
        raise CorruptCheckpointError(f"{path} belongs to request {header.request.request_id!r}")
    return header, tensors


def _read_regular(path: Path, max_bytes: int, request_id: str) -> bytes:
    """The bytes of a regular file at `path` (no links, FIFOs, devices or directories)."""
    try:
        return private_files.read_regular(path, max_bytes)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint for request {request_id!r}") from None
    except private_files.UnreadableFileError as exc:
        raise CorruptCheckpointError(f"{exc} (as a checkpoint)") from None


def decode(data: bytes, *, source: str = "<checkpoint>") -> tuple[CheckpointHeader, bytes]:
    try:
        body, end = FORMAT.open(data)
    except ForeignFileError:
        raise CorruptCheckpointError(f"{source} is not an mlxrt checkpoint") from None
    except OtherVersionError as exc:
        raise UnsupportedCheckpointError(f"{source} has format version {exc.found!r}; this runtime reads {FORMAT_VERSION}") from None
    except AlteredFileError:
        raise CorruptCheckpointError(f"{source} is truncated or altered (checksum mismatch)") from None
    except TruncatedFileError:
        raise CorruptCheckpointError(f"{source} is truncated") from None
    try:
        header = msgspec.json.decode(body, type=CheckpointHeader)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{source} has an invalid header: {exc}") from None
    return header, data[end:]


def check_tensors(header: CheckpointHeader, tensors: bytes, layers: Sequence[LayerLayout]) -> None:
    """The tensors hold `num_kv_tokens` positions of every layer, shaped for this model."""
    expected_len = len(header.prompt_ids) + len(header.generated) - 1
    if not header.generated or header.num_kv_tokens != expected_len:
        raise CorruptCheckpointError(f"checkpoint covers {header.num_kv_tokens} tokens, expected {expected_len}")
    try:
        arrays = safetensors.numpy.load(tensors)
    except Exception as exc:  # safetensors reports malformed data with several exception types
        raise CorruptCheckpointError(f"unreadable checkpoint tensors: {type(exc).__name__}") from None
    expected = tensor_shapes(layers, header.num_kv_tokens)
    if set(arrays) != set(expected):
        raise CorruptCheckpointError(f"checkpoint has {len(arrays)} tensors, the model needs {len(expected)} ({', '.join(sorted(expected)[:4])}, ...)")
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != shape:
            raise CorruptCheckpointError(f"checkpoint tensor {name} is {tuple(arrays[name].shape)}, the model needs {shape}")


def delete(directory: Path, request_id: str) -> None:
    """Remove a request's checkpoint; anything there that is not a regular file is left alone."""
    try:
        private_files.remove_regular(path_for(directory, request_id))
    except InvalidRequestError:
        pass


def expire(directory: Path, max_age_s: float, now: float | None = None) -> list[str]:
    """Remove checkpoints (and leftover temporary files) older than `max_age_s`."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        if not (path.suffix == _SUFFIX or path.name.endswith(".tmp")):
            continue
        try:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and now - info.st_mtime > max_age_s:
                path.unlink()
                removed.append(path.name)
        except OSError:
            continue
    return removed


class CheckpointStore:
    """One runtime's checkpoints: where they go and which model they belong to.

    The KV store actor calls these from worker threads (they block on the disk).
    """

    def __init__(self, directory: Path, *, model_id: str, tokenizer_id: str, kv_format: str = "float"):
        self.directory = directory
        self.model_id = model_id
        self.tokenizer_id = tokenizer_id
        self.kv_format = kv_format

    def write(self, request: GenerateRequest, prompt_ids: list[int], seed: int, max_tokens: int, stop_token_ids: list[int], data, vision=None) -> None:
        """Write a request's captured state (`protocols.model.CheckpointData`) atomically; an
        image prompt's (`vision`) with its images' digests in place of the images."""
        if vision is not None and request.messages is not None:
            request = msgspec.structs.replace(request, messages=without_image_bytes(request.messages, vision.digests))
        header = CheckpointHeader(
            model_id=self.model_id,
            tokenizer_id=self.tokenizer_id,
            request=request,
            prompt_ids=prompt_ids,
            seed=seed,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            generated=data.generated,
            num_kv_tokens=data.num_kv_tokens,
            created_at=time.time(),
            adapter_digest=data.adapter_digest,
            kv_format=self.kv_format,
            image_digests=list(vision.digests) if vision is not None else [],
            key_ids=list(vision.key_ids) if vision is not None else None,
            position_shift=data.position_shift,
        )
        write_atomic(self.directory, data.request_id, encode(header, data.kv_tensors))

    def delete(self, request_id: str) -> None:
        delete(self.directory, request_id)

    def expire(self, max_age_s: float) -> list[str]:
        return expire(self.directory, max_age_s)
