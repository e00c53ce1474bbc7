"""Settings of the spectral cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.validation import check_bits, check_counts, check_float, check_optional, check_path

__all__ = ["SpectralConfig"]


@dataclass
class SpectralConfig:
    """Spectral (calibrated PCA) quantizer settings, with the shared parameter names.

    Attributes:
        signal_bits: code width of the leading ``rank`` PCA components of keys and values
            (Gaussian Lloyd-Max levels, 1 to 8).
        noise_bits: code width of the other components (0 to ``signal_bits``; 0 drops them:
            decoded as the mean's).
        rank: the components coded at ``signal_bits``, on both sides and in every layer; None:
            chosen per layer and side by ``variance``.
        variance: the fraction of a head's variance the leading ``rank`` components must hold
            (per layer and side, the largest rank its KV heads need, raised while the codes
            take no more uint32 words); None with ``rank`` None:
            :data:`~velox_spectral.codec.DEFAULT_VARIANCE`. Give ``rank`` or ``variance``.
        window: most recent tokens kept exact.
        sinks: first tokens kept exact (the fit leaves the first tokens of each calibration
            sequence out as well).
        artifact: path of the spectral artifact (None: the model's, found when the cache is
            bound, :func:`~velox_spectral.artifact.resolve_bases`).
        layer: the model layer whose bases to use; ``velox_core.make_cache`` sets it.
    """

    signal_bits: int = 5
    noise_bits: int = 3
    rank: int | None = None
    variance: float | None = None
    window: int = 0
    sinks: int = 16
    artifact: str | None = None
    layer: int | None = None

    def __post_init__(self):
        check_bits("signal_bits", self.signal_bits, 1, 8)
        check_bits("noise_bits", self.noise_bits, 0, 8)
        if self.noise_bits > self.signal_bits:
            raise ValueError(
                f"noise_bits={self.noise_bits} must not exceed signal_bits={self.signal_bits} "
                "(the noise components carry the least variance)"
            )
        if self.rank is not None and self.variance is not None:
            raise ValueError(
                f"give rank or variance, not both (rank={self.rank!r}, variance={self.variance!r})"
            )
        check_optional(self, "rank")
        if self.variance is not None:
            self.variance = check_float(
                "variance", self.variance, minimum=0.0, maximum=1.0, open_min=True
            )
        check_counts(self, "window", "sinks")
        self.artifact = check_path("artifact", self.artifact)
        check_optional(self, "layer", minimum=0)
