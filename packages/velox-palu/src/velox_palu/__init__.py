"""velox-palu: Palu, group-head low-rank latents of keys and values fitted per model by
whitened SVD, keys rebuilt with RoPE inside attention (arXiv 2407.21118)."""

from velox_core import Method

from .artifact import (
    MissingArtifactError,
    PaluBases,
    load_bases,
    resolve_bases,
    save_bases,
)
from .cache import PaluCache
from .codec import PaluKeys, PaluValues
from .config import PaluConfig
from .fit import bases_from_gram, fisher_information, fit_palu, group_gram
from .ranks import allocate

__all__ = [
    "METHOD",
    "MissingArtifactError",
    "PaluBases",
    "PaluCache",
    "PaluConfig",
    "PaluKeys",
    "PaluValues",
    "allocate",
    "bases_from_gram",
    "fisher_information",
    "fit_palu",
    "group_gram",
    "load_bases",
    "resolve_bases",
    "save_bases",
]

METHOD = Method.of(
    PaluCache,
    summary="keys and values as head-group low-rank latents (bases fitted per model, ranks "
    "by Fisher information); keys rebuilt with RoPE inside attention",
    paper="https://arxiv.org/abs/2407.21118",
    codecs=(PaluKeys, PaluValues),
    recommended=({"ratio": 0.5}, {"ratio": 0.5, "bits": 4}),
)
