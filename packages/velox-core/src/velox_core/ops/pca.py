"""Principal axes of symmetric matrices, as the fitting methods take them (float64 NumPy)."""

from __future__ import annotations

import numpy as np

__all__: list[str] = []


def principal_axes(sym: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eigenvalues of symmetric matrices, largest first (rounding's negatives set to 0),
    and their eigenvectors as columns in that order, each signed so that its entry of largest
    magnitude is positive (a fit gives the same basis on every run); ``sym`` is symmetrized
    first.

    Shapes: sym ``(..., n, n)``; returns float64 ``(..., n)`` and ``(..., n, n)``.
    """
    a = np.asarray(sym, dtype=np.float64)
    lam, vec = np.linalg.eigh((a + np.swapaxes(a, -1, -2)) / 2)  # ascending
    lam, vec = lam[..., ::-1], vec[..., ::-1]
    lead = np.take_along_axis(vec, np.argmax(np.abs(vec), axis=-2)[..., None, :], axis=-2)
    return np.maximum(lam, 0.0), vec * np.where(lead < 0, -1.0, 1.0)


def pca(total: np.ndarray, outer: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """The mean of ``n`` rows whose sum is ``total`` and whose sum of outer products is
    ``outer``, and the :func:`principal_axes` of their covariance.

    Shapes: total ``(..., D)``, outer ``(..., D, D)``; returns the mean ``(..., D)``, the
    eigenvalues ``(..., D)`` and the eigenvectors ``(..., D, D)``, float64.
    """
    mean = total / n
    return (mean, *principal_axes(outer / n - mean[..., :, None] * mean[..., None, :]))
