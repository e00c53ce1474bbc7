"""velox-oscar: OSCAR, keys and values rotated into attention-aware bases fitted once per
model, clipped token-wise and coded in INT2 groups, with exact sinks and a recent window
(arXiv 2605.17757)."""

from velox_core import Method

from .artifact import (
    MissingArtifactError,
    OscarRotations,
    load_rotations,
    resolve_rotations,
    save_rotations,
)
from .cache import OscarCache
from .codec import OscarKeys, OscarValues
from .config import OscarConfig
from .fit import CLIPS, clip_error, fit_oscar, gram_by_head
from .rotation import (
    Rotation,
    bit_reversal,
    br_permutation,
    hadamard_matrix,
    oscar_rotation,
    quantile_clip,
)

__all__ = [
    "CLIPS",
    "METHOD",
    "MissingArtifactError",
    "OscarCache",
    "OscarConfig",
    "OscarKeys",
    "OscarRotations",
    "OscarValues",
    "Rotation",
    "bit_reversal",
    "br_permutation",
    "clip_error",
    "fit_oscar",
    "gram_by_head",
    "hadamard_matrix",
    "load_rotations",
    "oscar_rotation",
    "quantile_clip",
    "resolve_rotations",
    "save_rotations",
]

METHOD = Method.of(
    OscarCache,
    summary="keys and values rotated by per-model fitted bases (query and score-weighted value "
    "covariance eigenvectors, Hadamard, bit-reversal), clipped token-wise, INT2 per token; "
    "exact sinks and recent window",
    paper="https://arxiv.org/abs/2605.17757",
    codecs=(OscarKeys, OscarValues),
    recommended=({"bits": 2},),
)
