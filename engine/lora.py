"""LoRA adapters for the rows of one batch (MLX thread).

mlx-lm applies an adapter by replacing linear layers with `LoRALinear`
(`y = linear(x) + scale * ((x @ A) @ B)`), one adapter for the whole model. Here the base
weights stay shared and every linear layer some resident adapter targets becomes a
`RoutedLoRA`: the bank keeps every resident adapter's A and B stacked by slot (slot 0 holds
zeros: rows without an adapter, and adapters that leave this layer alone) and each row adds
its own slot's delta, gathered per row with `mx.gather_mm` (Punica's and S-LoRA's batched
LoRA). Before each forward the engine routes the forwarded rows to their slots
(`routed(model, slots)`); a forward none of whose rows has an adapter skips the deltas.

Per row the arithmetic is mlx-lm's: `gather_mm` multiplies each row by its own slot's
matrices with the same kernel a lone matmul uses, a smaller rank is padded with zero
columns (exact zeros added), and the scale multiplies the same way, so a row computes what
`mlx_lm.load(model, adapter_path=...)` computes for it alone.

Slots are few (`lora.max_resident`): a request's adapter is loaded into one when it is
admitted (`acquire`), held while the request lives (its KV depends on it), and an adapter
no live request holds is evicted least recently used first, unless pinned.

Files are never read on the MLX thread (a read freezes every stream): `read_adapter_files`
reads, hashes and parses an adapter directory in a worker thread into plain numpy data,
refusing a weights file larger than any adapter of rank `lora.max_rank` for this model can be
(`max_adapter_bytes`, checked on its size before reading). The bank only turns that data into
arrays: `register` takes it directly; an evicted adapter a step's admission reloads takes what
the model actor read and `staged` for that step.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from policies.adapters import CONFIG_FILE, WEIGHTS_FILE, digest_of
from protocols.api import AdapterInfo
from protocols.errors import AdapterLoadError, AdapterNotFoundError, InvalidRequestError

# Base layers a delta can be added to (a quantized one is kept quantized on GPU backends).
_LINEAR = (nn.Linear, nn.QuantizedLinear)
# What a valid adapter's weights file holds past its tensors (the safetensors header);
# `adapter_config.json` holds a few parameters.
HEADER_ALLOWANCE = 1 << 20
MAX_CONFIG_BYTES = 1 << 20
# Tensor types a LoRA adapter is stored in (as numpy reads them: BF16 as raw 16-bit words).
_DTYPES: dict[object, np.dtype] = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(np.uint16)}
_MAX_ITEMSIZE = 4  # float32, the widest type accepted


@dataclass
class AdapterFiles:
    """An adapter directory as read off the MLX thread (plain data: no `mx`): its LoRA
    parameters, its tensors as float32 numpy arrays, and its files' digest."""

    name: str
    path: str
    rank: int
    scale: float
    tensors: dict[str, np.ndarray]
    digest: str


@dataclass
class AdapterWeights:
    """One adapter checked against the model: per targeted module, A `[in, r]` and B `[r, out]`."""

    name: str
    path: str
    rank: int
    scale: float
    # Emptied once the weights are in the bank's stacks.
    modules: dict[str, tuple[mx.array, mx.array]]
    digest: str
    num_modules: int = 0
    num_bytes: int = 0


# -- files (a worker thread: plain I/O and numpy, never `mx`) --------------------------------


def max_adapter_bytes(model: nn.Module, max_rank: int) -> int:
    """The largest `adapters.safetensors` a valid adapter for `model` can be: float32 A and B
    of rank `max_rank` on every linear layer, plus the header (MLX thread: reads shapes)."""
    dims = sum(sum(_dims(module)) for _, module in model.named_modules() if isinstance(module, _LINEAR))
    return max_rank * dims * _MAX_ITEMSIZE + HEADER_ALLOWANCE


