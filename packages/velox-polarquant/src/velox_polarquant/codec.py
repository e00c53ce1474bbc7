"""``PolarQuant``: the velox codec of PolarQuant (arXiv 2502.02617), for keys and values.

Every vector ``x`` (one token of one KV head) is rotated, ``y = S x`` (:class:`Rotation`),
and turned into polar coordinates by ``levels`` levels of the recursive transform
(:func:`velox_polarquant.polar.to_polar`): ``d / 2^L`` radii, the norms of its blocks of
``2^L`` coordinates, and ``d/2^l`` angles at each level ``l``. The radii are kept in fp16
(bf16 for bf16 models); each angle is replaced by the index of the nearest level of its
level's codebook (:func:`velox_polarquant.codebook.level_codebook`): ``bits`` bits at level 1,
``upper_bits`` at the levels above (the paper: 4 and 2, since level 1's range ``[0, 2 pi)``
is four times the others' ``[0, pi/2]``). No scale, zero point or other statistic is stored:
the laws of the angles are known.

Packed layout (head dim ``d``, ``L`` levels), per token: ``r`` ``(d / 2^L,)`` fp16 radii and,
for each level ``l``, ``a{l}`` uint8 ``(ceil(d / 2^l * b_l / 8),)``: the level's codes as one
little-endian bit stream (code ``i`` in bits ``[i b_l, (i + 1) b_l)``). At the paper's setting
and ``d = 128``: 16 + 32 + 8 + 4 + 2 = 62 bytes a vector, 3.875 bits a coordinate.

Reconstruction (DeQuant): each code's level gives the factors ``cos psi`` and ``sin psi`` of
the two halves of its block; from the radii down, the levels' factors rebuild ``S x_hat``,
and ``x_hat = S^T (S x_hat)``. Attention never rotates the tokens back: scores are the
rotated query against ``S x_hat``, the value mix is rotated back once (``S^T sum_t w_t S
v_t``), and a prefill attends in the rotated domain (:meth:`stored_rotation`). Codes of 1, 2,
4 or 8 bits are read a byte at a time (one gather of ``cos, sin`` pairs a level); 3, 5, 6
and 7 bits are unpacked first. No velox-core kernel layout reads these codes (their levels
multiply along a tree, not per coordinate), so every backend takes this path.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np

from velox_core import Codec, Packed
from velox_core.ops import BYTE_BITS, pack, packed_words, scale_dtype, unpack
from velox_core.validation import check_bits, check_choice, check_int

from .codebook import MAX_LEVELS, byte_cos_sin, level_codebook
from .polar import from_polar, to_polar
from .rotation import ROTATIONS, Rotation

__all__ = ["PolarQuant", "level_widths"]


def level_widths(bits, upper_bits, levels: int, name: str = "bits") -> tuple[int, ...]:
    """The code width of every level: ``bits`` at level 1, ``upper_bits`` (default
    ``bits - 2``) at levels 2 to ``levels``; raises ``ValueError`` naming ``name`` where the
    default leaves the upper levels under 1 bit."""
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


def _byte_count(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


@cache
def _cos_sin_table(level: int, bits: int) -> mx.array:
    """``(2^bits, 2)`` float32: ``cos`` and ``sin`` of each level of the codebook."""
    c = level_codebook(level, bits).centroids.astype(np.float64)
    return mx.array(np.stack([np.cos(c), np.sin(c)], axis=-1).astype(np.float32))


class PolarQuant(Codec):
    """PolarQuant codes of ``(B, H, T, D)`` vectors.

    Args:
        bits: code width of level 1's angles, 1 to 8 (the paper: 4).
        upper_bits: code width of the angles of levels 2 to ``levels``, 1 to 8 (None:
            ``bits - 2``, the paper's 2 at ``bits=4``).
        levels: recursion depth ``L`` (the paper: 4); ``2^L`` must divide the head dim.
        rotation: ``"hadamard"`` (a randomized Hadamard rotation) or ``"haar"`` (a dense
            Haar-random matrix, the paper's).
        seed: seed of the rotation (keys and values of every layer share it, as in the paper).
    """

    name = "polarquant"
    settings = ("bits", "upper_bits", "levels", "rotation", "seed")
    compressed_scores = True
    compressed_mix = True

    def __init__(
        self,
        bits: int = 4,
        upper_bits: int | None = None,
        levels: int = 4,
        rotation: str = "hadamard",
        seed: int = 0,
    ):
        self.widths = level_widths(bits, upper_bits, levels)
        self.bits, self.upper_bits, self.levels = bits, upper_bits, levels
        self.rotation = check_choice("rotation", rotation, ROTATIONS)
        self.seed = check_int("seed", seed, minimum=0)
        self.dim: int | None = None
        self._rot: Rotation | None = None

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

    def state(self) -> dict[str, mx.array]:
        """The rotation's arrays and the levels of each codebook (all fixed by the settings:
        regenerated and compared on load)."""
        if self._rot is None:
            return {}
        out = dict(self._rot.arrays())
        for level, b in enumerate(self.widths, start=1):
            out[f"levels{level}"] = mx.array(level_codebook(level, b).centroids)
        return out

    def set_state(self, state: dict[str, mx.array]) -> None:
        if not state:
            return
        rot = state.get("rot.signs", state.get("rot.matrix"))
        if rot is None:
            raise ValueError(f"polarquant: saved state holds no rotation ({sorted(state)})")
        self._rot = None
        self._ready(rot.shape[0])
        mine = self.state()
        if set(mine) != set(state) or not all(
            mine[k].shape == state[k].shape and mx.array_equal(mine[k], state[k]) for k in mine
        ):
            raise ValueError(f"polarquant: saved state does not match {self.describe()}")

    def stored_rotation(self) -> Rotation | None:
        return self._rot

    # -- coding ------------------------------------------------------------------------------
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Shapes: x ``(B, H, T, D)``."""
        t, d = x.shape[2], x.shape[3]
        angles, radii = to_polar(self._ready(d).forward(x), self.levels)
        data = {"r": radii.astype(scale_dtype(x.dtype))}
        for level, (psi, b) in enumerate(zip(angles, self.widths), start=1):
            codes = level_codebook(level, b).encode(psi)
            words = pack(codes, b)  # (B, H, T, ceil(n b / 32)) uint32, little-endian stream
            data[f"a{level}"] = mx.view(words, mx.uint8)[..., : _byte_count(psi.shape[-1], b)]
        return Packed(data, t)

    def _cos_sin(self, packed: Packed, level: int) -> mx.array:
        """The ``cos, sin`` factors of one level's angles, interleaved: ``(B, H, T, 2 n)``."""
        a, b = packed.data[f"a{level}"], self.widths[level - 1]
        n = self.dim >> level
        if b in BYTE_BITS:  # each byte holds 8 / b whole codes: one gather
            cs = mx.take(byte_cos_sin(level, b), a, axis=0)  # (B, H, T, bytes, 16 / b)
            cs = cs.reshape(*a.shape[:-1], -1)
            return cs if cs.shape[-1] == 2 * n else cs[..., : 2 * n]
        pad = 4 * packed_words(n, b) - a.shape[-1]
        if pad:
            a = mx.concatenate([a, mx.zeros((*a.shape[:-1], pad), dtype=mx.uint8)], axis=-1)
        codes = unpack(mx.view(a, mx.uint32), b, n).astype(mx.int32)
        return mx.take(_cos_sin_table(level, b), codes, axis=0).reshape(*a.shape[:-1], 2 * n)

    def _require_setup(self) -> None:
        if self.dim is None:
            raise ValueError("polarquant: the codec has not seen a head dim (call check first)")

    def decode_rotated(self, packed: Packed) -> mx.array:
        """``S x_hat``: float32 ``(B, H, T, D)``."""
        self._require_setup()
        cs = [self._cos_sin(packed, level) for level in range(1, self.levels + 1)]
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
