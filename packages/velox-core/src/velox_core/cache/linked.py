"""``LinkedLayers``: a preset whose layers' caches share state through a group coordinator.

Cross-layer methods (MiniCache's merged pairs, xKV's layer groups) store part of several
adjacent layers' tokens once for the group. A coordinator (a :class:`LayerGroup`) holds what
the layers share; each layer's cache (a :class:`LinkedLayers`) holds its own part and an fp16
window, and reaches the coordinator as ``cache.group`` (its slot: ``cache.member``). What
every such method does the same way lives here:

- membership: ``members`` in layer order (a slot may be None in a copy holding some layers),
  ``owner`` the first present layer, whose bytes and file record include the shared stores;
- ``flush`` is refused (the group decides when tokens leave the windows);
- mlx-lm's batching (``filter`` / ``extend`` / ``merge``, and ``extract`` through ``filter``)
  handles each layer alone, so a layer that shares state refuses it up front;
- the file record: each layer records ``{"layer", "layers", "owner"}`` under its method's name
  (plus its own fields), the owner the shared stores; ``load_cache`` calls ``link_layers``,
  which joins each recorded group again from its owner's record;
- copies: ``copy()`` is a group of its own holding the shared stores; one ``deepcopy`` of a
  model's caches shares one copy of each group.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from ..validation import check_int
from .preset import PresetCache
from .store import PackedStore
from .tiers import trim_stores

__all__ = ["LayerGroup", "LinkedLayers"]


class LayerGroup:
    """The coordinator of adjacent layers whose caches share state.

    Subclasses set the words of their messages and say which stores they share.

    Args:
        members: the layers' caches, in layer order (a slot may be None: a copy holding only
            some layers).
    """

    title: ClassVar[str] = "a layer group"  # "a layer of <title>" in the batching refusal
    noun: ClassVar[str] = "group"  # "layers [...] of <noun> [...]" in the file checks
    shared: ClassVar[str] = "shared stores"  # what the layers share, in messages

    def __init__(self, members: list[Any]):
        self.members = list(members)
        for i, m in enumerate(self.members):
            if m is not None:
                m.group, m.member = self, i

    @property
    def present(self) -> list[Any]:
        return [m for m in self.members if m is not None]

    @property
    def owner(self) -> Any:
        """The layer whose bytes and file record include the shared state (the first)."""
        return self.present[0]

    @property
    def layers(self) -> list[int | None]:
        return [m.layer for m in self.present]

    def named_stores(self) -> dict[str, PackedStore]:
        """The shared stores by their names in the owner's file record."""
        raise NotImplementedError(f"{type(self).__name__} must define named_stores()")

    def take_shared(self, other: LayerGroup) -> None:
        """Hold ``other``'s shared state (a group of the same layers, joined again by
        ``load_cache`` or made by ``deepcopy``)."""
        raise NotImplementedError(f"{type(self).__name__} must define take_shared(other)")