def read_adapter_files(name: str, path: str | Path, max_bytes: int) -> AdapterFiles:
    """Read, hash and parse an adapter directory in mlx-lm's format (`adapter_config.json`,
    `adapters.safetensors`, as `mlx_lm.lora` writes them); blocking, off the MLX thread and the
    event loop. A weights file over `max_bytes` is refused before any of it is read."""
    directory = Path(path).expanduser()
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterLoadError(f"adapter {name!r}: {directory} needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config_bytes = _read_bounded(name, config_path, MAX_CONFIG_BYTES)
        weights_bytes = _read_bounded(name, weights_path, max_bytes)
        config = json.loads(config_bytes)
    except (OSError, ValueError) as exc:
        raise AdapterLoadError(f"adapter {name!r}: cannot read {directory}: {exc}") from None
    rank, scale = _lora_parameters(name, config)
    tensors = _parse_safetensors(name, weights_bytes)
    for key, value in tensors.items():
        if not np.isfinite(value).all():
            raise AdapterLoadError(f"adapter {name!r}: {key.rpartition('.')[0]} holds values that are not finite")
    return AdapterFiles(name, str(path), rank, scale, tensors, digest_of(config_bytes, weights_bytes))


def read_staged(wanted: Iterable[tuple[str, str]], max_bytes: int) -> dict[str, AdapterFiles | AdapterLoadError]:
    """`read_adapter_files` for each (name, path); an adapter that cannot be read is its error
    (it fails only the requests that need it)."""
    staged: dict[str, AdapterFiles | AdapterLoadError] = {}
    for name, path in wanted:
        try:
            staged[name] = read_adapter_files(name, path, max_bytes)
        except AdapterLoadError as exc:
            staged[name] = exc
    return staged


def _read_bounded(name: str, path: Path, max_bytes: int) -> bytes:
    size = path.stat().st_size
    if size > max_bytes:
        raise AdapterLoadError(f"adapter {name!r}: {path} is {size:,} bytes, over the {max_bytes:,} an adapter of this model can take (lora.max_rank)")
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)  # a file grown since its stat is refused too
    if len(data) > max_bytes:
        raise AdapterLoadError(f"adapter {name!r}: {path} is over the {max_bytes:,} bytes an adapter of this model can take (lora.max_rank)")
    return data


def _lora_parameters(name: str, config: object) -> tuple[int, float]:
    if not isinstance(config, dict):
        raise AdapterLoadError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterLoadError(f"adapter {name!r}: fine_tune_type {kind!r} is not supported (only LoRA deltas can share a batch)")
    params = config.get("lora_parameters") or {}
    try:
        rank, scale = int(params["rank"]), float(params["scale"])
    except (KeyError, TypeError, ValueError, OverflowError):  # (OverflowError: `rank: Infinity`)
        raise AdapterLoadError(f"adapter {name!r}: lora_parameters needs a numeric 'rank' and 'scale'") from None
    if not math.isfinite(scale):
        raise AdapterLoadError(f"adapter {name!r}: scale {scale} is not finite")
    return rank, scale


