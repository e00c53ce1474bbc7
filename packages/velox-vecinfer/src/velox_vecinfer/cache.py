"""``VecInferCache``: VecInfer's vector-quantized keys (smooth + Hadamard) and values.

Keys are smoothed per channel, Hadamard-transformed and vector-quantized; values are
vector-quantized as they are (VecInfer, arXiv 2510.06175). Deviations from the paper:

* **Calibration on the sequence, not offline.** The paper fits the smoothing scales and trains
  "task-independent" codebooks offline on calibration data. A cache has none, so the first
  ``calibration`` tokens after the sinks wait in fp16; once they are all there both codecs fit
  on exactly those tokens (scales, then k-means on every sub-vector of them), code them, and
  code every later token with that fit.
* **Codebooks per layer, KV head and sequence**: one codebook per (layer, KV head, batch row)
  for keys and one for values, shared by all sub-vector positions of the head. A batched cache
  therefore holds exactly what its single-sequence caches would, and ``merge`` / ``extract`` /
  ``filter`` / ``extend`` keep the fitted rows aligned with the stored tokens.
* **Smoothing scale floor**: ``lambda`` is floored at ``1e-3`` of the head's largest channel
  maximum (and ``1e-6``), see :mod:`velox_vecinfer.codec`.
* **Block Hadamard** for head dims that are not powers of two (blocks of the largest power of
  two dividing the head dim).
* ``sinks`` and ``window`` (fp16 first and recent tokens) are not in the paper; both 0 by
  default.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from velox_core.cache.preset import CalibratedPreset
from velox_core.validation import check_kv

from .codec import VecInfer
from .config import VecInferConfig

__all__ = ["VecInferCache"]


class VecInferCache(CalibratedPreset):
    """VecInfer's cache for one layer. Parameters: see :class:`VecInferConfig`."""

    method = "vecinfer"
    # calibration decides in the window when coding starts: tokens leave it one at a time
    default_flush = 1
    Config = VecInferConfig

    def build(self, cfg: VecInferConfig) -> dict[str, Any]:
        (kb, kv), (vb, vv) = cfg.sides()
        return {
            "key_codec": VecInfer(kb, kv, cfg.smooth, cfg.hadamard, cfg.iters, cfg.seed),
            "value_codec": VecInfer(vb, vv, False, False, cfg.iters, cfg.seed),
        }

    def calibrate(self, tokens: int) -> None:
        """Both codecs fit on exactly the first ``calibration`` tokens (however long the chunk
        that completed them)."""
        t = self.tiers[0]
        t.key_codec.fit(self.stored.window[0].view().slice(0, tokens).data["x"])
        t.value_codec.fit(self.stored.window[1].view().slice(0, tokens).data["x"])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """As :meth:`VeloxCache.update_and_fetch`; the first call also checks that
        ``calibration`` tokens give each codebook enough sub-vectors at these head dims."""
        if self.stored.dims is None:
            check_kv(keys, values)
            self._check_calibration(keys.shape[-1], values.shape[-1], keys.dtype)
        return super().update_and_fetch(keys, values)

    def _check_calibration(self, dk: int, dv: int, dtype: mx.Dtype) -> None:
        t = self.tiers[0]
        for side, codec, dim in (("key", t.key_codec, dk), ("value", t.value_codec, dv)):
            codec.check(dim, dtype)
            subs = dim // codec.vector
            if self.cfg.calibration * subs < codec.size:
                raise ValueError(
                    f"vecinfer: calibration={self.cfg.calibration} tokens give "
                    f"{self.cfg.calibration * subs} {side} sub-vectors per head (head dim {dim} / "
                    f"vector {codec.vector}), fewer than the {codec.size} codewords of the "
                    f"{side} codebook ({codec.index_bits} index bits); raise calibration to at "
                    f"least {math.ceil(codec.size / subs)} or lower {side}_bits / vector"
                )
