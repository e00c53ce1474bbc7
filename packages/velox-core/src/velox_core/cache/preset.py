"""``PresetCache``: a :class:`VeloxCache` built from a method's typed config dataclass.

A method package subclasses it with ``Config`` (a dataclass that validates itself in
``__post_init__``) and ``build(config)`` (returning the ``VeloxCache`` keyword arguments:
codecs, tiers, window, sinks, policy). Parameters are keyword-only, checked by name, and
saved with the cache as the config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from .velox import VeloxCache

__all__ = ["PresetCache", "check_kept_codes", "kept_codecs", "resolve_bits"]


def resolve_bits(bits, key_bits, value_bits):
    """``key_bits`` and ``value_bits`` default to ``bits``."""
    return (bits if key_bits is None else key_bits, bits if value_bits is None else value_bits)


def check_kept_codes(cfg: Any) -> None:
    """Validate the settings eviction presets share for coding the tokens they keep:
    ``bits`` (None keeps them as given), ``key_bits``/``value_bits`` (2 to 8, need ``bits``)
    and ``group``."""
    from ..validation import check_int, check_widths

    check_widths(cfg)
    if cfg.bits is None and (cfg.key_bits is not None or cfg.value_bits is not None):
        raise ValueError("key_bits/value_bits need bits (the codes of the kept tokens)")
    check_int("group", cfg.group, minimum=1)


def kept_codecs(cfg: Any) -> dict[str, Any]:
    """``velox_core.Uniform`` key and value codecs for the kept tokens, or none (fp16)."""
    from ..codec.uniform import Uniform

    if cfg.bits is None:
        return {}
    kb, vb = resolve_bits(cfg.bits, cfg.key_bits, cfg.value_bits)
    return {"key_codec": Uniform(kb, cfg.group), "value_codec": Uniform(vb, cfg.group)}


class PresetCache(VeloxCache):
    """Base of the method caches. Subclasses set ``method``, ``Config`` and ``build``."""

    Config: ClassVar[type]

    def __init__(self, flush: int | None = None, check_finite: bool = False, **params: Any):
        names = [f.name for f in dataclasses.fields(self.Config)]
        unknown = sorted(set(params) - set(names))
        if unknown:
            raise ValueError(
                f"{self.method}: unknown parameter {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join([*names, 'flush', 'check_finite'])}"
            )
        self.cfg = self.Config(**params)
        super().__init__(**self.build(self.cfg), flush=flush, check_finite=check_finite)

    def build(self, cfg) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must define build(config)")

    def check_dims(self, key_dim: int, value_dim: int, dtype: Any = None) -> None:
        """The config's own head-dim rules first (``Config.check_dims(key_dim, value_dim)``,
        where it has one: its message names the method's parameters), then the codecs'."""
        own = getattr(self.cfg, "check_dims", None)
        if own is not None:
            own(key_dim, value_dim)
        super().check_dims(key_dim, value_dim, dtype)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every parameter with its default: the config's fields, then the cache's ``flush``
        (None: :data:`velox_core.cache.velox.FLUSH`, or 1 for caches with a retention policy)
        and ``check_finite`` (refuse NaN/inf keys and values; off)."""
        fields = {f.name: f.default for f in dataclasses.fields(cls.Config)}
        return {**fields, "flush": None, "check_finite": False}

    def config(self) -> dict[str, Any]:
        extra = {"check_finite": True} if self.check_finite else {}
        return {**dataclasses.asdict(self.cfg), "flush": self.flush, **extra}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PresetCache:
        return cls(**config)
