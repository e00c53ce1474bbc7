"""``XQuantCodes``: KIVI's affine group codes at 1 to 8 bits with XQuant's data-free calibration.

XQuant (arXiv 2510.11236) quantizes like KIVI (keys per channel in groups of ``group``
tokens, values per token in groups of channels), asymmetric: ``z = min``, ``s = (max - min) /
(2**B - 1)``, ``q = round((x - z) / s)``. At one or two bits the min-max grid puts the
reconstruction points on the group's extremes; its *data-free calibration* moves them inward
by a fraction ``eta`` of the range, ``f(e, eta) = eta`` for a normalized value ``e`` in
``[0, 0.5]`` and ``1 - eta`` above at one bit, which integer codes keep by calibrating the
stored zero-point and scale instead of the codes::

    z_hat = z + eta * s * (2**B - 1)        s_hat = (1 - 2 * eta) * s
    x_hat = q * s_hat + z_hat

The codes are those of the min-max grid; only the stored ``(scale, zero)`` change, so every
reader of :class:`velox_core.Uniform`'s layout (``mx.quantized_matmul``, the fused decode
kernels' affine layouts) reads them unchanged. This class is that ``Uniform`` with one-bit
codes allowed and the calibration applied at encode.

Reference path (the CPU, or a layout the kernels decline): per-token codes in MLX's layout
(2 to 6 or 8 bits, groups of 32, 64 or 128) go through ``mx.quantized_matmul``; the others
(one bit, other groups, per-channel keys) are read a tile of :data:`TILE` tokens at a time,
never the whole segment at once.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Packed, Uniform
from velox_core.kernels import encode as _ke
from velox_core.kernels import use_kernels
from velox_core.ops import affine_quantize, pack
from velox_core.validation import check_bits, check_choice, check_float, check_int

__all__ = ["ETA_DEFAULT", "TILE", "XQuantCodes", "XQuantScales", "default_eta"]

# the calibration the reference code offers per width (a grid of three: 0, this, twice this);
# wider codes are not calibrated there (min-max)
ETA_DEFAULT = {1: 1 / 6, 2: 0.045}

TILE = 1024  # tokens the reference path decodes at once (a multiple of every key group used)

AXES = ("token", "channel")


def default_eta(bits: int) -> float:
    """The calibration ``eta`` a width takes when none is given: the middle of the reference
    code's grid at one bit (1/6) and two bits (0.045), none above."""
    return ETA_DEFAULT.get(bits, 0.0)


