"""``KVQuantKeys``: per-channel, pre-RoPE keys, nuq datatype, dense-and-sparse outliers.

KVQuant (arXiv 2401.18079) quantizes keys per channel, because key caches have outlier
channels, and before RoPE, because RoPE mixes pairs of channels with position-dependent
angles. Keys reach the cache post-RoPE, so each block is first un-rotated at its absolute
positions (kept per token, int32, in the record) and the decoded keys are re-rotated there.

Per-channel scaling factors and outlier thresholds are calibrated once, as the paper does
offline, here on the first tokens the codec encodes, as in the authors' code for a capped
number of outliers per token: the ``outliers / 2`` and ``1 - outliers / 2`` quantiles over
tokens of every (head, channel) give first thresholds; each calibration token's ``k`` entries
most extreme under them are its outliers; the dense range of each channel is the min and max
of what remains (so no calibration entry is clipped), stored as fp16 ``zero`` (midpoint) and
``range`` (half width). With these fixed scales keys are coded one token at a time
(``block = 1``). Of each key vector, the ``k = round(outliers * D)`` entries whose dense code
would be furthest off in model units (``range * |u - level(u)|``, with ``u`` clipped into
``[-1, 1]`` first, so clipped entries come first) are kept exactly as fp16 outliers; every
other entry is coded with the layer's nuq datatype, fitted on the calibration entries inside
the range, each weighted by ``range**2``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import Packed
from velox_core.codec.prerope import PreRope
from velox_core.ops import pack, scale_dtype
from velox_core.validation import check_bool

from .base import NuqCodec
from .nuq import dequantize, outlier_count

__all__ = ["KVQuantKeys"]

_MIN_RANGE = 1e-4


class KVQuantKeys(PreRope, NuqCodec):
    """KVQuant's key codec.

    Args:
        bits, outliers, datatype, qnorm: see :class:`~velox_kvquant.base.NuqCodec`.
        pre_rope: quantize keys before RoPE (the paper); False quantizes the post-RoPE keys
            per channel (the paper's ablation baseline).
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone codec
            (:class:`~velox_core.codec.prerope.PreRope`).

    Packed layout per token: ``codes`` uint32 ``(ceil(D*bits/32),)``, ``sparse_val`` fp16
    ``(k,)``, ``sparse_idx`` uint8 ``(k,)``, and (pre-RoPE) ``pos`` int32 stored once per token
    for all heads, ``(B, 1, T)``.
    """

    name = "kvquant-key"
    rope_method = "kvquant"
    rope_optional = True
    _batch_state = ("levels", "bounds", "zero", "range")

    def __init__(
        self,
        bits: int = 4,
        outliers: float = 0.01,
        datatype: str = "nuq",
        qnorm: bool = False,
        pre_rope: bool = True,
        rope_base: float | None = None,
        rope_traditional: bool = False,
        rope_scale: float = 1.0,
        rope_dims: int | None = None,
    ):
        super().__init__(bits, outliers, datatype, qnorm)
        self.pre_rope = check_bool("pre_rope", pre_rope)
        self.init_rope(rope_base, rope_traditional, rope_scale, rope_dims)

    def config(self) -> dict[str, Any]:
        return {**super().config(), **self.rope_config()}

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Read the RoPE of ``model.layers[layer]`` (pre-RoPE codecs only)."""
        if model is not None and layer is not None:
            self.bind_rope(model, layer)

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        super().check(dim, dtype)
        if self.pre_rope:
            self.rope_for(dim)

    # -- state: the fit, and the RoPE once known (so copies and files need no model) ----------
    def state(self) -> dict[str, mx.array]:
        return {**super().state(), **self.rope_state()}

    def set_state(self, state: dict[str, mx.array]) -> None:
        super().set_state(self.pop_rope_state(state))

    # -- coding ------------------------------------------------------------------------------
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        b, _, t, _ = x.shape
        xf = x.astype(mx.float32)
        extra = {}
        if self.pre_rope:
            pos = self.key_positions(positions, b, t)
            xf = self.unrotate(xf, pos)
            extra = {"pos": pos}
        if not self.fitted:
            self._calibrate(xf, x.dtype)
        zero = self._fit["zero"].astype(mx.float32)[:, :, None]
        rng = self._fit["range"].astype(mx.float32)[:, :, None]
        u = (xf - zero) / rng
        codes = self._codes(u)
        # outliers: the entries whose dense code is furthest off, in model units
        err = mx.abs(u - dequantize(codes, self._fit["levels"])) * rng
        sparse = self._sparse(xf, err, x.dtype)
        return Packed({"codes": pack(codes, self.bits), **sparse, **extra}, t)

    def decode(self, packed: Packed) -> mx.array:
        zero = self._fit["zero"].astype(mx.float32)[:, :, None]
        rng = self._fit["range"].astype(mx.float32)[:, :, None]
        x = self._unsparse(self._undense(packed.data["codes"]) * rng + zero, packed)
        if self.pre_rope:
            x = self.rerotate(x, packed.data["pos"])
        return x

    def _calibrate(self, xf: mx.array, dtype: mx.Dtype) -> None:
        """Per-(row, head, channel) thresholds from quantiles over tokens, then the datatype."""
        a = np.array(xf)  # (B, H, T, D)
        q = self.outliers / 2
        lo, hi = np.quantile(a, [q, 1 - q], axis=2)  # (B, H, D) each
        k = outlier_count(self.outliers, a.shape[-1])
        if k:
            # the reference's capped variant: each token's k most extreme entries under these
            # thresholds are its outliers; the dense range is what remains (nothing clipped)
            mid, half = (hi + lo) / 2, np.maximum((hi - lo) / 2, _MIN_RANGE)
            u = np.abs(a - mid[:, :, None]) / half[:, :, None]
            out = np.zeros(a.shape, dtype=bool)
            np.put_along_axis(out, np.argpartition(-u, k - 1, axis=-1)[..., :k], True, -1)
            lo = np.where(out, np.inf, a).min(axis=2)
            hi = np.where(out, -np.inf, a).max(axis=2)
            lo, hi = np.where(np.isfinite(lo), lo, mid), np.where(np.isfinite(hi), hi, mid)
        sdt = scale_dtype(dtype)
        zero = mx.array(((hi + lo) / 2).astype(np.float32)).astype(sdt)
        rng = mx.array(np.maximum((hi - lo) / 2, _MIN_RANGE).astype(np.float32)).astype(sdt)
        self._fit = {"zero": zero, "range": rng}
        r32 = rng.astype(mx.float32)[:, :, None]
        u = (xf - zero.astype(mx.float32)[:, :, None]) / r32
        self._fit_levels(u, mx.abs(u) <= 1.0, r32 * r32)