def _parse_safetensors(name: str, data: bytes) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file (an 8-byte header length, a JSON header of dtype,
    shape and data offsets, the data), as float32 (exactly: F16 and BF16 widen losslessly)."""

    def bad(why: str) -> AdapterLoadError:
        return AdapterLoadError(f"adapter {name!r}: {WEIGHTS_FILE} is not a safetensors file of named tensors ({why})")

    length = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 <= length <= len(data) - 8:
        raise bad("no header")
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError:
        raise bad("the header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    base, tensors = 8 + length, {}
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, offsets = (spec.get(k) for k in ("dtype", "shape", "data_offsets")) if isinstance(spec, dict) else (None, None, None)
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and isinstance(offsets, list) and len(offsets) == 2):
            raise bad(f"{key} has no shape and data offsets")
        stored = _DTYPES.get(dtype)
        if stored is None:
            raise AdapterLoadError(f"adapter {name!r}: {key} is {dtype}; LoRA weights are F32, F16 or BF16")
        start, end = offsets
        count = math.prod(shape)
        if not (type(start) is int and type(end) is int and 0 <= start <= end <= len(data) - base and end - start == count * stored.itemsize):
            raise bad(f"{key}'s data offsets do not fit its shape")
        raw = np.frombuffer(data, dtype=stored, count=count, offset=base + start).reshape(shape)
        tensors[key] = (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else raw.astype(np.float32)
    if not tensors:
        raise AdapterLoadError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return tensors


# -- weights (the MLX thread) -------------------------------------------------------------


def adapter_weights(files: AdapterFiles, model: nn.Module) -> AdapterWeights:
    """An adapter's read tensors checked against `model` and made arrays. Raises
    `AdapterLoadError` for anything this runtime cannot apply exactly (DoRA, full fine-tunes,
    embeddings, experts, shapes that do not fit the model)."""
    name = files.name
    modules_by_name = dict(model.named_modules())
    paired: dict[str, dict[str, np.ndarray]] = {}
    for key, value in files.tensors.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise AdapterLoadError(f"adapter {name!r}: {key} is not a LoRA weight (lora_a, lora_b)")
        paired.setdefault(module, {})[leaf] = value
    modules: dict[str, tuple[mx.array, mx.array]] = {}
    rank = files.rank
    for module, pair in sorted(paired.items()):
        base = modules_by_name.get(module)
        if isinstance(base, RoutedLoRA):
            base = base.linear
        if not isinstance(base, _LINEAR):
            what = "no such layer" if base is None else f"a {type(base).__name__}, not a linear layer"
            raise AdapterLoadError(f"adapter {name!r}: {module} is {what} in this model")
        if set(pair) != {"lora_a", "lora_b"}:
            raise AdapterLoadError(f"adapter {name!r}: {module} needs both lora_a and lora_b")
        a, b = pair["lora_a"], pair["lora_b"]
        in_dims, out_dims = _dims(base)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != in_dims or b.shape[1] != out_dims or a.shape[1] != b.shape[0]:
            raise AdapterLoadError(f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, the layer maps {in_dims} -> {out_dims}")
        rank = max(rank, a.shape[1])
        # Float32 stacks: an adapter's weights as stored, promoted like mlx-lm's matmul does.
        modules[module] = (mx.array(a), mx.array(b))
    num_bytes = sum(a.nbytes + b.nbytes for a, b in modules.values())
    return AdapterWeights(name, files.path, rank, files.scale, modules, files.digest, num_modules=len(modules), num_bytes=num_bytes)


def _dims(linear: nn.Module) -> tuple[int, int]:
    out_dims, in_dims = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        in_dims = in_dims * 32 // linear.bits
    return in_dims, out_dims


class RoutedLoRA(nn.Module):
    """A linear layer plus each forwarded row's own adapter delta (none when nothing is routed)."""

    def __init__(self, linear: nn.Module, bank: AdapterBank, key: str):
        super().__init__()
        self.linear = linear
        # Plain attributes (not module state): the bank owns the stacks.
        object.__setattr__(self, "_bank", bank)
        object.__setattr__(self, "_key", key)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        route = self._bank.route
        if route is None:
            return y
        a, b = self._bank.stacks[self._key]
        z = mx.gather_mm(mx.gather_mm(x, a, rhs_indices=route.slots), b, rhs_indices=route.slots)
        return y + (route.scales * z).astype(x.dtype)


@dataclass(frozen=True)
class Route:
    """The forwarded rows' slots `[rows]` and their scales `[rows, 1, 1]`."""

    slots: mx.array
    scales: mx.array


@dataclass
class _Known:
    path: str
    pinned: bool
    # Fixed by the first load: a reload from changed files is refused.
    digest: str = ""


@dataclass
class _Resident:
    weights: AdapterWeights
    slot: int
    users: int = 0


