"""``PresetCache``: a :class:`VeloxCache` built from a method's typed config dataclass.

A method package subclasses it with ``Config`` (a dataclass that validates itself in
``__post_init__``) and either ``make_codecs(config, kb, vb)`` (its key and value codec at
the widths the config resolves, see :class:`CodeWidths`) or ``build(config)`` (returning
the ``VeloxCache`` keyword arguments: codecs, tiers, policy). ``window`` and ``sinks``
default to the config's fields of those names, the shared parameters every method passes on
as they are. Parameters are keyword-only, checked by name, and saved with the cache as the
config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..codec.base import Codec
from ..validation import check_finite_params
from .velox import VeloxCache

__all__ = ["CalibratedPreset", "check_kept_codes", "kept_codecs"]


def resolve_bits(bits, key_bits, value_bits):
    """``key_bits`` and ``value_bits`` default to ``bits``."""
    return (bits if key_bits is None else key_bits, bits if value_bits is None else value_bits)


@dataclass
class CodeWidths:
    """The code widths a method config opens with: ``bits`` (keys and values), ``key_bits``
    and ``value_bits`` (either side alone; None: ``bits``).

    A config subclasses it, so these are its first fields, in this order, and declares
    ``bits`` again where its default differs (``bits: int = 2``). The annotations admit every
    width a method may take; the config's ``__post_init__`` checks its own
    (:func:`~velox_core.validation.check_widths`: whole numbers, or the fractional widths its
    method allows).
    """

    bits: int | float = 4
    key_bits: int | float | None = None
    value_bits: int | float | None = None

    @property
    def widths(self) -> tuple[Any, Any]:
        """``(key width, value width)``: ``key_bits`` and ``value_bits``, default ``bits``."""
        return resolve_bits(self.bits, self.key_bits, self.value_bits)


def config_fields(cfg: Any, *names: str) -> dict[str, Any]:
    """The config's fields ``names`` as keyword arguments, for a codec or policy whose
    parameters have the config's names."""
    return {name: getattr(cfg, name) for name in names}


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
    """Base of the method caches. Subclasses set ``method``, ``Config`` and ``make_codecs`` or
    ``build``."""

    Config: ClassVar[type]

    def __init__(self, flush: int | None = None, check_finite: bool = False, **params: Any):
        names = [f.name for f in dataclasses.fields(self.Config)]
        unknown = sorted(set(params) - set(names))
        if unknown:
            raise ValueError(
                f"{self.method}: unknown parameter {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join([*names, 'flush', 'check_finite'])}"
            )
        check_finite_params(self.method, params)  # every float parameter, of every method
        self.cfg = self.Config(**params)
        kwargs = self.build(self.cfg)
        for name in ("window", "sinks"):  # the shared names, as the config has them
            if name not in kwargs and hasattr(self.cfg, name):
                kwargs[name] = getattr(self.cfg, name)
        super().__init__(**kwargs, flush=flush, check_finite=check_finite)
        self._flush_given = flush is not None  # checked against the codecs' block (check_dims)

    def build(self, cfg) -> dict[str, Any]:
        """The ``VeloxCache`` keyword arguments. By default one tier: the key and value codec
        of :meth:`make_codecs` at the config's widths (``key_bits``/``value_bits``, default
        ``bits``)."""
        widths = resolve_bits(cfg.bits, cfg.key_bits, cfg.value_bits)
        key_codec, value_codec = self.make_codecs(cfg, *widths)
        return {"key_codec": key_codec, "value_codec": value_codec}

    def make_codecs(self, cfg: Any, kb: Any, vb: Any) -> tuple[Codec, Codec]:
        """The key codec at width ``kb`` and the value codec at ``vb`` (the config's
        ``key_bits`` and ``value_bits``, default ``bits``)."""
        raise NotImplementedError(
            f"{type(self).__name__} must define make_codecs(config, kb, vb) or build(config)"
        )

    def check_dims(self, key_dim: int, value_dim: int, dtype: Any = None) -> None:
        """The config's own head-dim rules first (``Config.check_dims(key_dim, value_dim)``,
        where it has one: its message names the method's parameters), then the codecs'."""
        own = getattr(self.cfg, "check_dims", None)
        if own is not None:
            own(key_dim, value_dim)
        super().check_dims(key_dim, value_dim, dtype)
        if getattr(self, "_flush_given", False):
            warn_flush_rounding(self)

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


class CalibratedPreset(PresetCache):
    """A preset whose codecs fit once per sequence, on the first ``calibration`` tokens after
    the sinks (the config's ``calibration``), where the papers calibrate offline: until those
    tokens are all stored they wait in fp16 in the window and nothing is coded; the update
    that completes them fits the codecs (:meth:`calibrate`) and coding starts.

    The fitted arrays have one row per sequence (the codecs' ``filter_batch`` and
    ``extend_batch``), so two caches join only both calibrated or neither.
    """

    @property
    def calibrated(self) -> bool:
        """Whether the codecs have fitted (those of the first tier that fit at all)."""
        t = self.tiers[0]
        return all(getattr(c, "fitted", True) for c in (t.key_codec, t.value_codec))

    def calibrate(self, tokens: int) -> None:
        """Fit the codecs on the window's first ``tokens`` tokens. The default leaves it to the
        codecs, which fit on their first encode (every whole block past the window)."""

    def before_coding(self) -> bool:
        if self.calibrated:
            return True
        if self.stored.window[0].tokens < self.window + self.cfg.calibration:
            return False
        self.calibrate(self.cfg.calibration)
        return True

    def extend(self, other: PresetCache) -> None:
        if type(other) is type(self) and self.calibrated != other.calibrated:
            raise ValueError(
                "extend: both caches must be calibrated, or neither (feed each past its "
                f"{self.cfg.calibration} calibration tokens)"
            )
        super().extend(other)


def warn_flush_rounding(cache: VeloxCache) -> None:
    """Warn when a ``flush`` the user gave is not what the cache does: the window passes
    tokens to block codecs in whole blocks, so a flush that is no multiple of the block (1,
    say, with a codec that codes 64-token groups) is rounded up."""
    import math
    import warnings

    t = cache.tiers[0]
    block = math.lcm(t.key_codec.block, t.value_codec.block)
    quantum = math.lcm(cache.flush, block)
    if quantum == cache.flush:
        return
    coded = " and ".join(
        f"{side} codec {c.describe()} codes {c.block} tokens together"
        for side, c in (("its key", t.key_codec), ("its value", t.value_codec))
        if c.block > 1
    )
    warnings.warn(
        f"{cache.method}: flush={cache.flush} is rounded up to {quantum} tokens ({coded}): up "
        f"to {quantum - 1} of the newest tokens past the window wait in fp16 until a whole "
        f"block is coded; a flush that is a multiple of {block} is honoured as given",
        UserWarning,
        stacklevel=3,
    )
