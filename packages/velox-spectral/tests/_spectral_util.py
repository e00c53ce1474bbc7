"""Shared helpers of the spectral tests: artifacts for the conformance model."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from velox_core.artifacts import fingerprint, fitted
from velox_spectral import SpectralBases, fit_spectral, int8_columns, pca, save_bases
from velox_testing import conformance_model, fitted_artifact, kv_like, scratch_dir

_TMP = scratch_dir("velox-spectral-tests-")


def calibration() -> np.ndarray:
    """1,024 random token ids (two sequences of 512)."""
    return np.random.default_rng(0).integers(0, 512, 1024)


def model_artifact() -> str:
    """Bases fitted on :func:`conformance_model` by :func:`fit_spectral` (on
    :func:`calibration`'s tokens)."""
    return fitted_artifact(fit_spectral, save_bases, _TMP, seq_len=512)


@lru_cache(maxsize=1)
def law_artifact() -> str:
    """Bases of the law of ``kv_data()``'s tokens (keys: :func:`velox_testing.kv_like`'s fresh
    tokens of that law; values: standard normal), under :func:`conformance_model`'s
    fingerprint: the conformance suite's attention checks code ``kv_data`` with bases
    calibrated on its law, as a model's caches code its tokens with bases fitted on its own."""
    model = conformance_model()
    layers = {}
    for i in range(2):
        sides = {}
        for side in ("key", "value"):
            if side == "key":
                x = np.asarray(kv_like(4096, noise_seed=100 + i)[0], dtype=np.float64)
            else:
                x = np.random.default_rng(200 + i).normal(size=(2, 4096, 128))
            mean, lam, vec = pca(x.sum(1), np.swapaxes(x, -1, -2) @ x, x.shape[1])
            codes, scale = int8_columns(vec)
            sides[side] = {
                "basis": mx.array(codes),
                "basis_scale": mx.array(scale),
                "mean": mx.array(mean.astype(np.float32)),
                "eigenvalues": mx.array(lam.astype(np.float32)),
            }
        layers[i] = sides
    art = SpectralBases(layers, **fitted(model, "token ids", "kv_data's law", tokens=4096))
    assert art.fingerprint == fingerprint(model)
    return str(save_bases(art, _TMP / "law.safetensors"))


def tmp(name: str) -> Path:
    return _TMP / name
