"""``RaBitQ``: keys as RaBitQ codes with the unbiased inner-product estimator.

RaBitQ (arXiv 2405.12497) and extended RaBitQ (arXiv 2409.09913) store a vector ``k`` relative
to a centroid ``c``: the residual ``r = k - c`` is normalized, ``o = r / ||r||``, rotated by a
seeded random rotation (``o' = P^-1 o`` in the papers' notation; :mod:`velox_rabitq.rotation`),
and coded as the grid point ``y`` of ``B`` bits per coordinate nearest in angle
(:mod:`velox_rabitq.quantizer`). The quantized vector is ``o_bar = P y / ||y||``. Per token the
record keeps the rescale factor ``Delta = ||r|| / ||y||`` (the norm ``||r|| = Delta ||y||`` with
``||y||`` a function of the codes, :meth:`RaBitQ.norms`) and the correction factor
``<o_bar, o>``; per block of ``centroid`` tokens it keeps ``c`` (their mean).

A score comes from the estimator of Theorem 3.2 (2405.12497; the same for extended codes):
``<o, q> ~ <o_bar, q> / <o_bar, o>``, unbiased, so that

    <q, k> ~ <q, c> + ||r|| <P^-1 q, y> / (||y|| <o_bar, o>)
           = <q, c> + Delta <P^-1 q, y> / <o_bar, o>

with the query rotated once per call. The error of the residual term exceeds
``||r|| ||q|| sqrt(1 - <o_bar, o>^2) / <o_bar, o> * eps0 / sqrt(D - 1)`` with probability at
most ``2 exp(-c0 eps0^2)`` (Equation 14, :meth:`RaBitQ.bound`).

:meth:`RaBitQ.decode` returns ``c + Delta P y / <o_bar, o>``, the key whose inner products
are the estimator's, so the prefill path (decoded keys, fused SDPA) and the decode path
(:meth:`RaBitQ.scores`) attend the same scores.

On a GPU with kernels enabled, decode steps attend through velox-core's fused decode kernels,
which read the codes as affine codes of one group a token (:mod:`velox_rabitq.kernels`).
"""

from __future__ import annotations

import math

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.ops import mlx_readable, pack, scale_dtype, unpack
from velox_core.validation import check_bits, check_float, check_int

from . import kernels as _kernels
from .quantizer import grid, quantize
from .rotation import Rotation, check_dim

__all__ = ["EPS0", "RaBitQ"]

EPS0 = 1.9  # the paper's confidence parameter of the error bound (Section 3.2.2)