class LinkedLayers(PresetCache):
    """Base of the caches of one layer of a :class:`LayerGroup`.

    Subclasses set ``Group``, ``no_flush`` (why ``flush`` does not apply), ``batch_hint``
    (what to do instead of batching a linked layer) and :meth:`group_fresh`; they may add
    their own record fields (:meth:`_record`, :meth:`_restore`) and stores
    (:meth:`_layer_stores`).
    """

    Group: ClassVar[type[LayerGroup]]
    no_flush: ClassVar[str]
    batch_hint: ClassVar[str]

    def __init__(self, flush: int | None = None, **params: Any):
        if flush is not None:
            raise ValueError(f"{self.method}: flush does not apply ({self.no_flush})")
        self.group: LayerGroup | None = None  # set by the group (LayerGroup.__init__)
        self.member = 0
        self.layer: int | None = None
        self._saved: dict | None = None  # the group record of a loaded layer, until linked
        self._detached = False  # True while recording the layer as a group of its own
        super().__init__(**params)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {k: v for k, v in super().defaults().items() if k != "flush"}

    def config(self) -> dict[str, Any]:
        return {k: v for k, v in super().config().items() if k != "flush"}

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        super().bind(model, layer)
        self.layer = layer

    # -- linking ------------------------------------------------------------------------------
    @classmethod
    def link_layers(cls, caches: list) -> None:
        """Link the model's caches of this class: fresh ones (``make_cache``) as the method
        groups them (:meth:`group_fresh`), loaded ones (``load_cache``) as the file recorded."""
        loaded: dict[tuple, list[LinkedLayers]] = {}
        for c in caches:
            if isinstance(c, cls) and c._saved is not None:
                loaded.setdefault(tuple(c._saved["layers"]), []).append(c)
        cls.group_fresh(caches)
        for layers, members in loaded.items():
            cls._relink(list(layers), members)

    @classmethod
    def group_fresh(cls, caches: list) -> None:
        """Group the model's fresh caches of this class (``caches``: one per layer, any
        classes; skip those with a saved record)."""
        raise NotImplementedError(f"{cls.__name__} must define group_fresh(caches)")

    @classmethod
    def _relink(cls, layers: list, members: list[LinkedLayers]) -> None:
        """Join a loaded group again: its recorded layers, the shared stores from the owner's
        record."""
        g = cls.Group
        by_layer = {m.layer: m for m in members}
        owner = next((m for m in members if m._saved["owner"]), None)
        if owner is None or set(by_layer) != set(layers):
            missing = sorted(set(layers) - set(by_layer), key=str)
            raise ValueError(
                f"{cls.method}: the file holds layers {sorted(by_layer, key=str)} of {g.noun} "
                f"{layers}, missing {missing} or the {g.noun}'s {g.shared}"
            )
        recorded = owner.group  # a group of its own, holding the shared stores it loaded
        group = g([by_layer[i] for i in layers])
        group.take_shared(recorded)
        for m in members:
            m._saved = None
        if group.owner is not owner:
            raise ValueError(
                f"{cls.method}: the {g.noun}'s {g.shared} must be recorded by its first layer"
            )

    # -- trim ----------------------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        """False for a layer of a group (its shared state was fitted with the tokens a trim
        removes, which a cache that never saw them would not hold); a layer outside every
        group is a plain cache."""
        return self.group is None and super().is_trimmable()

    def trim(self, n: int) -> int:
        """Remove the newest ``n`` tokens: the window's first, then the last of those the
        layer shares (:meth:`_trim_shared`)."""
        if self.group is None:
            return super().trim(n)
        check_int("n", n, minimum=0)
        if n > self.size():
            raise ValueError(f"cannot trim {n} tokens: the cache stores {self.size()}")
        left = trim_stores(self.stored.window, n)
        if left:
            self._trim_shared(left)
        self.offset -= n
        self._planned.clear()
        return n

    def _trim_shared(self, n: int) -> None:
        """Stop using the last ``n`` of the tokens this layer shares with its group."""
        raise NotImplementedError(f"{type(self).__name__} must define _trim_shared(n)")

    # -- memory and state ---------------------------------------------------------------------
    def _layer_stores(self) -> dict[str, PackedStore]:
        """This layer's own stores by record name (by default :class:`VeloxCache`'s)."""
        return super().named_stores()

    def named_stores(self) -> dict[str, PackedStore]:
        out = self._layer_stores()
        g = self.group
        if g is not None and (self._detached or g.owner is self):  # shared: recorded once
            out.update(g.named_stores())
        return out

    def _record(self, info: dict, arrays: dict) -> None:
        """Add the method's fields to the layer's record ``info`` (``info["owner"]``: this
        record holds the shared state) and its arrays to ``arrays``."""

    def _restore(self, info: dict, arrays: dict) -> None:
        """Read back what :meth:`_record` added (after the stores are loaded)."""

    def _state_dict(self, detached: bool = False) -> tuple[dict, dict]:
        """The cache's record; ``detached`` records the layer as a group of its own (the
        shared stores included)."""
        self._detached = detached
        try:
            meta, arrays = super()._state_dict()
        finally:
            self._detached = False
        g = self.group
        alone = detached or (g is not None and len(g.present) == 1)
        info = {
            "layer": self.layer,
            "layers": None if g is None else ([self.layer] if alone else g.layers),
            "owner": g is not None and (alone or g.owner is self),
        }
        self._record(info, arrays)
        meta[self.method] = info
        meta["arrays"] = list(arrays)
        return meta, arrays

    def _load_state_dict(self, meta: dict, arrays: dict) -> None:
        info = meta.get(self.method)
        if not isinstance(info, dict):
            raise ValueError(f"{self.method}: the state has no {self.method} record")
        self.group = None
        if info["layers"] is not None:
            self.Group([self])  # a group of its own; link_layers joins the recorded one again
        super()._load_state_dict(meta, arrays)
        self.layer = info["layer"]
        self._restore(info, arrays)
        layers = info["layers"]
        self._saved = info if layers is not None and len(layers) > 1 else None

    def copy(self) -> LinkedLayers:
        """An independent cache of this layer, as a group of its own holding the shared
        stores (new tokens then have no partner layer)."""
        meta, arrays = self._state_dict(detached=True)
        out = type(self).from_state([json.dumps(meta), *arrays.values()])
        out.fetch_decoded = self.fetch_decoded
        return out

    def __deepcopy__(self, memo) -> LinkedLayers:
        """Copies of a model's caches made in one deepcopy share one copy of each group."""
        out = self.copy()
        memo[id(self)] = out
        g = self.group
        if g is not None and len(g.members) > 1:
            clone = memo.get(id(g))
            if clone is None:
                clone = memo[id(g)] = self.Group([None] * len(g.members))
                clone.take_shared(out.group)
            clone.members[self.member] = out
            out.group, out.member = clone, self.member
        return out

    # -- batching: mlx-lm batches each layer alone -------------------------------------------
    def _shares_state(self) -> bool:
        """Whether batching this layer alone would split what it shares (by default: it is in
        a group of more than one layer)."""
        return self.group is not None and len(self.group.members) > 1

    def _solo(self, what: str) -> None:
        if self._shares_state():
            raise ValueError(
                f"{self.method}: {what} is not supported for a layer of {self.Group.title} "
                f"(layers {self.group.layers} share its {self.Group.shared} and mlx-lm "
                f"batches each layer alone); {self.batch_hint}"
            )

    def filter(self, batch_indices) -> None:
        self._solo("filter")
        super().filter(batch_indices)

    def extend(self, other: LinkedLayers) -> None:
        self._solo("extend")
        if isinstance(other, LinkedLayers):
            other._solo("extend")
        super().extend(other)

    @classmethod
    def merge(cls, caches: list):
        for c in caches:
            if isinstance(c, LinkedLayers):
                c._solo("merge (batching sequences)")
        return super().merge(caches)
