"""``TurboQuant``: the velox codec of TurboQuant (arXiv 2504.19874), integer or fractional bits.

An integer width ``b`` codes every head vector with one :class:`SphereQuantizer` (``b`` bits
per channel plus an fp16 norm; ``prod`` adds a 1-bit sketch and a residual norm within the
same ``b`` bits). A fractional width ``b + f`` follows the paper's outlier treatment: the
channels are split into an outlier set of ``f * d`` channels and the rest, and two independent
TurboQuant instances code them at ``b + 1`` and ``b`` bits (each with its own rotation,
codebook and norm). The outlier channels are chosen as QJL (arXiv 2406.03482, the prior work
the paper follows) does: per head and per group of ``group`` tokens, the channels of largest
norm over the group's tokens; the choice is stored as a ``d``-bit mask per group.

The ``rvq`` variant (VeloxQuant-MLX's TurboQuant RVQ, no paper; :mod:`velox_turboquant.residual`)
codes an even integer width ``b`` as two residual stages of ``b / 2`` bits, stored as one
``b``-bit code per channel whose level is the sum of the two stages' levels: decoding and
attention read it as a ``b``-bit codebook, as they read mse codes.

Attention reads the codes: the query is rotated (and sketched, for ``prod``) once per part, or
once per group and part when channels are split; scores are its products with codebook levels
times norms; values are mixed as weighted sums of levels in the rotated domain and rotated
back once per part and group, never rebuilding the keys or values. On a GPU with kernels
enabled, mse segments attend through one fused split-K kernel
(:meth:`TurboQuant.kernel_keys`, :mod:`velox_turboquant.kernels`): integer widths through
velox-core's decode kernels, fractional widths through its outlier kernel (the query
placed and rotated, the values rotated back, per group inside the kernel).

Deviations from the paper: the rotation is a randomized (block-)Hadamard transform instead of
a dense Haar matrix (a Haar matrix where the Hadamard block would be under 16, e.g. a 40-dim
part); ``bits`` is the exact average width (the paper's "32 of 128 channels at 3 bits, the
rest at 2" example is ``bits=2.25``, while 2.5 puts 64 channels at 3 bits); the outlier set is
chosen per group of tokens as in QJL, so fractional widths code tokens ``group`` at a time;
norms are fp16 (bf16 for bf16 models). See docs/turboquant.md.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.ops import pack, scale_dtype, unpack
from velox_core.validation import check_choice, check_int

from . import kernels as _kernels
from .config import DEFAULT_GROUP, VARIANTS, check_rvq_width, check_width, split_width
from .quantizer import SphereQuantizer, derive_seed

__all__ = ["TurboQuant"]


class TurboQuant(Codec):
    """TurboQuant codes of ``(B, H, T, D)`` vectors.

    Args:
        bits: bits per channel: an int 1 to 8, or fractional (e.g. 2.5, 3.5) with
            ``(bits - floor(bits)) * D`` a whole number of outlier channels.
        variant: ``"mse"`` (TurboQuant_mse), ``"prod"`` (TurboQuant_prod, unbiased inner
            products) or ``"rvq"`` (two residual stages of ``bits / 2``: an even integer
            ``bits``).
        group: tokens sharing one outlier-channel choice (fractional widths only; default 64).
        seed: seed of the rotations and sketch matrices.
    """

    name = "turboquant"
    settings = ("bits", "variant", "group", "seed")
    compressed_scores = True
    compressed_mix = True
    # each token decodes from its own norms and codes (fractional widths: each group of
    # ``group`` tokens from its own outlier mask) and the fixed rotations, codebooks and
    # sketches: a block-aligned slice decodes on its own
    decodes_slices = True

    def __init__(
        self,
        bits: int | float = 4,
        variant: str = "mse",
        group: int | None = None,
        seed: int = 0,
    ):
        self.bits = check_width("bits", bits)
        self.variant = check_choice("variant", variant, VARIANTS)
        self.fractional = isinstance(self.bits, float)
        if self.variant == "rvq":
            check_rvq_width("bits", self.bits)
        if group is not None and not self.fractional:
            raise ValueError(
                f"group={group} only applies to fractional widths; bits={self.bits} is an "
                "integer: leave group unset"
            )
        self.group = group
        if self.fractional:
            self.group = check_int("group", DEFAULT_GROUP if group is None else group, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self.block = self.group if self.fractional else 1
        self.dim: int | None = None
        self.parts: list[tuple[str, SphereQuantizer]] = []
        self.outliers = 0

    # -- set-up and state -------------------------------------------------------------------
    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if self.dim is not None and dim != self.dim:
            raise ValueError(f"turboquant: this codec is set up for head dim {self.dim}, got {dim}")
        if dim < 3:
            raise ValueError(f"turboquant: head dim {dim} is too small (at least 3)")
        self._setup(dim)

    def _setup(self, dim: int) -> None:
        if self.dim == dim:
            return
        low, n_out, _ = split_width("bits", self.bits, dim)
        if n_out == 0:
            parts = [("", dim, low, 0)]
        else:
            parts = [("hi.", n_out, low + 1, 1), ("lo.", dim - n_out, low, 2)]
        self.parts = [
            (p, SphereQuantizer(d, b, self.variant, derive_seed(self.seed, i)))
            for p, d, b, i in parts
        ]
        self.dim, self.outliers = dim, n_out

    def kernel_values(self, packed: Packed, dim: int):
        """The decode kernels' value side (GPU): :func:`velox_turboquant.kernels.kernel_values`."""
        return _kernels.kernel_values(self, packed, dim)

    def kernel_keys(self, packed: Packed, q_shape, values):
        """The decode kernels' key side (GPU): :func:`velox_turboquant.kernels.kernel_keys`."""
        return _kernels.kernel_keys(self, packed, q_shape, values)

    def state(self) -> dict[str, mx.array]:
        """Rotations, codebooks and sketch matrices (seeded: regenerated and checked on load)."""
        return {p + k: a for p, q in self.parts for k, a in q.arrays().items()}

    def set_state(self, state: dict[str, mx.array]) -> None:
        if not state:
            return
        dim = 0
        for name, a in state.items():
            if name.endswith(("rot.signs", "rot.matrix")):
                dim += a.shape[0]
        if dim < 3:
            raise ValueError(f"turboquant: state holds no rotation ({sorted(state)})")
        self.dim = None
        self._setup(dim)
        mine = self.state()
        if set(mine) != set(state) or not all(
            mine[k].shape == state[k].shape and mx.array_equal(mine[k], state[k]) for k in mine
        ):
            raise ValueError(
                f"turboquant: saved state does not match {self.describe()} at head dim {dim}"
            )

    # -- coding ------------------------------------------------------------------------------
    def _ready(self, dim: int) -> None:
        if self.dim is None:
            self.check(dim, mx.float32)

    def _order(self, mask: mx.array) -> mx.array:
        """Channel order of each group: its outlier channels first, both sets ascending."""
        d = mask.shape[-1]
        key = (1 - mask.astype(mx.int32)) * d + mx.arange(d, dtype=mx.int32)
        return mx.argsort(key, axis=-1)

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Shapes: x ``(B, H, T, D)`` with ``T % block == 0``."""
        b, h, t, d = x.shape
        self._ready(d)
        nd = scale_dtype(x.dtype)
        x = x.astype(mx.float32)
        if not self.fractional:
            return Packed(self.parts[0][1].encode(x, nd), t)
        g = self.group
        xg = x.reshape(b, h, t // g, g, d)
        energy = mx.sum(xg * xg, axis=3)  # (B, H, G, D) squared channel norms over the group
        top = mx.argsort(-energy, axis=-1)[..., : self.outliers]
        mask = mx.put_along_axis(
            mx.zeros(energy.shape, dtype=mx.uint8), top, mx.array(1, mx.uint8), axis=-1
        )
        xp = mx.take_along_axis(xg, self._order(mask)[:, :, :, None, :], axis=-1)
        xp = xp.reshape(b, h, t, d)
        data = {"mask": pack(mask, 1)}
        (hp, hq), (lp, lq) = self.parts
        data.update({hp + k: a for k, a in hq.encode(xp[..., : self.outliers], nd).items()})
        data.update({lp + k: a for k, a in lq.encode(xp[..., self.outliers :], nd).items()})
        return Packed(data, t, g, frozenset({"mask"}))

    def _part_data(self, packed: Packed, prefix: str, grouped: bool) -> dict[str, mx.array]:
        """The fields of one part, with tokens split into ``(G, group)`` when ``grouped``."""
        out = {}
        for k, a in packed.data.items():
            if k.startswith(prefix) and k != "mask":
                if grouped:
                    b, h, t = a.shape[:3]
                    a = a.reshape(b, h, t // self.group, self.group, *a.shape[3:])
                out[k[len(prefix) :]] = a
        return out

    def _mask_order(self, packed: Packed) -> mx.array:
        """Shapes: returns the channel order ``(B, H, G, D)`` of every group."""
        return self._order(unpack(packed.data["mask"], 1, self.dim))

    def _require_setup(self) -> None:
        if self.dim is None:
            raise ValueError("turboquant: the codec has not seen a head dim (call check first)")

    def decode(self, packed: Packed) -> mx.array:
        """Shapes: returns float32 ``(B, H, T, D)``."""
        self._require_setup()
        if not self.fractional:
            return self.parts[0][1].decode(packed.data)
        order = self._mask_order(packed)  # (B, H, G, D)
        xp = mx.concatenate(
            [q.decode(self._part_data(packed, p, True)) for p, q in self.parts], axis=-1
        )  # (B, H, G, group, D), channels in group order
        inv = mx.argsort(order, axis=-1)[:, :, :, None, :]
        x = mx.take_along_axis(xp, inv, axis=-1)
        b, h, gs, g, d = x.shape
        return x.reshape(b, h, gs * g, d)

    def stored_rotation(self):
        """The rotation of an integer width's one quantizer (fractional widths rotate each
        channel set on its own: None)."""
        if self.fractional or not self.parts:
            return None
        return self.parts[0][1].rotation

    def decode_rotated_as(self, packed: Packed, dtype: mx.Dtype) -> mx.array:
        """Integer widths: the rotated reconstruction ``||x|| * y_hat`` straight in ``dtype``.

        Shapes: returns ``(B, H, T, D)`` in ``dtype``.
        """
        if self.stored_rotation() is None:
            return super().decode_rotated_as(packed, dtype)
        return self.parts[0][1].decode_rotated_as(packed.data, dtype)

    # -- compressed-domain attention ----------------------------------------------------------
    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ k_hat.T`` from the codes. Shapes: q ``(B, H, M, D)``; returns ``(B, H, M, T)``."""
        self._require_setup()
        if not self.fractional:
            quant = self.parts[0][1]
            return quant.scores(*quant.rotate_query(q), packed.data)
        order = self._mask_order(packed)  # (B, H, G, D)
        qp = mx.take_along_axis(q[:, :, None], order[:, :, :, None, :], axis=-1)  # (B,H,G,M,D)
        cuts = {"hi.": (0, self.outliers), "lo.": (self.outliers, self.dim)}
        s = None
        for p, quant in self.parts:
            lo, hi = cuts[p]
            part = quant.scores(
                *quant.rotate_query(qp[..., lo:hi]), self._part_data(packed, p, True)
            )
            s = part if s is None else s + part  # (B, H, G, M, group)
        b, h, gs, m, g = s.shape
        return mx.swapaxes(s, 2, 3).reshape(b, h, m, gs * g)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w @ v_hat`` from the codes. Shapes: w ``(B, H, M, T)``; returns ``(B, H, M, D)``."""
        self._require_setup()
        if not self.fractional:
            quant = self.parts[0][1]
            return quant.rotation.inverse(quant.mix_rotated(w, packed.data))
        b, h, m, t = w.shape
        wg = mx.swapaxes(w.reshape(b, h, m, t // self.group, self.group), 2, 3)  # (B,H,G,M,g)
        outs = [
            q.rotation.inverse(q.mix_rotated(wg, self._part_data(packed, p, True)))
            for p, q in self.parts
        ]
        yp = mx.concatenate(outs, axis=-1)  # (B, H, G, M, D), channels in group order
        inv = mx.argsort(self._mask_order(packed), axis=-1)[:, :, :, None, :]
        return mx.sum(mx.take_along_axis(yp, inv, axis=-1), axis=2)