class RaBitQ(Codec):
    """RaBitQ key codec (1-bit codes; extended codes for 2 to 8 bits).

    Args:
        bits: bits per coordinate (1: RaBitQ's sign code; 2 to 8: extended RaBitQ).
        centroid: tokens per centroid block (the mean of the block's keys, stored per batch
            row and head); 0 uses the zero centroid and codes every token alone.
        rounds: rounds of the randomized Hadamard rotation (:mod:`velox_rabitq.rotation`).
        seed: seed of the rotation.

    Record fields, with tokens on axis 2: ``codes`` ``(B, H, T, ceil(D bits / 32))`` uint32
    (velox-core's bit packing), ``delta`` (``||r|| / ||y||``) and ``ip`` (``<o_bar, o>``)
    ``(B, H, T)`` in the keys' scale dtype (fp16, bf16 for bf16 keys), and with
    ``centroid > 0`` ``centroid`` ``(B, H, T / centroid, D)`` in the same dtype.
    """

    name = "rabitq"
    settings = ("bits", "centroid", "rounds", "seed")
    compressed_scores = True

    def __init__(self, bits: int = 4, centroid: int = 128, rounds: int = 2, seed: int = 0):
        self.bits = check_bits("bits", bits, 1, 8)
        self.centroid = check_int("centroid", centroid, minimum=0)
        self.rounds = check_int("rounds", rounds, minimum=1, maximum=8)
        self.seed = check_int("seed", seed, minimum=0)
        self.block = max(1, self.centroid)
        self.dim: int | None = None
        self.rotation: Rotation | None = None

    # -- set-up and state ------------------------------------------------------------------
    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if self.dim is not None:
            if dim != self.dim:
                raise ValueError(f"rabitq: codec set up for head dim {self.dim}, got {dim}")
            return
        check_dim(dim)
        self.dim, self.rotation = dim, Rotation(dim, self.seed, self.rounds)

    def _ready(self, dim: int) -> None:
        if self.dim is None:
            self.check(dim, mx.float32)
        elif dim != self.dim:
            raise ValueError(f"rabitq: codec set up for head dim {self.dim}, got {dim}")

    def state(self) -> dict[str, mx.array]:
        """The rotation's signs (and permutations): seeded, regenerated and checked on load."""
        return {} if self.rotation is None else self.rotation.arrays()

    def set_state(self, state: dict[str, mx.array]) -> None:
        if not state:
            return
        if "rot0.signs" not in state:
            raise ValueError(f"rabitq: expected the rotation in the state, got {sorted(state)}")
        self.dim, self.rotation = None, None
        self.check(state["rot0.signs"].shape[0], mx.float32)
        mine = self.state()
        if set(mine) != set(state) or not all(
            mine[k].shape == state[k].shape and mx.array_equal(mine[k], state[k]).item()
            for k in mine
        ):
            raise ValueError("rabitq: the saved rotation does not match the one of this seed")

    # -- coding ------------------------------------------------------------------------------
    def _centroids(self, x: mx.array, dt: mx.Dtype) -> mx.array | None:
        """Shapes: x ``(B, H, T, D)`` float32; returns ``(B, H, T / centroid, D)`` in ``dt``."""
        if not self.centroid:
            return None
        b, h, t, d = x.shape
        return mx.mean(x.reshape(b, h, t // self.centroid, self.centroid, d), axis=3).astype(dt)

    def _per_token(self, c: mx.array) -> mx.array:
        """Each block's centroid repeated over its tokens. Shapes: returns ``(B, H, T, D)``."""
        return mx.repeat(c.astype(mx.float32), self.centroid, axis=2)

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Shapes: x ``(B, H, T, D)`` with ``T % block == 0``."""
        d = x.shape[-1]
        self._ready(d)
        dt = scale_dtype(x.dtype)
        xf = x.astype(mx.float32)
        c = self._centroids(xf, dt)
        r = xf if c is None else xf - self._per_token(c)
        codes, ip = quantize(self.rotation.forward(r), self.bits)
        delta = mx.linalg.norm(r, axis=-1) / self._grid_norm(grid(codes, self.bits))
        data = {"codes": pack(codes, self.bits), "delta": delta.astype(dt), "ip": ip.astype(dt)}
        if c is None:
            return Packed(data, x.shape[2])
        data["centroid"] = c
        return Packed(data, x.shape[2], self.block, frozenset({"centroid"}))

    def _grid_norm(self, y: mx.array) -> mx.array:
        """``||y||``. Shapes: y ``(..., D)``; returns ``(...)`` (a scalar for 1 bit)."""
        if self.bits == 1:
            return mx.array(math.sqrt(self.dim) / 2)
        return mx.sqrt(mx.sum(y * y, axis=-1))

    def _grid(self, packed: Packed) -> mx.array:
        """The grid points ``y``. Shapes: returns float32 ``(B, H, T, D)``."""
        return grid(unpack(packed.data["codes"], self.bits, self.dim), self.bits)

    def _factor(self, packed: Packed) -> mx.array:
        """``Delta / <o_bar, o> = ||r|| / (||y|| <o_bar, o>)``. Shapes: returns ``(B, H, T)``."""
        p = packed.data
        return p["delta"].astype(mx.float32) / p["ip"].astype(mx.float32)

    def norms(self, packed: Packed) -> mx.array:
        """``||r|| = Delta ||y||``, each key's distance to its centroid, from the record.

        Shapes: returns float32 ``(B, H, T)``.
        """
        self._require()
        return packed.data["delta"].astype(mx.float32) * self._grid_norm(self._grid(packed))

    def decode(self, packed: Packed) -> mx.array:
        """``c + ||r|| o_bar / <o_bar, o>``. Shapes: returns float32 ``(B, H, T, D)``."""
        self._require()
        k = self.rotation.inverse(self._grid(packed) * self._factor(packed)[..., None])
        if "centroid" in packed.data:
            k = k + self._per_token(packed.data["centroid"])
        return k

    def _inner(self, q_rot: mx.array, packed: Packed) -> mx.array:
        """``<P^-1 q, y>`` for every query and token: straight from the packed words through
        ``mx.quantized_matmul`` (scale 1, bias ``-(2^B - 1)/2``) where they are in MLX's
        layout, else from the unpacked grid points.

        Shapes: q_rot ``(B, H, M, D)`` float32; returns float32 ``(B, H, M, T)``.
        """
        group = next((g for g in (128, 64, 32) if self.dim % g == 0), 0)
        if not mlx_readable(self.bits, group):
            return q_rot @ mx.swapaxes(self._grid(packed), -1, -2)
        words = packed.data["codes"]
        shape = (*words.shape[:3], self.dim // group)
        return mx.quantized_matmul(
            q_rot,
            words,
            mx.ones(shape, dtype=mx.float32),
            mx.full(shape, -((1 << self.bits) - 1) / 2, dtype=mx.float32),
            transpose=True,
            group_size=group,
            bits=self.bits,
        )

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """The estimator ``<q, c> + Delta <P^-1 q, y> / <o_bar, o>`` from the codes, the query
        rotated once.

        Shapes:
            q ``(B, H, M, D)`` float32 (scale applied); returns float32 ``(B, H, M, T)``.
        """
        self._require()
        q = q.astype(mx.float32)
        out = self._inner(self.rotation.forward(q), packed) * self._factor(packed)[:, :, None, :]
        if "centroid" in packed.data:
            qc = q @ mx.swapaxes(packed.data["centroid"].astype(mx.float32), -1, -2)
            out = out + mx.repeat(qc, self.centroid, axis=-1)
        return out

    def kernel_keys(self, packed: Packed, q_shape, values):
        """The decode kernels' key side (GPU): :func:`velox_rabitq.kernels.kernel_keys`."""
        return _kernels.kernel_keys(self, packed, q_shape, values)

    def bound(self, q: mx.array, packed: Packed, eps0: float = EPS0) -> mx.array:
        """The half-width of the estimator's confidence interval for each score (Equation 16
        of arXiv 2405.12497, scaled by ``||r|| ||q||``): the error exceeds it with
        probability at most ``2 exp(-c0 eps0^2)`` over the rotation.

        Shapes:
            q ``(B, H, M, D)``; returns float32 ``(B, H, M, T)``.
        """
        eps0 = check_float("eps0", eps0, minimum=0.0)
        ip = packed.data["ip"].astype(mx.float32)
        per_key = self.norms(packed) * mx.sqrt(1 - ip * ip) / ip
        qn = mx.linalg.norm(q.astype(mx.float32), axis=-1, keepdims=True)
        return qn * per_key[:, :, None, :] * (eps0 / math.sqrt(self.dim - 1))

    def _require(self) -> None:
        if self.dim is None:
            raise ValueError("rabitq: the codec has not seen a head dim (call check first)")
