"""velox-spectral: a calibrated PCA (spectral) quantizer. Keys and values are projected on
per-model, per-KV-head PCA bases; the leading components are coded by a Lloyd-Max codebook at
``signal_bits`` and the rest by one at ``noise_bits``, with exact sinks and a recent window;
attention reads the codes in the PCA domain."""

from velox_core import Method

from .artifact import (
    MissingArtifactError,
    SpectralBases,
    int8_columns,
    load_bases,
    resolve_bases,
    save_bases,
)
from .cache import SpectralCache
from .codec import DEFAULT_VARIANCE, SpectralKeys, SpectralValues, rank_for_variance
from .config import SpectralConfig
from .fit import fit_spectral, pca

__all__ = [
    "DEFAULT_VARIANCE",
    "METHOD",
    "MissingArtifactError",
    "SpectralBases",
    "SpectralCache",
    "SpectralConfig",
    "SpectralKeys",
    "SpectralValues",
    "fit_spectral",
    "int8_columns",
    "load_bases",
    "pca",
    "rank_for_variance",
    "resolve_bases",
    "save_bases",
]

METHOD = Method.of(
    SpectralCache,
    summary="keys and values projected on per-model, per-head PCA bases; leading components "
    "by a Lloyd-Max codebook at signal_bits, the rest at noise_bits; exact sinks and window",
    paper=None,
    codecs=(SpectralKeys, SpectralValues),
    recommended=({},),
)