class XQuantCodes(Uniform):
    """Affine per-group codes with XQuant's calibrated zero-point and scale.

    Args:
        bits: code width, 1 to 8.
        group: group size (channels per group for ``axis="token"``, tokens for
            ``"channel"``).
        axis: ``"token"`` (values: a token's channels in groups) or ``"channel"`` (keys: a
            channel's tokens in groups, ``block = group``).
        eta: the calibration, in ``[0, 0.5)``: the reconstruction points move inward by
            ``eta`` of each group's range (0: the min-max grid).

    Packed layout: ``Uniform``'s (``codes`` uint32, ``scale`` and ``zero`` fp16, bf16 for bf16
    input), the scale and zero calibrated.
    """

    name = "xquant"
    settings = ("bits", "group", "axis", "eta")

    def __init__(self, bits: int = 2, group: int = 128, axis: str = "token", eta: float = 0.0):
        self.bits = check_bits("bits", bits, minimum=1, maximum=8)
        self.group = check_int("group", group, minimum=1)
        self.axis = check_choice("axis", axis, AXES)
        self.eta = check_float("eta", eta, minimum=0.0, maximum=0.5)
        if self.eta >= 0.5:
            raise ValueError(
                f"eta must be below 0.5 (at 0.5 both ends of a group meet at its middle), got {eta}"
            )
        self.clip = 1.0
        self.block = self.group if axis == "channel" else 1
        self._byte_tables = {}

    # -- coding ------------------------------------------------------------------------------
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Shapes: x ``(B, H, T, D)``; ``T`` a multiple of ``group`` for ``axis="channel"``."""
        fused = None
        if self.axis == "token" and use_kernels():
            fused = _ke.affine_encode(x, self.bits, self.group, 1.0)
        if fused is not None:
            words, scale, zero = fused
        else:
            codes, scale, zero = affine_quantize(x, self.bits, self.group, self.axis)
            words = pack(codes, self.bits)
        scale, zero = self.calibrate(scale, zero)
        per_block = frozenset({"scale", "zero"}) if self.axis == "channel" else frozenset()
        data = {"codes": words, "scale": scale, "zero": zero}
        return Packed(data, x.shape[2], self.block, per_block)

    def calibrate(self, scale: mx.array, zero: mx.array) -> tuple[mx.array, mx.array]:
        """The min-max grid's ``(s, z)`` calibrated: ``z + eta s (2**B - 1)``, ``(1 - 2 eta)
        s``, computed in float32 from the stored values and stored in their dtype."""
        if self.eta == 0.0:
            return scale, zero
        s, z = scale.astype(mx.float32), zero.astype(mx.float32)
        levels = (1 << self.bits) - 1
        z_hat = z + self.eta * levels * s
        s_hat = (1.0 - 2.0 * self.eta) * s
        return s_hat.astype(scale.dtype), z_hat.astype(zero.dtype)

    # -- attention from the codes ------------------------------------------------------------
    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ k_hat.T`` from the codes, a tile at a time off MLX's layout.

        Shapes: q ``(B, H, M, D)`` float32; returns ``(B, H, M, T)`` float32.
        """
        if self._mlx_layout():
            return self._matmul(q, packed, transpose=True)
        parts = []
        for _, _, p in packed.tiles(TILE):
            if self.axis == "channel":
                parts.append(Uniform.scores(self, q, p))  # the scales folded into the query
            else:
                parts.append(q @ mx.swapaxes(self.decode(p), -1, -2))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w @ v_hat`` from the codes, a tile at a time off MLX's layout.

        Shapes: w ``(B, H, M, T)`` float32; returns ``(B, H, M, D)`` float32.
        """
        if self._mlx_layout():
            return self._matmul(w, packed, transpose=False)
        out = None
        for a, e, p in packed.tiles(TILE):
            wt = w[..., a:e]
            part = Uniform.mix(self, wt, p) if self.axis == "channel" else wt @ self.decode(p)
            out = part if out is None else out + part
        return out


class XQuantScales(XQuantCodes):
    """The codes of a side a layer pair shares (arguments: see :class:`XQuantCodes`): its
    records hold only the calibrated ``scale`` and ``zero``; the codes go to the pair.

    ``encode`` quantizes as :class:`XQuantCodes` does and keeps the packed codes in
    ``pending`` until the cache hands them to its pair (the pair's lower layer stores them
    once; the higher layer drops its own and reads the lower layer's). A record joined to its
    pair's codes (:meth:`velox_xquant.XQuantCache.segments`) is read as an ``XQuantCodes``
    record: decode, scores, mix and the decode kernels.
    """

    name = "xquant-scales"

    def __init__(self, bits: int = 2, group: int = 128, axis: str = "token", eta: float = 0.0):
        super().__init__(bits, group, axis, eta)
        self.pending: mx.array | None = None  # the last encode's packed codes

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        full = super().encode(x, positions)
        self.pending = full.data["codes"]
        data = {k: a for k, a in full.data.items() if k != "codes"}
        return Packed(data, full.tokens, full.block, full.per_block)

    def decode(self, packed: Packed) -> mx.array:
        if "codes" not in packed.data:
            raise ValueError(
                "xquant: a paired layer's record holds scales only; read it joined to its "
                "pair's codes (XQuantCache.segments)"
            )
        return super().decode(packed)
