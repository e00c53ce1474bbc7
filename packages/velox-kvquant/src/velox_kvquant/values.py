"""``KVQuantValues``: per-token values, nuq datatype, per-token dense-and-sparse outliers.

KVQuant quantizes values per token (value caches have no outlier channels) with its
non-uniform datatype and online, per-token outlier thresholds (arXiv 2401.18079,
"Per-Vector Dense-and-Sparse Quantization" and "Offline Calibration versus Online
Computation"). For each token vector:

1. the ``k = round(outliers * D)`` entries farthest from the vector's median are the outliers,
   kept exactly (fp16 value and channel index); this is the per-token threshold rule;
2. the others are normalized into ``[-1, 1]`` by the vector's own range
   (``zero = (max + min) / 2``, ``scale = (max - min) / 2``, both fp16);
3. each normalized entry becomes the code of its nearest level of the layer's datatype.

The datatype (levels) is fitted on the first tokens the codec encodes, weighting each
normalized entry by ``scale**2`` (its error in model units is ``scale`` times its error in
normalized units), and is kept as codec state.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Packed
from velox_core.ops import scale_dtype

from .base import NuqCodec

__all__ = ["KVQuantValues"]

_EPS = 1e-6


class KVQuantValues(NuqCodec):
    """KVQuant's value codec. Parameters: see :class:`~velox_kvquant.base.NuqCodec`.

    Packed layout: ``codes`` uint32 ``(B, H, T, ceil(D*bits/32))``, ``zero`` and ``scale``
    fp16 ``(B, H, T)``, ``sparse_val`` fp16 ``(B, H, T, k)`` and ``sparse_idx`` uint8
    ``(B, H, T, k)`` (bf16 scales and outliers for bf16 models, uint16 indices for D > 256).
    """

    name = "kvquant-value"

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        xf = x.astype(mx.float32)
        d = xf.shape[-1]
        srt = mx.sort(xf, axis=-1)
        med = (srt[..., (d - 1) // 2 : (d - 1) // 2 + 1] + srt[..., d // 2 : d // 2 + 1]) / 2
        sparse = self._sparse(xf, mx.abs(xf - med), x.dtype)
        dense, keep = xf, mx.ones(xf.shape, dtype=mx.bool_)
        if sparse:
            idx = sparse["sparse_idx"].astype(mx.int32)
            fill = mx.broadcast_to(med, idx.shape)
            dense = mx.put_along_axis(xf, idx, fill, axis=-1)  # outliers out of the range
            keep = mx.put_along_axis(keep, idx, mx.zeros(idx.shape, dtype=mx.bool_), axis=-1)
        hi, lo = mx.max(dense, axis=-1), mx.min(dense, axis=-1)
        sdt = scale_dtype(x.dtype)
        zero = ((hi + lo) / 2).astype(sdt)
        scale = mx.maximum((hi - lo) / 2, _EPS).astype(sdt)
        s32 = scale.astype(mx.float32)[..., None]
        u = (dense - zero.astype(mx.float32)[..., None]) / s32
        if not self.fitted:
            self._fit_levels(u, keep, s32 * s32)
        data = {"codes": self._dense(u), "zero": zero, "scale": scale, **sparse}
        return Packed(data, x.shape[2])

    def decode(self, packed: Packed) -> mx.array:
        p = packed.data
        u = self._undense(p["codes"])
        x = u * p["scale"].astype(mx.float32)[..., None] + p["zero"].astype(mx.float32)[..., None]
        return self._unsparse(x, packed)
