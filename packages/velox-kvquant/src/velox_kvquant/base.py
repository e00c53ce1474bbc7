"""What the key and value codecs of KVQuant share: the fitted datatype, and the sparse outliers.

Both codecs store each vector as dense ``bits``-bit codes of a per-layer datatype (levels in
``[-1, 1]``, fitted on the first tokens the codec encodes) plus ``k`` outliers kept exactly as
(fp16 value, channel index) pairs. The datatype is fitted separately for every sequence of a
batch (one set of levels per batch row), so that a batched cache holds exactly what its
single-sequence caches would; :meth:`filter_batch` and :meth:`extend_batch` keep the fitted
arrays aligned with the batch rows of the stored tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from velox_core import Codec, Packed
from velox_core.ops import pack, scale_dtype, unpack
from velox_core.validation import check_bits, check_bool, check_choice, check_float

from .nuq import DATATYPES, dequantize, fit_levels, outlier_count, quantize

__all__ = ["NuqCodec"]


class NuqCodec(Codec):
    """Dense ``nuq`` codes plus per-vector sparse outliers (abstract: keys and values differ in
    how vectors are normalized and how outliers are chosen).

    Args:
        bits: code width of the dense part, 2 to 8.
        outliers: fraction of each vector kept exactly (``round(outliers * D)`` entries, at
            least one when positive); 0 turns dense-and-sparse off.
        datatype: ``"nuq"`` (fitted levels) or ``"uniform"`` (evenly spaced levels).
        qnorm: apply Q-Norm to the fitted levels.
    """

    # fitted arrays with a leading batch axis (sliced by filter_batch, joined by extend_batch)
    _batch_state: tuple[str, ...] = ("levels", "bounds")
    settings = ("bits", "outliers", "datatype", "qnorm")

    def __init__(
        self, bits: int = 4, outliers: float = 0.01, datatype: str = "nuq", qnorm: bool = False
    ):
        self.bits = check_bits("bits", bits, minimum=2, maximum=8)
        self.outliers = check_float("outliers", outliers, minimum=0.0, maximum=0.5)
        self.datatype = check_choice("datatype", datatype, DATATYPES)
        self.qnorm = check_bool("qnorm", qnorm)
        self._fit: dict[str, mx.array] = {}

    @property
    def fitted(self) -> bool:
        return bool(self._fit)

    # -- fitted state ------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        return dict(self._fit)

    def set_state(self, state: dict[str, mx.array]) -> None:
        if not state:
            self._fit = {}
            return
        need = set(self._state_names())
        if set(state) != need:
            raise ValueError(f"{self.name}: state must hold {sorted(need)}, got {sorted(state)}")
        self._fit = dict(state)

    def _state_names(self) -> tuple[str, ...]:
        return (*self._batch_state, "dim")

    @property
    def dim(self) -> int:
        """The head dim the codec was fitted on."""
        return int(self._fit["dim"].item())

    def filter_batch(self, index: mx.array) -> None:
        """Keep the fitted arrays of the given batch rows."""
        for k in self._batch_state:
            if k in self._fit:
                self._fit[k] = self._fit[k][index]

    def extend_batch(self, other: NuqCodec) -> None:
        """Append the fitted arrays of ``other``'s batch rows."""
        if self.fitted != other.fitted:
            raise ValueError(
                f"{self.name}: cannot join a fitted codec with an unfitted one; feed both "
                "caches past their calibration tokens first"
            )
        for k in self._batch_state:
            if k in self._fit:
                self._fit[k] = mx.concatenate([self._fit[k], other._fit[k]], axis=0)

    def _fit_levels(self, u: mx.array, keep: mx.array, weight: mx.array) -> None:
        """Fit one datatype per batch row from normalized values ``u`` where ``keep``.

        Shapes:
            u, keep, weight: ``(B, ...)`` broadcast together.
        """
        u = np.array(u.astype(mx.float32))
        keep = np.broadcast_to(np.array(keep), u.shape)
        weight = np.broadcast_to(np.array(weight.astype(mx.float32)), u.shape)
        levels, bounds = [], []
        for b in range(u.shape[0]):
            m = keep[b]
            lv, bd = fit_levels(u[b][m], weight[b][m], self.bits, self.datatype, self.qnorm)
            levels.append(lv)
            bounds.append(bd)
        self._fit["levels"] = mx.array(np.stack(levels))
        self._fit["bounds"] = mx.array(np.stack(bounds))
        self._fit["dim"] = mx.array([u.shape[-1]], dtype=mx.int32)

    # -- dense and sparse parts ----------------------------------------------------------------
    def _codes(self, u: mx.array) -> mx.array:
        """uint8 codes of the nearest levels to normalized values (clipped into ``[-1, 1]``)."""
        return quantize(mx.clip(u, -1.0, 1.0), self._fit["bounds"])

    def _dense(self, u: mx.array) -> mx.array:
        """Packed codes of normalized values."""
        return pack(self._codes(u), self.bits)

    def _undense(self, words: mx.array) -> mx.array:
        return dequantize(unpack(words, self.bits, self.dim), self._fit["levels"])

    def _sparse(self, x: mx.array, score: mx.array, dtype: mx.Dtype) -> dict[str, mx.array]:
        """The ``k`` entries of each vector with the largest ``score``, kept exactly.

        Shapes:
            x, score ``(B, H, T, D)``; returns ``sparse_val`` ``(B, H, T, k)`` in the 16-bit
            scale dtype of the input and ``sparse_idx`` ``(B, H, T, k)`` uint8/uint16.
        """
        d = x.shape[-1]
        k = outlier_count(self.outliers, d)
        if k == 0:
            return {}
        idx = mx.argpartition(-score, kth=k - 1, axis=-1)[..., :k]
        val = mx.take_along_axis(x, idx, axis=-1).astype(scale_dtype(dtype))
        return {"sparse_val": val, "sparse_idx": idx.astype(_index_dtype(d))}

    @staticmethod
    def _unsparse(x: mx.array, packed: Packed) -> mx.array:
        p = packed.data
        if "sparse_val" not in p:
            return x
        idx = p["sparse_idx"].astype(mx.int32)
        return mx.put_along_axis(x, idx, p["sparse_val"].astype(mx.float32), axis=-1)

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if self.fitted and dim != self.dim:
            raise ValueError(f"{self.name}: fitted on head dim {self.dim}, got {dim}")
        if dim > 65535:
            raise ValueError(f"{self.name}: head dim {dim} is over 65535 (uint16 indices)")


def _index_dtype(dim: int) -> mx.Dtype:
    return mx.uint8 if dim <= 256 else mx.uint16
