"""``XQuantPair``: two adjacent layers whose caches share their codes.

XQuant's cross-layer compression (arXiv 2510.11236) partitions the layers into pairs
``(l - 1, l)``: for the higher layer of a pair it computes and stores only the scaling
factors and zero-points of each group, and at dequantization it fetches the quantized codes
of the lower layer. The pair holds those codes once (``codes.k``, ``codes.v``: the packed
codes of the sides it shares, Packed ``{"codes": (B, H, T, W)}``); each layer's cache keeps
its own calibrated scales and zero-points, its fp16 window and sinks, and the codes of a side
the pair does not share.

Order: a model runs its layers in order, and both layers of a pair take the same tokens with
the same settings, so the lower layer codes a token group before the higher one does; the
lower layer (the pair's first present member, its *writer*) appends the codes, the higher
layer checks they are there and appends only its scales. A copy holding one layer alone is
its own writer.
"""

from __future__ import annotations

from typing import Any

from velox_core.cache.linked import LayerGroup
from velox_core.cache.store import PackedStore

__all__ = ["XQuantPair"]


class XQuantPair(LayerGroup):
    """The codes two adjacent layers share.

    Args:
        members: the layers' caches, lower layer first (a slot may be None: a copy holding
            one layer alone).
    """

    title, noun, shared = "a layer pair", "pair", "codes"

    def __init__(self, members: list[Any]):
        self.codes = (PackedStore(256), PackedStore(256))  # keys, values: Packed {"codes"}
        super().__init__(members)

    def named_stores(self) -> dict[str, PackedStore]:
        return {"codes.k": self.codes[0], "codes.v": self.codes[1]}

    def take_shared(self, other: XQuantPair) -> None:
        self.codes = other.codes

    def shrink(self) -> None:
        """Drop codes no layer uses any more (after the layers' trims): each shared store
        keeps as many tokens as the layer coding the most of them holds."""
        for i, side in enumerate("kv"):
            used = [m.stored.coded[0][i].tokens for m in self.present if side in m.shared]
            if used and self.codes[i].tokens > max(used):
                self.codes[i].truncate(max(used))
