"""Settings of the PolarQuant cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import check_choice, check_counts, check_int, check_widths

from .codebook import MAX_LEVELS
from .codec import check_codebook, level_widths
from .rotation import ROTATIONS


@dataclass
class PolarQuantConfig(CodeWidths):
    """PolarQuant (arXiv 2502.02617) settings, with the shared parameter names.

    The bit widths are those of the angles: ``bits`` codes level 1 (pairs of coordinates,
    angles in ``[0, 2 pi)``), ``upper_bits`` the levels above (angles in ``[0, pi/2]``). With
    the paper's ``bits=4`` (so ``upper_bits=2``) and ``levels=4`` a vector of ``d``
    coordinates takes ``d/2 * 4 + (d/4 + d/8 + d/16) * 2`` bits of codes and ``d/16`` fp16
    radii: 3.875 bits a coordinate.

    Attributes:
        bits: level 1's code width for keys and values, 1 to 8 (the paper: 4).
        key_bits, value_bits: either side alone (default ``bits``).
        upper_bits: code width of levels 2 to ``levels``, 1 to 8, both sides (None: each
            side's level-1 width minus 2, which must leave at least 1).
        levels: recursion depth ``L``, 1 to 12 (the paper: 4); ``2^L`` must divide the head
            dims; each vector keeps ``d / 2^L`` radii.
        rotation: ``"hadamard"`` (a randomized Hadamard rotation: ``d`` signs a codec),
            ``"haar"`` (the paper's dense random rotation matrix: ``d^2`` float32 a codec) or
            None (no preconditioning, the paper's "PolarQuant" against "PolarQuant-R":
            ``codebook="online"`` only; ``rotation=none`` in a spec).
        codebook: ``"offline"`` (each level's codebook solved once for its angle law, shared
            by every sequence, layer and head) or ``"online"`` (1-D k-means++ on each
            sequence's angles, per level, side and layer, on the first tokens coded).
        window: most recent tokens kept in fp16 (0 in the paper).
        sinks: first tokens kept in fp16 (0 in the paper).
        seed: seed of the rotation, shared by keys and values of every layer (as the paper's
            ``S``).
    """

    bits: int = 4
    upper_bits: int | None = None
    levels: int = 4
    rotation: str | None = "hadamard"
    codebook: str = "offline"
    window: int = 0
    sinks: int = 0
    seed: int = 0

    def __post_init__(self):
        check_widths(self, minimum=1, bits_required=True)
        check_int("levels", self.levels, minimum=1, maximum=MAX_LEVELS)
        for name in ("bits", "key_bits", "value_bits"):
            if getattr(self, name) is not None:  # the upper levels' width each side leaves
                level_widths(getattr(self, name), self.upper_bits, self.levels, name)
        check_choice("rotation", self.rotation, ROTATIONS)
        check_codebook(self.codebook, self.rotation)
        check_counts(self, "window", "sinks", "seed")

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Vectors are cut into blocks of ``2^levels`` coordinates: that must divide both head
        dims."""
        block = 1 << self.levels
        for side, dim in (("key", key_dim), ("value", value_dim)):
            if dim % block:
                raise ValueError(
                    f"polarquant: levels={self.levels} cuts vectors into blocks of {block} "
                    f"coordinates, which does not divide the {side} head dim {dim}; choose "
                    f"levels with 2^levels dividing {dim}"
                )
