"""The decode batch's slots for a layer: the kind its `LayerLayout` asks for.

Plain (`engine.kv.slots`: full, window, state and list layers), quantized
(`engine.kv.quantized.QuantizedSlots`, `kv.bits`) or paged (`engine.kv.paged.PagedSlots`,
`kv.block_size`) full-attention slots. The choice lives here, above every slot kind, so that
`engine.kv.slots` never imports the kinds built on its `FullSlots`.
"""

from __future__ import annotations

from engine.kv.paged import PagedSlots
from engine.kv.quantized import QuantizedSlots
from engine.kv.slots import FullSlots, ListSlots, Slots, StateSlots, WindowSlots
from protocols.model import LayerLayout


def make_slots(batch, layout: LayerLayout) -> Slots:
    match layout.kind:
        case "full" if layout.kv_bits:
            return QuantizedSlots(batch, layout)
        case "full" if layout.kv_block:
            return PagedSlots(batch, layout, batch.next_paged_ordinal())
        case "full":
            return FullSlots(batch, layout)
        case "window":
            return WindowSlots(batch, layout)
        case "state":
            return StateSlots(batch, layout)
        case "list":
            return ListSlots(layout, [make_slots(batch, part) for part in layout.parts])
    raise ValueError(f"unknown layer kind {layout.kind!r}")
