"""Settings of the TurboQuant cache, and the bit widths it accepts (integer or fractional)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import check_choice, check_counts, check_int, check_widths

__all__ = [
    "DEFAULT_GROUP",
    "VARIANTS",
    "TurboQuantConfig",
    "check_rvq_width",
    "check_width",
    "split_width",
]

VARIANTS = ("mse", "prod", "rvq")
DEFAULT_GROUP = 64  # tokens sharing one outlier-channel choice (fractional widths)
_MAX_BITS = 8


def check_width(name: str, value, minimum: int = 1, maximum: int = _MAX_BITS) -> int | float:
    """A bit width: an int in ``[minimum, maximum]``, or a fractional number whose integer
    neighbours both lie in that range (e.g. 2.5: channels at 2 and 3 bits).

    Integral floats (``4.0``) are returned as ints.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of bits, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if float(value).is_integer():
        return check_int(name, int(value), minimum=minimum, maximum=maximum)
    if not minimum < value < maximum:
        raise ValueError(
            f"{name}={value}: a fractional width must lie strictly between {minimum} and "
            f"{maximum} (its channels use floor and floor + 1 bits)"
        )
    return float(value)


def check_rvq_width(name: str, bits: int | float) -> None:
    """Raise ``ValueError`` unless ``bits`` (already through :func:`check_width`) is a width
    the ``rvq`` variant codes: an even integer from 2 to 8 (two stages of ``bits / 2``)."""
    if isinstance(bits, float) or bits % 2:
        raise ValueError(
            f"{name}={bits}: the rvq variant codes two residual stages of {name}/2 bits each, so "
            f"{name} must be an even integer from 2 to {_MAX_BITS} (2, 4, 6 or 8)"
        )


def split_width(name: str, bits: int | float, dim: int) -> tuple[int, int, int]:
    """``(low_bits, outlier_channels, dim)``: how ``bits`` splits a head dim ``dim``.

    ``outlier_channels`` channels get ``low_bits + 1`` bits and the rest ``low_bits``, so that
    the average is exactly ``bits``; 0 for an integer width. Raises ``ValueError`` when
    ``(bits - floor(bits)) * dim`` is not a whole number of channels, or leaves a part with
    fewer than 3 channels.
    """
    low = math.floor(bits)
    frac = bits - low
    if frac == 0:
        return int(low), 0, dim
    n = round(frac * dim)
    if abs(n - frac * dim) > 1e-6:
        raise ValueError(
            f"{name}={bits} needs ({frac:g} x head dim {dim}) = {frac * dim:g} outlier channels, "
            f"which is not a whole number; choose bits = b + k/{dim} for an integer k "
            f"(e.g. {low}.5 or {low}.25 where they divide)"
        )
    if n < 3 or dim - n < 3:
        raise ValueError(
            f"{name}={bits} splits head dim {dim} into {n} and {dim - n} channels; each part "
            f"needs at least 3"
        )
    return int(low), n, dim


@dataclass
class TurboQuantConfig(CodeWidths):
    """TurboQuant (arXiv 2504.19874) settings, with the shared parameter names.

    Attributes:
        bits: bits per channel for keys and values: an int 1 to 8, or fractional such as 2.5
            or 3.5 (a ``bits - floor(bits)`` share of the channels, chosen as outliers per
            ``group`` tokens, get one bit more; see docs/turboquant.md).
        key_bits, value_bits: either alone (default ``bits``).
        key_variant: ``"mse"`` (TurboQuant_mse: all bits on Lloyd-Max codes), ``"prod"``
            (TurboQuant_prod: ``b - 1`` bits of codes plus a 1-bit QJL sketch of the residual,
            unbiased inner products) or ``"rvq"`` (VeloxQuant-MLX's TurboQuant RVQ, no paper:
            two residual stages of ``b / 2`` bits, the second on a Laplacian codebook; ``b``
            an even integer). Values always use ``"mse"``.
        group: tokens that share one choice of outlier channels; only for fractional widths
            (default 64 there), rejected otherwise.
        window: most recent tokens kept as given (fp16); 0 in the paper.
        sinks: first tokens kept as given; 0 in the paper.
        seed: seed of the rotations and sketch matrices.
    """

    key_variant: str = "mse"
    group: int | None = None
    window: int = 0
    sinks: int = 0
    seed: int = 0

    def __post_init__(self):
        check_widths(self, check=check_width, bits_required=True)
        check_choice("key_variant", self.key_variant, VARIANTS)
        if self.key_variant == "rvq":
            check_rvq_width("key_bits" if self.key_bits is not None else "bits", self.widths[0])
        if self.group is not None:
            check_int("group", self.group, minimum=1)
            kb, vb = self.widths
            if isinstance(kb, int) and isinstance(vb, int):
                raise ValueError(
                    f"group={self.group} only applies to fractional widths (e.g. bits=3.5); "
                    f"key and value widths are {kb} and {vb}: leave group unset"
                )
        check_counts(self, "window", "sinks", "seed")
