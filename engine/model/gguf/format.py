"""GGUF files read safely: the header parsed and checked against the file before any tensor is.

`GGUFFile.open(path)` reads the header only (metadata and the tensor directory). Every count,
length, dimension and offset in it is bounded by the file's size before it is used, so a
truncated or hostile file is refused with `ModelLoadError` naming what is wrong, without
reading or allocating more than the file holds. Tensor bytes are memory-mapped and handed out
per tensor (`raw`). No MLX here: the loader (`engine.model.gguf.model.load_gguf`) turns bytes into arrays.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from protocols.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_TENSOR_ELEMENTS = 1 << 40
MAX_NAME_BYTES = 256
# Smallest encodings, used to bound counts by the bytes left before reading them.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset

# GGUF metadata value types: struct format of the scalar ones.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the directory; `shape` in NumPy order (GGUF lists dims innermost first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The shape of its raw bytes: the innermost dim counted in blocks' bytes."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * size)


class _Cursor:
    """Little-endian reads over the header, each bounded by the file's end."""

    def __init__(self, view: memoryview, path: Path):
        self.view, self.pos, self.path = view, 0, path

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: not a valid GGUF file: {what}")

    @property
    def left(self) -> int:
        return len(self.view) - self.pos

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if size > self.left:
            raise self.fail(f"truncated at byte {self.pos} (needs {size} more bytes, {self.left} left)")
        (value,) = struct.unpack_from("<" + fmt, self.view, self.pos)
        self.pos += size
        return value

    def count(self, what: str, min_bytes: int) -> int:
        """A count read from the file, refused when its items cannot fit in the bytes left."""
        n = self.unpack("Q")
        if n * min_bytes > self.left:
            raise self.fail(f"{what} count {n} cannot fit in the {self.left} bytes left")
        return n

    def string(self, what: str = "string", limit: int | None = None) -> str:
        n = self.unpack("Q")
        if n > self.left or (limit is not None and n > limit):
            raise self.fail(f"{what} of {n} bytes at byte {self.pos} (limit {limit or self.left})")
        data = bytes(self.view[self.pos : self.pos + n])
        self.pos += n
        # Vocabularies may hold byte sequences that are not UTF-8: keep them reversibly.
        return data.decode("utf-8", errors="surrogateescape")

    def value(self, kind: int, key: str) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string(f"value of {key!r}")
        if kind == _ARRAY:
            return self.array(key)
        raise self.fail(f"metadata {key!r} has unknown value type {kind}")

    def array(self, key: str) -> Any:
        kind = self.unpack("I")
        if kind == _ARRAY:
            raise self.fail(f"metadata {key!r} is an array of arrays (not supported)")
        if kind == _STRING:
            n = self.count(f"array {key!r}", 8)
            return [self.string(f"element of {key!r}") for _ in range(n)]
        if kind not in _NUMPY:
            raise self.fail(f"metadata {key!r} is an array of unknown type {kind}")
        dtype = np.dtype(_NUMPY[kind])
        n = self.count(f"array {key!r}", dtype.itemsize)
        values = np.frombuffer(self.view, dtype=dtype, count=n, offset=self.pos).copy()
        self.pos += n * dtype.itemsize
        return values.astype(bool) if kind == 7 else values


