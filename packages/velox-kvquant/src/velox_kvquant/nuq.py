"""KVQuant's datatypes: levels in ``[-1, 1]`` fitted to normalized activations, and the
per-vector outlier split of dense-and-sparse quantization.

``nuqX`` (arXiv 2401.18079, "nuqX: an X-bit per-layer sensitivity-weighted non-uniform
datatype") is derived per layer by k-means over normalized calibration values (normalized
into ``[-1, 1]`` by each vector's range, outliers removed), each value weighted by its
sensitivity (the paper: the diagonal Fisher information, minimizing ``sum F (A - Q(A))**2``).
In one dimension k-means is Lloyd's algorithm on the empirical distribution; it is run here on
a fine weighted histogram of the values (``2**14`` bins over ``[-1, 1]``) with
:func:`velox_core.ops.lloyd_max`, which makes the fit independent of the number of
calibration values. Q-Norm (the paper's 2-bit refinement, ``--norm`` in the authors' code)
optionally shifts and scales the decoded levels so that the quantized values keep the mean and
standard deviation of the data; values are still assigned by the unshifted levels' midpoints,
as in the reference.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from velox_core.ops import lloyd_max

__all__ = ["DATATYPES", "dequantize", "fit_levels", "outlier_count", "quantize"]

DATATYPES = ("nuq", "uniform")
_BINS = 1 << 14


def outlier_count(fraction: float, dim: int) -> int:
    """Outliers kept per vector: ``round(fraction * dim)``, at least 1 when ``fraction > 0``."""
    return 0 if fraction == 0 else max(1, round(fraction * dim))


def fit_levels(
    u: np.ndarray, w: np.ndarray, bits: int, datatype: str = "nuq", qnorm: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Fit a ``bits``-bit datatype to normalized values.

    Args:
        u: normalized values in ``[-1, 1]`` (outliers already removed), any shape.
        w: nonnegative sensitivity weights, same shape as ``u``.
        bits: code width.
        datatype: ``"nuq"`` (weighted k-means levels) or ``"uniform"`` (evenly spaced levels on
            ``[-1, 1]``, the paper's ``intX`` baseline on the same normalization).
        qnorm: apply Q-Norm to the decoded levels.

    Returns:
        ``(levels, bounds)``: float32 ``(2**bits,)`` ascending decode levels and
        ``(2**bits - 1,)`` assignment thresholds.
    """
    n = 1 << bits
    u = np.clip(np.asarray(u, dtype=np.float64).ravel(), -1.0, 1.0)
    w = np.asarray(w, dtype=np.float64).ravel()
    hist, edges = np.histogram(u, bins=_BINS, range=(-1.0, 1.0), weights=w)
    grid = (edges[:-1] + edges[1:]) / 2
    if datatype == "uniform" or not hist.sum() > 0:
        levels = np.linspace(-1.0, 1.0, n)
    else:
        levels = lloyd_max(grid, hist, bits, iters=300).centroids.astype(np.float64)
        levels = np.maximum.accumulate(levels)  # Lloyd keeps the order; guard ties anyway
    bounds = (levels[1:] + levels[:-1]) / 2
    if qnorm and hist.sum() > 0:
        p = hist / hist.sum()
        q = levels[np.searchsorted(bounds, grid)]
        m1, m2 = p @ grid, p @ q
        s1, s2 = np.sqrt(p @ (grid - m1) ** 2), np.sqrt(p @ (q - m2) ** 2)
        if s2 > 0:
            levels = (levels - m2) * (s1 / s2) + m1
    return levels.astype(np.float32), bounds.astype(np.float32)


def quantize(u: mx.array, bounds: mx.array) -> mx.array:
    """Codes of the nearest level, by a binary search over the thresholds of each batch row.

    Shapes:
        u ``(B, ...)`` float32 normalized values; bounds ``(B, 2**bits - 1)`` ascending;
        returns uint8 codes of ``u``'s shape.
    """
    b = u.shape[0]
    bits = (bounds.shape[-1] + 1).bit_length() - 1
    flat = u.reshape(b, -1)
    idx = mx.zeros(flat.shape, dtype=mx.int32)
    for k in reversed(range(bits)):
        cand = idx + (1 << k)
        thr = mx.take_along_axis(bounds, cand - 1, axis=1)
        idx = mx.where(flat > thr, cand, idx)
    return idx.astype(mx.uint8).reshape(u.shape)


def dequantize(codes: mx.array, levels: mx.array) -> mx.array:
    """Levels of the codes, per batch row.

    Shapes:
        codes ``(B, ...)`` integers; levels ``(B, 2**bits)``; returns float32 of codes' shape.
    """
    flat = codes.reshape(codes.shape[0], -1).astype(mx.int32)
    return mx.take_along_axis(levels.astype(mx.float32), flat, axis=1).reshape(codes.shape)
