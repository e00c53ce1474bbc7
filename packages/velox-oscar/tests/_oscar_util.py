"""Shared helpers of the OSCAR tests: an artifact fitted on the conformance model."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from velox_oscar import fit_oscar, save_rotations
from velox_testing import conformance_model, scratch_dir

_TMP = scratch_dir("velox-oscar-tests-")


@lru_cache(maxsize=1)
def model_artifact() -> str:
    """Rotations and clips fitted on :func:`conformance_model` (1,024 random tokens)."""
    ids = np.random.default_rng(0).integers(0, 512, 1024)
    art = fit_oscar(conformance_model(), ids, seq_len=512, samples=512)
    return str(save_rotations(art, _TMP / "model.safetensors"))


def tmp(name: str) -> Path:
    return _TMP / name