class GGUFFile:
    """An open GGUF file: its metadata, its tensor directory, and its tensors' bytes (mapped).

    Holds the file's memory map until `close()`; arrays from `raw` are views into it."""

    def __init__(
        self, path: Path, size: int, mapped: mmap.mmap | None, version: int, metadata: dict[str, Any], tensors: dict[str, TensorInfo], data_offset: int
    ):
        self.path, self.size, self.version = path, size, version
        self.metadata, self.tensors, self.data_offset = metadata, tensors, data_offset
        self._mmap = mapped

    @classmethod
    def open(cls, path: Path | str) -> GGUFFile:
        path = Path(path)
        try:
            # Non-blocking: opening a FIFO (or a device) named like a model must not wait for a writer.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            with open(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ModelLoadError(f"{path}: not a regular file")
                size = f.seek(0, 2)
                if size < 24:
                    raise ModelLoadError(f"{path}: not a valid GGUF file: {size} bytes")
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read: {exc}") from exc
        try:
            return cls._parse(path, size, mapped)
        except BaseException:
            mapped.close()
            raise

    @classmethod
    def _parse(cls, path: Path, size: int, mapped: mmap.mmap) -> GGUFFile:
        view = memoryview(mapped)
        try:
            cur = _Cursor(view, path)
            if bytes(view[:4]) != MAGIC:
                raise cur.fail(f"bad magic {bytes(view[:4])!r} (expected {MAGIC!r})")
            cur.pos = 4
            version = cur.unpack("I")
            if version not in VERSIONS:
                swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
                why = "a big-endian file" if swapped in VERSIONS else f"version {version}"
                raise ModelLoadError(f"{path}: GGUF {why} is not supported (versions {', '.join(map(str, VERSIONS))}, little-endian)")
            n_tensors = cur.unpack("Q")
            n_kv = cur.count("metadata", _MIN_KV_BYTES)
            if n_tensors * _MIN_TENSOR_INFO_BYTES > cur.left:
                raise cur.fail(f"tensor count {n_tensors} cannot fit in the {cur.left} bytes left")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string("metadata key", MAX_NAME_BYTES)
                if key in metadata:
                    raise cur.fail(f"metadata key {key!r} appears twice")
                metadata[key] = cur.value(cur.unpack("I"), key)
            infos = [cls._tensor_info(cur) for _ in range(n_tensors)]
            alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 20:
                raise cur.fail(f"general.alignment {alignment!r} is not a power of two")
            data_offset = -(-cur.pos // alignment) * alignment
            tensors = cls._place(cur, infos, data_offset, alignment, size)
        finally:
            view.release()
        return cls(path, size, mapped, version, metadata, tensors, data_offset)

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cur.string("tensor name", MAX_NAME_BYTES)
        n_dims = cur.unpack("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = [cur.unpack("Q") for _ in range(n_dims)]
        raw_type = cur.unpack("I")
        offset = cur.unpack("Q")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelLoadError(f"{cur.path}: tensor {name!r} has unknown tensor type {raw_type}") from None
        if min(dims) < 1 or any(d > MAX_TENSOR_ELEMENTS for d in dims) or int(np.prod(dims, dtype=object)) > MAX_TENSOR_ELEMENTS:
            raise cur.fail(f"tensor {name!r} has dimensions {dims} (each at least 1, at most {MAX_TENSOR_ELEMENTS} elements)")
        block = GGML_QUANT_SIZES[qtype][0]
        if dims[0] % block:
            raise cur.fail(f"tensor {name!r} ({qtype.name}) has a row of {dims[0]} elements, not a multiple of its block of {block}")
        return name, tuple(reversed(dims)), qtype, offset

    @staticmethod
    def _place(cur: _Cursor, infos: list, data_offset: int, alignment: int, size: int) -> dict[str, TensorInfo]:
        """Tensors with absolute offsets, each inside the file, aligned, and not overlapping."""
        tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            if name in tensors:
                raise cur.fail(f"tensor {name!r} appears twice")
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape, dtype=object)) // block * block_bytes
            start = data_offset + offset
            if offset % alignment or start + nbytes > size:
                raise cur.fail(f"tensor {name!r} lies at bytes {start}..{start + nbytes}, outside the {size}-byte file or unaligned")
            tensors[name] = TensorInfo(name, shape, qtype, start, nbytes)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
        for (_, end, first), (start, _, second) in itertools.pairwise(spans):
            if start < end:
                raise cur.fail(f"tensors {first!r} and {second!r} overlap")
        return tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array of `byte_shape` (a view of the map)."""
        if self._mmap is None:
            raise ValueError(f"{self.path} is closed")
        info = self.tensors[name]
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(info.byte_shape)

    def digest(self) -> str:
        """Identity of the file: sha256 of its header and size, and of 4 KiB at the start, middle
        and end of every tensor (hashing gigabytes at every start would be too slow; a changed
        weight file changes its tensors' bytes everywhere)."""
        assert self._mmap is not None
        h = hashlib.sha256(self._mmap[: self.data_offset])
        h.update(str(self.size).encode())
        for info in sorted(self.tensors.values(), key=lambda t: t.offset):
            for start in sorted({info.offset, info.offset + info.nbytes // 2, max(info.offset, info.offset + info.nbytes - 4096)}):
                h.update(self._mmap[start : min(start + 4096, info.offset + info.nbytes)])
        return h.hexdigest()

    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
