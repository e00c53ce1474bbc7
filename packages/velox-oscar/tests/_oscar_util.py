"""Shared helpers of the OSCAR tests: an artifact fitted on the conformance model."""

from __future__ import annotations

from pathlib import Path

from velox_oscar import fit_oscar, save_rotations
from velox_testing import fitted_artifact, scratch_dir

_TMP = scratch_dir("velox-oscar-tests-")


def model_artifact() -> str:
    """Rotations and clips fitted on :func:`conformance_model` (1,024 random tokens)."""
    return fitted_artifact(fit_oscar, save_rotations, _TMP, seq_len=512, samples=512)


def tmp(name: str) -> Path:
    return _TMP / name
