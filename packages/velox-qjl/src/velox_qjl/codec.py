"""``QJL``: keys as 1-bit Johnson-Lindenstrauss sign sketches (arXiv 2406.03482).

A key ``k`` is stored as ``sign(S k)`` (``m`` bits, packed) and ``||k||``; the query is
projected, never quantized, and ``<q, k>`` is estimated by
``c / m * ||k|| * <S q, sign(S k)>`` (:func:`velox_qjl.projection.sketch_inner`), unbiased with
variance ``O(1/m)`` (Lemmas 3.2 and 3.5).

Outliers (Section 4.1): in each block of ``group`` tokens the ``outliers`` channels of largest
energy are found (per batch row and head, as the authors' code does for every group of the
prompt and of the generated tokens), their indices are stored, and the key is split into its
inlier part (outlier channels zeroed) and outlier part. Each part gets its own sign sketch and
norm: ``m`` bits for the inliers, ``m_o = outlier_bits * outliers`` bits for the outliers (a
lower compression rate, as the paper asks). Both parts use rows of the same seeded ``S``, as
the authors' code does; because the two parts live on disjoint channels, the two sketches are
exactly independent for Gaussian ``S`` (the paper's "two independent copies").

Decoding returns ``k_hat = c/m ||k_in|| P_in S^T sign(S k_in) + c/m_o ||k_o|| P_o S^T sign(...)``
(``P`` the channel masks): unbiased for ``k``, and ``<q, k_hat>`` equals the compressed score
exactly, so the fused prefill path and the decode path compute the same attention.

Deviations (see :mod:`velox_qjl.cache` and docs/qjl.md): per-block outlier detection and one
shared projection (both as the authors' code), the exact constant for orthogonalized rows, and
the projection kept (and counted) in float16.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.ops import pack, scale_dtype, sign_sketch, unpack
from velox_core.validation import check_bits, check_int

from . import kernels as _kernels
from .layout import sketch_matrix
from .projection import (
    estimator_constant,
    index_bits,
    outlier_mask,
    projection,
    sketch_inner,
    top_channels,
)
from .sketch_mma import sketch_mma_matrix

__all__ = ["QJL"]

_SQRT_HALF_PI = estimator_constant(1, orthogonal=False)
# most (batch x head x token) rows one encode call takes: MLX 0.32.4's CUDA backend refuses
# the launch of one call over 8 x 8 x 131,072 tokens (an invalid argument), 2^20 rows run
ENCODE_ROWS = 1 << 20


class QJL(Codec):
    """QJL key codec.

    Args:
        bits: sign bits per key channel of the main sketch (``m = bits * head_dim``).
        sketch: ``m`` itself (overrides ``bits``).
        outliers: outlier channels per block (0: none; None: ``head_dim // 16``, 8 at 128).
        outlier_bits: sign bits per outlier channel (``m_o = outlier_bits * outliers``).
        group: tokens per outlier block (the codec's ``block`` when ``outliers != 0``).
        orthogonal: orthogonalize the rows of ``S`` (Section 4.1).
        seed: seed of ``S``.
    """

    name = "qjl"
    settings = ("bits", "sketch", "outliers", "outlier_bits", "group", "orthogonal", "seed")
    compressed_scores = True

    def __init__(
        self,
        bits: int = 2,
        sketch: int | None = None,
        outliers: int | None = None,
        outlier_bits: int = 32,
        group: int = 32,
        orthogonal: bool = True,
        seed: int = 0,
    ):
        self.bits = check_bits("bits", bits, 1, 8)
        self.sketch = None if sketch is None else check_int("sketch", sketch, minimum=1)
        self.outliers = None if outliers is None else check_int("outliers", outliers, minimum=0)
        self.outlier_bits = check_int("outlier_bits", outlier_bits, minimum=1)
        self.group = check_int("group", group, minimum=1)
        if not isinstance(orthogonal, bool):
            raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
        self.orthogonal = orthogonal
        self.seed = check_int("seed", seed, minimum=0)
        self.block = 1 if outliers == 0 else self.group
        self.dim: int | None = None
        self.proj: mx.array | None = None
        self._kernel_mats: dict[int, mx.array] = {}

    # -- sizes and state -----------------------------------------------------------------
    def sizes(self, dim: int) -> tuple[int, int, int]:
        """``(m, outliers, m_o)`` for head dim ``dim``."""
        m = self.sketch if self.sketch is not None else self.bits * dim
        k = max(1, dim // 16) if self.outliers is None else self.outliers
        return m, k, self.outlier_bits * k

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        self._ensure(dim)

    def _validate(self, dim: int) -> None:
        _, k, _ = self.sizes(dim)
        if k >= dim:
            raise ValueError(f"qjl: outliers={k} must be below the head dim {dim}")
        if k and index_bits(dim) > 8:
            raise ValueError(
                f"qjl: outlier channel indices are packed in at most 8 bits, so head dims above "
                f"256 need outliers=0 (got head dim {dim})"
            )

    def _ensure(self, dim: int) -> None:
        if self.dim is not None:
            if dim != self.dim:
                raise ValueError(f"qjl: codec built for head dim {self.dim}, got {dim}")
            return
        self._validate(dim)
        m, _, mo = self.sizes(dim)
        self.dim, self.proj = dim, projection(dim, max(m, mo), self.seed, self.orthogonal)

    def state(self) -> dict[str, mx.array]:
        """The projection ``S`` (float16, resident): seeded, regenerated and checked on load."""
        return {} if self.proj is None else {"proj": self.proj}

    @property
    def state_nbytes(self) -> int:
        """The projection's bytes, and those of its copy for the decode kernel once made."""
        extra = sum(a.nbytes for a in self._kernel_mats.values())
        return super().state_nbytes + extra

    def kernel_keys(self, packed: Packed, q_shape, values):
        """The decode kernels' key side (GPU): :func:`velox_qjl.kernels.kernel_keys`."""
        return _kernels.kernel_keys(self, packed, q_shape, values)

    def kernel_matrix(self, lanes: int) -> mx.array:
        """``S`` as the decode kernel reads it for ``lanes`` lanes a token
        (:func:`velox_qjl.layout.sketch_matrix`, float16), or, with ``lanes`` 0, as the
        tensor-core sketch kernel reads it (:func:`velox_qjl.sketch_mma.sketch_mma_matrix`);
        made once and kept (resident, counted in :attr:`state_nbytes`)."""
        mat = self._kernel_mats.get(lanes)
        if mat is None:
            m, k, mo = self.sizes(self.dim)
            if lanes == 0:
                mat = sketch_mma_matrix(self.proj, m, mo if k else 0)
            else:
                mat = sketch_matrix(self.proj, m, mo if k else 0, lanes)
            mx.eval(mat)
            self._kernel_mats = {lanes: mat}  # one layout at a time
        return mat

    def set_state(self, state: dict[str, mx.array]) -> None:
        if not state:
            return
        if set(state) != {"proj"}:
            raise ValueError(f"qjl: expected state {{'proj'}}, got {sorted(state)}")
        dim = state["proj"].shape[-1]
        self.dim, self.proj, self._kernel_mats = None, None, {}
        self._ensure(dim)
        if not mx.array_equal(self.proj, state["proj"]):
            raise ValueError("qjl: the saved projection does not match the one of this seed")

    # -- coding --------------------------------------------------------------------------
    def _const(self) -> float:
        return estimator_constant(self.dim, self.orthogonal)

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Sketches, norms and (per block) outlier channels of ``x``; long inputs are coded in
        chunks of whole blocks of at most :data:`ENCODE_ROWS` (batch x head x token) rows,
        the same record as one call (a cache's chunked prefill never reaches the limit)."""
        b, h, t = x.shape[:3]
        step = max(1, ENCODE_ROWS // max(1, b * h)) // self.block * self.block
        if t > step >= self.block:
            return Packed.concat([self._encode(x[:, :, i : i + step]) for i in range(0, t, step)])
        return self._encode(x)

    def _encode(self, x: mx.array) -> Packed:
        t, d = x.shape[2], x.shape[3]
        self._ensure(d)
        _, k, _ = self.sizes(d)
        xf = x.astype(mx.float32)
        data: dict[str, mx.array] = {}
        idx = None
        if k:  # the outlier selection stays MLX ops on either path
            idx = top_channels(xf, k, self.group)
            data["idx"] = pack(idx, index_bits(d))
        fields = _kernels.encode_sketch(self, x, idx)  # one kernel launch on a GPU
        data.update(self._sketches(xf, idx, scale_dtype(x.dtype)) if fields is None else fields)
        return Packed(data, t, self.block, frozenset({"idx"}) if k else frozenset())

    def _sketches(self, xf: mx.array, idx: mx.array | None, ndt: mx.Dtype) -> dict[str, mx.array]:
        """The reference's sketches and norms (MLX ops): ``osign``, ``onorm`` (with
        outliers), ``sign``, ``norm``."""
        m, _, mo = self.sizes(self.dim)
        s = self.proj.astype(mx.float32)
        data: dict[str, mx.array] = {}
        if idx is not None:
            mask = outlier_mask(idx, self.dim, self.group)
            xo = mx.where(mask, xf, 0.0)
            xf = mx.where(mask, 0.0, xf)
            data["osign"] = pack(sign_sketch(xo, s[:mo]), 1)
            data["onorm"] = mx.linalg.norm(xo, axis=-1).astype(ndt)
        data["sign"] = pack(sign_sketch(xf, s[:m]), 1)
        data["norm"] = mx.linalg.norm(xf, axis=-1).astype(ndt)
        return data

    def _signs(self, words: mx.array, n: int) -> mx.array:
        return unpack(words, 1, n).astype(mx.float32) * 2 - 1

    def decode(self, packed: Packed) -> mx.array:
        p = packed.data
        m, k, mo = self.sizes(self.dim)
        s = self.proj.astype(mx.float32)
        c = self._const()
        norm = p["norm"].astype(mx.float32)[..., None] * (c / m)
        k_hat = (self._signs(p["sign"], m) @ s[:m]) * norm
        if not k:
            return k_hat
        mask = outlier_mask(self._indices(packed), self.dim, self.group)
        onorm = p["onorm"].astype(mx.float32)[..., None] * (c / mo)
        k_out = (self._signs(p["osign"], mo) @ s[:mo]) * onorm
        return mx.where(mask, k_out, k_hat)

    def _indices(self, packed: Packed) -> mx.array:
        _, k, _ = self.sizes(self.dim)
        return unpack(packed.data["idx"], index_bits(self.dim), k).astype(mx.int32)

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        p = packed.data
        m, k, mo = self.sizes(self.dim)
        s = self.proj.astype(mx.float32)
        fix = self._const() / _SQRT_HALF_PI  # sketch_inner applies sqrt(pi/2) / m
        q = q.astype(mx.float32)
        sq = q @ s[:m].T  # (B, H, M, m): the projected query
        bits = unpack(p["sign"], 1, m)
        if not k:
            return sketch_inner(sq, bits, p["norm"]) * fix
        b, h, nq, d = q.shape
        g, t = self.group, packed.tokens
        nb = t // g
        idx = self._indices(packed)  # (B, H, nb, k)
        qo = mx.take_along_axis(
            mx.broadcast_to(q[:, :, None], (b, h, nb, nq, d)),
            mx.broadcast_to(idx[:, :, :, None, :], (b, h, nb, nq, k)),
            axis=-1,
        )  # (B, H, nb, M, k): the query's outlier coordinates, per block
        sp = qo @ mx.take(s.T, idx, axis=0)  # (B, H, nb, M, rows) = S P_o q
        s_in = sketch_inner(
            sq[:, :, None] - sp[..., :m],
            bits.reshape(b, h, nb, g, m),
            p["norm"].reshape(b, h, nb, g),
        )
        s_out = sketch_inner(
            sp[..., :mo],
            unpack(p["osign"], 1, mo).reshape(b, h, nb, g, mo),
            p["onorm"].reshape(b, h, nb, g),
        )
        out = (s_in + s_out) * fix  # (B, H, nb, M, g)
        return mx.transpose(out, (0, 1, 3, 2, 4)).reshape(b, h, nq, t)