@dataclass
class AdapterBank:
    """The known adapters, and the resident ones' slots and stacks, for one model."""

    model: nn.Module
    max_resident: int
    max_rank: int
    known: dict[str, _Known] = field(default_factory=dict)
    stacks: dict[str, tuple[mx.array, mx.array]] = field(default_factory=dict)
    route: Route | None = None
    # The largest weights file a valid adapter can be (`max_adapter_bytes`); plain data, read
    # by the event loop side before it reads an adapter's files.
    max_file_bytes: int = 0
    _resident: OrderedDict[str, _Resident] = field(default_factory=OrderedDict)
    _scales: list[float] = field(default_factory=list)
    _rank: int = 0
    # For the step being run: the files of adapters it may load (read before it, off this
    # thread), and the adapters its admissions name (never evicted meanwhile).
    _staged: dict[str, AdapterFiles | AdapterLoadError] = field(default_factory=dict)
    _wanted: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._scales = [0.0] * (self.max_resident + 1)
        self.max_file_bytes = max_adapter_bytes(self.model, self.max_rank)
        self.model.mlxrt_adapters = self

    # -- what is known and resident --------------------------------------------------------

    def register(self, files: AdapterFiles, *, pinned: bool = False) -> AdapterInfo:
        """Know an adapter by name and load it now from its files, as read (checked, into a
        slot: evicting the least recently used idle one if the slots are full)."""
        name, path = files.name, files.path
        known = self.known.get(name)
        if known is not None and known.path != path:
            raise InvalidRequestError(f"adapter {name!r} is already loaded from {known.path}; unload it first", field="name")
        self.known[name] = _Known(path, pinned)
        try:
            if name not in self._resident:
                self._load(name, files)
        except Exception:
            if known is None:
                del self.known[name]
            else:
                self.known[name] = known
            raise
        self.known[name].digest = self._resident[name].weights.digest
        return self.info(name)

    def unregister(self, name: str) -> None:
        """Forget an adapter (its slot is freed); refused while requests hold it."""
        if name not in self.known:
            raise AdapterNotFoundError(f"no adapter named {name!r}", field="name")
        resident = self._resident.get(name)
        if resident is not None and resident.users:
            raise InvalidRequestError(f"adapter {name!r} is in use by {resident.users} request(s)", field="name")
        if resident is not None:
            self._evict(name)
        del self.known[name]

    def acquire(self, name: str, digest: str) -> int:
        """The slot holding `name` for a request that starts (loaded if it is not resident);
        held until `release`. `digest` is the adapter the request was admitted with."""
        known = self.known.get(name)
        if known is None:
            raise AdapterNotFoundError(f"no adapter named {name!r} (unloaded since the request was admitted)", field="adapter")
        if digest != known.digest:
            raise AdapterLoadError(f"adapter {name!r} was replaced since the request was admitted")
        resident = self._resident.get(name) or self._load(name, self._staged_files(name))
        resident.users += 1
        self._resident.move_to_end(name)
        return resident.slot

    def reserve(self, names: Iterable[str]) -> list[tuple[str, str]]:
        """Before a step whose admissions name these adapters: none of them is evicted until
        it ends, and the (name, path) of those not resident, whose files are to be read (off
        this thread) and handed to `staged` for the step."""
        self._wanted = set(names)
        return [(name, self.known[name].path) for name in sorted(self._wanted) if name in self.known and name not in self._resident]

    @contextlib.contextmanager
    def staged(self, files: dict[str, AdapterFiles | AdapterLoadError]) -> Iterator[None]:
        """Within (a step): `acquire` loads evicted adapters from these files, never from disk."""
        self._staged = dict(files)
        try:
            yield
        finally:
            self._staged, self._wanted = {}, set()

    def _staged_files(self, name: str) -> AdapterFiles:
        staged = self._staged.get(name)
        if isinstance(staged, AdapterLoadError):
            raise AdapterLoadError(str(staged))
        if staged is None or staged.path != self.known[name].path:
            raise AdapterLoadError(f"adapter {name!r}: its files were not read before the step that loads it (an engine bug)")
        return staged

    def release(self, name: str) -> None:
        resident = self._resident.get(name)
        if resident is not None and resident.users > 0:
            resident.users -= 1

    def release_all(self) -> None:
        """The engine dropped every request."""
        for resident in self._resident.values():
            resident.users = 0

    def info(self, name: str) -> AdapterInfo:
        known, resident = self.known[name], self._resident.get(name)
        if resident is None:
            return AdapterInfo(name=name, path=known.path, pinned=known.pinned, digest=known.digest)
        w = resident.weights
        return AdapterInfo(
            name=name,
            path=known.path,
            pinned=known.pinned,
            resident=True,
            rank=w.rank,
            scale=w.scale,
            modules=w.num_modules,
            num_bytes=w.num_bytes,
            digest=w.digest,
            users=resident.users,
        )

    def infos(self) -> list[AdapterInfo]:
        return [self.info(name) for name in sorted(self.known)]

    @property
    def nbytes(self) -> int:
        """The stacks' bytes (every slot's share, resident or not: what is allocated)."""
        return sum(a.nbytes + b.nbytes for a, b in self.stacks.values())

    # -- routing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def routed(self, slots: list[int]) -> Iterator[None]:
        """Within: a forward of these rows (in this order) adds each row's own delta."""
        if not any(slots):
            yield
            return
        index = mx.array(slots, dtype=mx.uint32)
        self.route = Route(slots=index, scales=mx.array(self._scales, dtype=mx.float32)[index][:, None, None])
        try:
            yield
        finally:
            self.route = None

    # -- slots -------------------------------------------------------------------------------

    def _load(self, name: str, files: AdapterFiles) -> _Resident:
        known = self.known[name]
        if known.digest and files.digest != known.digest:
            raise AdapterLoadError(f"adapter {name!r}: the files in {known.path} changed since it was loaded; load it again")
        weights = adapter_weights(files, self.model)
        if weights.rank > self.max_rank:
            raise AdapterLoadError(f"adapter {name!r} has rank {weights.rank}, over lora.max_rank = {self.max_rank}")
        slot = self._free_slot(name)
        if weights.rank > self._rank:
            self._grow_rank(weights.rank)
        self._install(weights.modules)
        for key, (a_stack, b_stack) in self.stacks.items():
            a, b = weights.modules.get(key, (None, None))
            if a is None or b is None:
                a_stack[slot] = 0.0
                b_stack[slot] = 0.0
            else:
                r = a.shape[1]
                a_stack[slot] = mx.pad(a, [(0, 0), (0, self._rank - r)]) if r < self._rank else a
                b_stack[slot] = mx.pad(b, [(0, self._rank - r), (0, 0)]) if r < self._rank else b
        self._scales[slot] = weights.scale
        mx.eval([array for pair in self.stacks.values() for array in pair])
        weights.modules = {}
        resident = _Resident(weights=weights, slot=slot)
        self._resident[name] = resident
        return resident

    def _free_slot(self, name: str) -> int:
        used = {r.slot for r in self._resident.values()}
        for slot in range(1, self.max_resident + 1):
            if slot not in used:
                return slot
        for victim, resident in self._resident.items():  # least recently used first
            if not resident.users and not self.known[victim].pinned and victim not in self._wanted:
                slot = resident.slot
                self._evict(victim)
                return slot
        raise AdapterLoadError(f"adapter {name!r}: all {self.max_resident} adapter slots hold adapters in use or pinned (lora.max_resident)")

    def _evict(self, name: str) -> None:
        """Free the slot (no row routes to it; the next adapter there overwrites every stack)."""
        resident = self._resident.pop(name)
        self._scales[resident.slot] = 0.0

    def _install(self, modules: dict[str, tuple[mx.array, mx.array]]) -> None:
        """Route the layers this adapter targets (the first adapter to touch a layer wraps it)."""
        by_name = dict(self.model.named_modules())
        wrapped = []
        for key in modules:
            if key in self.stacks:
                continue
            linear = by_name[key]
            in_dims, out_dims = _dims(linear)
            slots = self.max_resident + 1
            self.stacks[key] = (mx.zeros((slots, in_dims, self._rank)), mx.zeros((slots, self._rank, out_dims)))
            wrapped.append((key, RoutedLoRA(linear, self, key)))
        if wrapped:
            self.model.update_modules(tree_unflatten(wrapped))

    def _grow_rank(self, rank: int) -> None:
        grow = rank - self._rank
        for key, (a_stack, b_stack) in self.stacks.items():
            self.stacks[key] = (mx.pad(a_stack, [(0, 0), (0, 0), (0, grow)]), mx.pad(b_stack, [(0, 0), (0, grow), (0, 0)]))
        self._rank = rank


def routed(model: nn.Module, slots: list[int]) -> contextlib.AbstractContextManager[None]:
    """Route a forward's rows to their adapter slots (nothing to do for a model without any)."""
    bank: AdapterBank | None = getattr(model, "mlxrt_adapters", None)
    return bank.routed(slots) if bank is not None else contextlib.nullcontext()
