"""``PolarQuant``: the velox codec of PolarQuant (arXiv 2502.02617), for keys and values.

Every vector ``x`` (one token of one KV head) is rotated, ``y = S x`` (:class:`Rotation`),
and turned into polar coordinates by ``levels`` levels of the recursive transform
(:func:`velox_polarquant.polar.to_polar`): ``d / 2^L`` radii, the norms of its blocks of
``2^L`` coordinates, and ``d/2^l`` angles at each level ``l``. The radii are kept in fp16
(bf16 for bf16 models); each angle is replaced by the index of the nearest level of its
level's codebook: ``bits`` bits at level 1, ``upper_bits`` at the levels above (the paper: 4
and 2, since level 1's range ``[0, 2 pi)`` is four times the others' ``[0, pi/2]``). No
scale, zero point or other statistic is stored for the tokens.

The codebooks are the paper's two constructions: ``"offline"``, one codebook a level for
every sequence, layer and head, here the exact optimum of the paper's Eq. 4 for the level's
angle law (:func:`velox_polarquant.codebook.level_codebook`); or ``"online"``, fitted by 1-D
k-means++ on each sequence's own angles (a codebook a level, side, layer and sequence: the
paper fits "for each individual input prompt and layer"), here on the first tokens the codec
codes (a prefill's first chunk) and kept for the rest of the sequence.

Packed layout (head dim ``d``, ``L`` levels), per token: ``r`` ``(d / 2^L,)`` fp16 radii and,
for each level ``l``, ``a{l}`` uint8 ``(ceil(d / 2^l * b_l / 8),)``: the level's codes as one
little-endian bit stream. At the paper's setting and ``d = 128``: 16 + 32 + 8 + 4 + 2 = 62
bytes a vector, 3.875 bits a coordinate.

Reconstruction (DeQuant): each code's level gives the factors ``cos psi`` and ``sin psi`` of
the two halves of its block; from the radii down, the levels' factors rebuild ``S x_hat``,
and ``x_hat = S^T (S x_hat)``. Attention never rotates the tokens back: scores are the
rotated query against ``S x_hat``, the value mix is rotated back once (``S^T sum_t w_t S
v_t``), and a prefill attends in the rotated domain (:meth:`stored_rotation`). No velox-core
kernel layout reads these codes (their levels multiply along a tree, not per coordinate),
so every backend takes this path.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.ops import scale_dtype
from velox_core.validation import check_bits, check_choice, check_int

from .books import LevelBook, fit_levels, law_book
from .codebook import MAX_LEVELS, level_codebook
from .polar import from_polar, to_polar
from .rotation import ROTATIONS, Rotation

__all__ = ["CODEBOOKS", "PolarQuant", "level_widths"]

CODEBOOKS = ("offline", "online")


def level_widths(bits, upper_bits, levels: int, name: str = "bits") -> tuple[int, ...]:
    """The code width of every level: ``bits`` at level 1, ``upper_bits`` (default
    ``bits - 2``) at levels 2 to ``levels``; raises ``ValueError`` naming ``name`` where the
    default leaves the upper levels under 1 bit, or ``upper_bits`` has no level to code."""
    check_bits(name, bits)
    check_int("levels", levels, minimum=1, maximum=MAX_LEVELS)
    if levels == 1:
        if upper_bits is not None:
            raise ValueError(
                f"upper_bits={upper_bits} codes levels 2 and up, but levels=1 has only level 1: "
                "leave upper_bits unset or take levels >= 2"
            )
        return (bits,)
    if upper_bits is None:
        if bits < 3:
            raise ValueError(
                f"{name}={bits} leaves {name} - 2 = {bits - 2} bits for the angles of levels 2 "
                f"to {levels}; give upper_bits (1 to 8) or {name} >= 3"
            )
        upper_bits = bits - 2
    check_bits("upper_bits", upper_bits)
    return (bits, *([upper_bits] * (levels - 1)))


def check_codebook(codebook: str, rotation: str | None) -> str:
    """``codebook`` is one of :data:`CODEBOOKS`; without a rotation only ``"online"`` fits."""
    check_choice("codebook", codebook, CODEBOOKS)
    if rotation is None and codebook != "online":
        raise ValueError(
            "rotation=None leaves the angles without a known law, which the offline codebooks "
            "are built for: take codebook='online' (fitted on the angles) or a rotation "
            "('hadamard' or 'haar')"
        )
    return codebook


class PolarQuant(Codec):
    """PolarQuant codes of ``(B, H, T, D)`` vectors.

    Args:
        bits: code width of level 1's angles, 1 to 8 (the paper: 4).
        upper_bits: code width of the angles of levels 2 to ``levels``, 1 to 8 (None:
            ``bits - 2``, the paper's 2 at ``bits=4``).
        levels: recursion depth ``L`` (the paper: 4); ``2^L`` must divide the head dim.
        rotation: ``"hadamard"`` (a randomized Hadamard rotation), ``"haar"`` (a dense
            Haar-random matrix, the paper's) or None (no rotation: online codebooks only).
        codebook: ``"offline"`` (the angle laws' codebooks) or ``"online"`` (fitted per
            sequence on its first coded tokens).
        seed: seed of the rotation (keys and values of every layer share it, as in the paper)
            and of the online fits.
    """

    name = "polarquant"
    settings = ("bits", "upper_bits", "levels", "rotation", "codebook", "seed")
    compressed_scores = True
    compressed_mix = True

    def __init__(
        self,
        bits: int = 4,
        upper_bits: int | None = None,
        levels: int = 4,
        rotation: str | None = "hadamard",
        codebook: str = "offline",
        seed: int = 0,
    ):
        self.widths = level_widths(bits, upper_bits, levels)
        self.bits, self.upper_bits, self.levels = bits, upper_bits, levels
        self.rotation = check_choice("rotation", rotation, ROTATIONS)
        self.codebook = check_codebook(codebook, rotation)
        self.seed = check_int("seed", seed, minimum=0)
        self.dim: int | None = None
        self._rot: Rotation | None = None
        self._fit: list[mx.array] = []  # online: each level's levels, (B, 2^b) a row each
        self._books: list[LevelBook] = []

    # -- set-up and state -------------------------------------------------------------------
    def check(self, dim: int, dtype: mx.Dtype) -> None:
        blocks = 1 << self.levels
        if dim % blocks:
            raise ValueError(
                f"levels={self.levels} splits vectors into blocks of 2^{self.levels} = {blocks} "
                f"coordinates, which does not divide the head dim {dim}; choose levels with "
                f"2^levels dividing {dim}"
            )
        self._ready(dim)

    def _ready(self, dim: int) -> Rotation:
        if self._rot is None or self.dim != dim:
            self._rot, self.dim = Rotation(dim, self.rotation, self.seed), dim
        return self._rot

    @property
    def online(self) -> bool:
        return self.codebook == "online"

    @property
    def fitted(self) -> bool:
        """Whether the codebooks exist (always for offline ones)."""
        return not self.online or bool(self._fit)

    def _set_fit(self, fit: list[mx.array]) -> None:
        self._fit = fit
        self._books = [LevelBook(f, b) for f, b in zip(fit, self.widths)]

    def books(self) -> list[LevelBook]:
        """Each level's codebook."""
        if self.online:
            return self._books
        return [law_book(level, b) for level, b in enumerate(self.widths, start=1)]

    def state(self) -> dict[str, mx.array]:
        """The rotation's arrays and each level's codebook levels: the laws' (fixed by the
        settings: regenerated and compared on load) or the fitted ones, a row a sequence."""
        if self._rot is None:
            return {}
        out = dict(self._rot.arrays())
        if self.rotation is None:  # the head dim, which no rotation array tells
            out["dim"] = mx.array([self.dim], dtype=mx.int32)
        if self.online:
            out.update({f"fit{level}": f for level, f in enumerate(self._fit, start=1)})
        else:
            for level, b in enumerate(self.widths, start=1):
                out[f"levels{level}"] = mx.array(level_codebook(level, b).centroids)
        return out

    def set_state(self, state: dict[str, mx.array]) -> None:
        if not state:
            return
        rot = state.get("rot.signs", state.get("rot.matrix"))
        dim = state["dim"].item() if "dim" in state else None
        if rot is None and dim is None:
            raise ValueError(f"polarquant: saved state holds no rotation ({sorted(state)})")
        self._rot = None
        self._ready(rot.shape[0] if rot is not None else dim)
        fit = [state.get(f"fit{level}") for level in range(1, self.levels + 1)]
        if self.online and all(f is not None for f in fit):
            if any(f.ndim != 2 or f.shape[1] != 1 << b for f, b in zip(fit, self.widths)):
                raise ValueError(f"polarquant: saved codebooks do not match {self.describe()}")
            self._set_fit(fit)
        mine = self.state()
        if set(mine) != set(state) or not all(
            mine[k].shape == state[k].shape and mx.array_equal(mine[k], state[k]) for k in mine
        ):
            raise ValueError(f"polarquant: saved state does not match {self.describe()}")

    def filter_batch(self, index: mx.array) -> None:
        """Keep the online codebooks of the given batch rows."""
        if self._fit:
            self._set_fit([f[index] for f in self._fit])

    def extend_batch(self, other: PolarQuant) -> None:
        """Append ``other``'s online codebooks (both fitted, or neither)."""
        if self.fitted != other.fitted:
            raise ValueError(
                "polarquant: cannot join a cache whose online codebooks are fitted with one "
                "whose are not; feed both past their first coded tokens"
            )
        if self._fit:
            self._set_fit([mx.concatenate([a, b]) for a, b in zip(self._fit, other._fit)])

    def stored_rotation(self) -> Rotation | None:
        return None if self.rotation is None else self._rot

    # -- coding ------------------------------------------------------------------------------
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Shapes: x ``(B, H, T, D)``; an online codec fits its codebooks on its first call."""
        t, d = x.shape[2], x.shape[3]
        angles, radii = to_polar(self._ready(d).forward(x), self.levels)
        if not self.fitted:
            self._set_fit([fit_levels(a, b, self.seed) for a, b in zip(angles, self.widths)])
        data = {"r": radii.astype(scale_dtype(x.dtype))}
        for level, (psi, book) in enumerate(zip(angles, self.books()), start=1):
            data[f"a{level}"] = book.encode(psi)
        return Packed(data, t)

    def _require_setup(self) -> None:
        if self.dim is None or not self.fitted:
            raise ValueError("polarquant: the codec has not coded anything yet")

    def decode_rotated(self, packed: Packed) -> mx.array:
        """``S x_hat``: float32 ``(B, H, T, D)``."""
        self._require_setup()
        cs = [
            book.cos_sin(packed.data[f"a{level}"], self.dim >> level)
            for level, book in enumerate(self.books(), start=1)
        ]
        return from_polar(packed.data["r"], cs)

    def decode(self, packed: Packed) -> mx.array:
        return self._rot.inverse(self.decode_rotated(packed))

    def decode_rotated_as(self, packed: Packed, dtype: mx.Dtype) -> mx.array:
        return self.decode_rotated(packed).astype(dtype)

    # -- attention -----------------------------------------------------------------------------
    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ x_hat.T`` as ``(S q) @ (S x_hat).T``. Shapes: q ``(B, H, M, D)``; returns
        ``(B, H, M, T)``."""
        y = self.decode_rotated(packed)
        return self._rot.forward(q) @ mx.swapaxes(y, -1, -2)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w @ x_hat`` as ``S^T (w @ S x_hat)``. Shapes: w ``(B, H, M, T)``; returns
        ``(B, H, M, D)``."""
        return self._rot.inverse(w @ self.decode_rotated(packed))
