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
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from policies.adapters import CONFIG_FILE, WEIGHTS_FILE, adapter_digest
from protocols.api import AdapterInfo
from protocols.errors import AdapterLoadError, AdapterNotFoundError, InvalidRequestError

# Base layers a delta can be added to (a quantized one is kept quantized on GPU backends).
_LINEAR = (nn.Linear, nn.QuantizedLinear)


@dataclass
class AdapterWeights:
    """One adapter as read from its directory: per targeted module, A `[in, r]` and B `[r, out]`."""

    name: str
    path: str
    rank: int
    scale: float
    # Emptied once the weights are in the bank's stacks.
    modules: dict[str, tuple[mx.array, mx.array]]
    digest: str
    num_modules: int = 0
    num_bytes: int = 0


def read_adapter(name: str, path: str | Path, model: nn.Module) -> AdapterWeights:
    """An adapter directory in mlx-lm's format (`adapter_config.json`, `adapters.safetensors`,
    as `mlx_lm.lora` writes them), checked against `model`. Raises `AdapterLoadError` for
    anything this runtime cannot apply exactly (DoRA, full fine-tunes, embeddings, experts,
    shapes that do not fit the model)."""
    directory = Path(path).expanduser()
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterLoadError(f"adapter {name!r}: {directory} needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_path.read_text())
        digest = adapter_digest(directory)
        weights = mx.load(str(weights_path))
    except (OSError, ValueError, RuntimeError) as exc:
        raise AdapterLoadError(f"adapter {name!r}: cannot read {directory}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterLoadError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterLoadError(f"adapter {name!r}: fine_tune_type {kind!r} is not supported (only LoRA deltas can share a batch)")
    params = config.get("lora_parameters") or {}
    try:
        rank, scale = int(params["rank"]), float(params["scale"])
    except (KeyError, TypeError, ValueError):
        raise AdapterLoadError(f"adapter {name!r}: lora_parameters needs a numeric 'rank' and 'scale'") from None
    if not math.isfinite(scale):
        raise AdapterLoadError(f"adapter {name!r}: scale {scale} is not finite")
    if not isinstance(weights, dict):
        raise AdapterLoadError(f"adapter {name!r}: {WEIGHTS_FILE} holds no named tensors")
    modules_by_name = dict(model.named_modules())
    paired: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise AdapterLoadError(f"adapter {name!r}: {key} is not a LoRA weight (lora_a, lora_b)")
        paired.setdefault(module, {})[leaf] = value
    modules: dict[str, tuple[mx.array, mx.array]] = {}
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
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        if not (mx.isfinite(a).all() and mx.isfinite(b).all()).item():
            raise AdapterLoadError(f"adapter {name!r}: {module} holds values that are not finite")
        modules[module] = (a, b)
    if not modules:
        raise AdapterLoadError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    num_bytes = sum(a.nbytes + b.nbytes for a, b in modules.values())
    return AdapterWeights(name, str(directory), rank, scale, modules, digest, num_modules=len(modules), num_bytes=num_bytes)


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
    _resident: OrderedDict[str, _Resident] = field(default_factory=OrderedDict)
    _scales: list[float] = field(default_factory=list)
    _rank: int = 0

    def __post_init__(self) -> None:
        self._scales = [0.0] * (self.max_resident + 1)
        self.model.mlxrt_adapters = self

    # -- what is known and resident --------------------------------------------------------

    def register(self, name: str, path: str, *, pinned: bool = False) -> AdapterInfo:
        """Know an adapter by name and load it now (checked, into a slot: evicting the least
        recently used idle one if the slots are full)."""
        known = self.known.get(name)
        if known is not None and known.path != str(path):
            raise InvalidRequestError(f"adapter {name!r} is already loaded from {known.path}; unload it first", field="name")
        self.known[name] = _Known(str(path), pinned)
        try:
            if name not in self._resident:
                self._load(name)
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
        resident = self._resident.get(name) or self._load(name)
        resident.users += 1
        self._resident.move_to_end(name)
        return resident.slot

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

    def _load(self, name: str) -> _Resident:
        known = self.known[name]
        weights = read_adapter(name, known.path, self.model)
        if known.digest and weights.digest != known.digest:
            raise AdapterLoadError(f"adapter {name!r}: the files in {known.path} changed since it was loaded; load it again")
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
            if not resident.users and not self.known[victim].pinned:
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
