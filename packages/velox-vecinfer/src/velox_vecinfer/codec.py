"""``VecInfer``: vector quantization after an outlier-suppressing transform (arXiv 2510.06175).

VecInfer codes each vector as sub-vectors of ``vector`` channels, each replaced by the index of
its nearest codeword in a k-means codebook of ``2**(bits * vector)`` entries. Key caches have
outlier channels, which pull codewords away from the bulk of the data; the paper's *dual
transformation* removes them first:

1. **smooth**: ``k <- k / lambda`` with ``lambda_i`` the largest ``|k_i|`` of channel ``i`` over
   the calibration tokens, and ``q <- q * lambda``, so ``q . k`` is unchanged;
2. **Hadamard**: ``k <- H k`` and ``q <- H q`` with the orthonormal Walsh-Hadamard matrix
   ``H`` (no random signs), which spreads what is left of the outliers over all channels.

Values are vector-quantized with their own codebook and no transform (``smooth=False``,
``hadamard=False``). Attention never rebuilds a key: the query is transformed once and
dotted with the gathered codewords; values are mixed as codewords and transformed back once
per query row (the transform is linear).

Fitting (the paper trains codebooks and scales offline on calibration data) happens on the
first block this codec encodes: per batch row and KV head, ``lambda`` is the max over its
tokens, and k-means (k-means++ seeding, ``iters`` Lloyd steps, :func:`velox_core.ops.kmeans`)
runs on all its transformed sub-vectors pooled, so one codebook serves every sub-vector
position of a head. ``lambda`` is floored at ``1e-3`` times the head's largest channel
maximum (and at ``1e-6``): a channel silent during calibration would otherwise multiply a
later value by up to ``1e6`` before the Hadamard transform spreads it over every channel.
Head dims that are not powers of two use a block-diagonal Hadamard transform whose block is
the largest power of two dividing the head dim (16 for 80 and 112, 32 for 96).
"""

from __future__ import annotations

import math

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.ops import assign, block_size, hadamard, kmeans, pack, unpack
from velox_core.validation import check_bool, check_int

from . import kernels as _kernels
from .config import check_vector, index_bits

__all__ = ["VecInfer"]

_MIN_SCALE = 1e-6  # floor of lambda (an all-zero head)
_REL_SCALE = 1e-3  # floor of lambda relative to the head's largest channel maximum
_ASSIGN_CHUNK = 1 << 24  # distance entries (sub-vectors x codewords) per assignment step


class VecInfer(Codec):
    """VecInfer's vector quantizer of ``(B, H, T, D)`` vectors.

    Args:
        bits: bits per channel; ``bits * vector`` (the index width) must be a whole number
            from 1 to 8, e.g. 2 with ``vector=4`` (256 codewords of 4 channels) or 1.25.
        vector: channels per sub-vector: 1, 2, 4 or 8, dividing the head dim.
        smooth: divide channels by their calibration maxima (keys; the query is multiplied).
        hadamard: apply the orthonormal (block-)Walsh-Hadamard transform after smoothing.
        iters: Lloyd iterations of k-means (0: k-means++ seeding only).
        seed: seed of the k-means++ seeding.

    Packed layout: ``codes`` uint32 ``(B, H, T, ceil((D / vector) * index_bits / 32))``, the
    indices of the ``D / vector`` sub-vectors of each token as one little-endian bit stream
    (sub-vector ``s`` in bits ``[s * index_bits, (s + 1) * index_bits)``). Fitted state, one row
    per sequence: ``codebook`` float32 ``(B, H, 2**index_bits, vector)``, ``scale`` float32
    ``(B, H, D)`` (smooth only) and ``dim`` int32 ``(1,)``.
    """

    name = "vecinfer"
    settings = ("bits", "vector", "smooth", "hadamard", "iters", "seed")
    compressed_scores = True
    compressed_mix = True

    def __init__(
        self,
        bits: int | float = 2,
        vector: int = 4,
        smooth: bool = True,
        hadamard: bool = True,
        iters: int = 25,
        seed: int = 0,
    ):
        self.vector = check_vector("vector", vector)
        self.bits, self.index_bits = index_bits("bits", bits, self.vector)
        self.smooth = check_bool("smooth", smooth)
        self.hadamard = check_bool("hadamard", hadamard)
        self.iters = check_int("iters", iters, minimum=0)
        self.seed = check_int("seed", seed, minimum=0)
        self.codebook: mx.array | None = None
        self.scale: mx.array | None = None
        self.dim: int | None = None

    @property
    def size(self) -> int:
        """Codewords per codebook, ``2**index_bits``."""
        return 1 << self.index_bits

    @property
    def fitted(self) -> bool:
        return self.codebook is not None

    # -- set-up --------------------------------------------------------------------------------
    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if self.fitted and dim != self.dim:
            raise ValueError(f"vecinfer: fitted on head dim {self.dim}, got {dim}")
        if dim % self.vector:
            ok = [v for v in (1, 2, 4, 8) if dim % v == 0]
            raise ValueError(
                f"vecinfer: vector={self.vector} must divide the head dim {dim}; "
                f"choose vector from {ok}"
            )
        if self.hadamard and dim % 2:
            raise ValueError(
                f"vecinfer: hadamard=True needs an even head dim (the Hadamard block is the "
                f"largest power of two dividing it), got {dim}; use hadamard=False"
            )
        self.dim = dim

    def _require_fit(self) -> None:
        if not self.fitted:
            raise ValueError(
                "vecinfer: the codec is not fitted yet (it fits on the first block it encodes)"
            )

    def _rows(self, shape: tuple[int, ...], what: str) -> None:
        """Arrays must have the fitted state's (batch, heads)."""
        want = tuple(self.codebook.shape[:2])
        if tuple(shape[:2]) != want:
            raise ValueError(
                f"vecinfer: {what} has (batch, heads) {tuple(shape[:2])}, the fitted state {want}"
            )

    # -- the dual transformation ------------------------------------------------------------------
    def _scale(self, scale: mx.array | None) -> mx.array | None:
        if not self.smooth:
            return None
        if scale is None:
            raise ValueError("vecinfer: smooth=True needs the fitted scales (encode first)")
        return scale[:, :, None, :]

    def _forward(self, x: mx.array, scale: mx.array | None) -> mx.array:
        y = x.astype(mx.float32)
        s = self._scale(scale)
        if s is not None:
            y = y / s
        return hadamard(y, block_size(y.shape[-1])) if self.hadamard else y

    def transform(self, x: mx.array) -> mx.array:
        """The key-side transform ``H (x / lambda)``.

        Shapes:
            x ``(B, H, T, D)``; returns float32 ``(B, H, T, D)``.
        """
        return self._forward(x, self.scale)

    def transform_query(self, q: mx.array) -> mx.array:
        """The query-side transform ``H (q * lambda)``: ``transform_query(q) . transform(k)``
        equals ``q . k``.

        Shapes:
            q ``(B, H, M, D)`` (``M`` query rows per KV head); returns float32 of that shape.
        """
        y = q.astype(mx.float32)
        s = self._scale(self.scale)
        if s is not None:
            y = y * s
        return hadamard(y, block_size(y.shape[-1])) if self.hadamard else y

    def untransform(self, y: mx.array) -> mx.array:
        """The inverse of :meth:`transform`: ``lambda * (H y)`` (``H`` is its own inverse).

        Shapes:
            y ``(B, H, T, D)``; returns float32 ``(B, H, T, D)``.
        """
        y = y.astype(mx.float32)
        if self.hadamard:
            y = hadamard(y, block_size(y.shape[-1]))
        s = self._scale(self.scale)
        return y if s is None else y * s

    # -- fitting and coding -----------------------------------------------------------------------
    def fit(self, x: mx.array) -> None:
        """Fit the smoothing scales and the codebook of every batch row and head on ``x``
        (replacing any earlier fit). :meth:`encode` calls it on its first block when unfitted.

        Shapes:
            x ``(B, H, T, D)`` with ``T * D / vector >= 2**index_bits``.
        """
        b, h, t, d = x.shape
        self.check(d, x.dtype)
        n = t * (d // self.vector)
        if n < self.size:
            raise ValueError(
                f"vecinfer: a codebook of {self.size} codewords (bits={self.bits} x vector="
                f"{self.vector} = {self.index_bits} index bits) cannot be fitted on {t} tokens "
                f"x {d // self.vector} sub-vectors = {n} per head; fit on at least "
                f"{math.ceil(self.size / (d // self.vector))} tokens (VecInferCache: raise "
                "calibration)"
            )
        xf = x.astype(mx.float32)
        scale = None
        if self.smooth:
            peak = mx.max(mx.abs(xf), axis=2)  # (B, H, D)
            floor = mx.maximum(_REL_SCALE * mx.max(peak, axis=-1, keepdims=True), _MIN_SCALE)
            scale = mx.maximum(peak, floor)
        sub = self._forward(xf, scale).reshape(b, h, n, self.vector)
        # one k-means call per sequence with the same seed: a batch row's codebook is the one
        # its single-sequence cache would fit
        books = [kmeans(sub[i], self.size, self.iters, self.seed)[0] for i in range(b)]
        self.codebook, self.scale = mx.stack(books), scale

    def _assign(self, y: mx.array) -> mx.array:
        """Nearest codeword of every sub-vector, in chunks of bounded distance matrices.

        Shapes:
            y ``(B, H, T, D)`` transformed; returns uint32 ``(B, H, T, D / vector)``.
        """
        b, h, t, d = y.shape
        g, n = b * h, t * (d // self.vector)
        sub = y.reshape(g, n, self.vector)
        book = self.codebook.reshape(g, self.size, self.vector)
        step = max(1, _ASSIGN_CHUNK // (g * self.size))
        if n <= step:
            codes = assign(sub, book)
        else:
            codes = mx.concatenate(
                [assign(sub[:, i : i + step], book) for i in range(0, n, step)], axis=1
            )
        return codes.reshape(b, h, t, d // self.vector)

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Shapes: x ``(B, H, T, D)``; fits on the first call."""
        if not self.fitted:
            self.fit(x)
        self._rows(x.shape, "x")
        if x.shape[-1] != self.dim:
            raise ValueError(f"vecinfer: fitted on head dim {self.dim}, got {x.shape[-1]}")
        y = self.transform(x)
        words = _kernels.encode_codes(self, y)  # the encode kernel on a GPU
        if words is None:
            words = pack(self._assign(y), self.index_bits)
        return Packed({"codes": words}, x.shape[2])

    def codewords(self, packed: Packed) -> mx.array:
        """The tokens' codewords joined into vectors, still in the transformed domain.

        Shapes:
            returns float32 ``(B, H, T, D)``.
        """
        self._require_fit()
        words = packed.data["codes"]
        self._rows(words.shape, "the record")
        b, h, t = words.shape[:3]
        subs = self.dim // self.vector
        codes = unpack(words, self.index_bits, subs).astype(mx.int32)
        base = (mx.arange(b * h, dtype=mx.int32) * self.size).reshape(b, h, 1, 1)
        flat = self.codebook.reshape(b * h * self.size, self.vector)
        return mx.take(flat, codes + base, axis=0).reshape(b, h, t, self.dim)

    def decode(self, packed: Packed) -> mx.array:
        """Shapes: returns float32 ``(B, H, T, D)``."""
        return self.untransform(self.codewords(packed))

    # -- compressed-domain attention --------------------------------------------------------------
    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ k_hat.T`` as ``transform_query(q) @ codewords.T`` (no key is transformed back).

        Shapes: q ``(B, H, M, D)`` float32; returns ``(B, H, M, T)``.
        """
        return self.transform_query(q) @ mx.swapaxes(self.codewords(packed), -1, -2)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w @ v_hat`` as ``untransform(w @ codewords)`` (the transform is linear).

        Shapes: w ``(B, H, M, T)``; returns ``(B, H, M, D)``.
        """
        return self.untransform(w @ self.codewords(packed))

    # -- fitted state, one row per sequence -------------------------------------------------------
    def kernel_values(self, packed: Packed, dim: int):
        """The decode kernels' value side (GPU): :func:`velox_vecinfer.kernels.kernel_values`."""
        return _kernels.kernel_values(self, packed, dim)

    def kernel_keys(self, packed: Packed, q_shape, values):
        """The decode kernels' key side (GPU): :func:`velox_vecinfer.kernels.kernel_keys`."""
        return _kernels.kernel_keys(self, packed, q_shape, values)

    def state(self) -> dict[str, mx.array]:
        if not self.fitted:
            return {}
        out = {"codebook": self.codebook, "dim": mx.array([self.dim], dtype=mx.int32)}
        if self.smooth:
            out["scale"] = self.scale
        return out

    def set_state(self, state: dict[str, mx.array]) -> None:
        if not state:
            self.codebook = self.scale = None
            return
        need = {"codebook", "dim"} | ({"scale"} if self.smooth else set())
        if set(state) != need:
            raise ValueError(f"vecinfer: state must hold {sorted(need)}, got {sorted(state)}")
        book, dim = state["codebook"], int(state["dim"].reshape(-1)[0].item())
        if book.ndim != 4 or tuple(book.shape[2:]) != (self.size, self.vector):
            raise ValueError(
                f"vecinfer: codebook of shape {tuple(book.shape)} does not fit {self.describe()} "
                f"(expected (B, H, {self.size}, {self.vector}))"
            )
        scale = state.get("scale")
        if scale is not None and tuple(scale.shape) != (*book.shape[:2], dim):
            raise ValueError(
                f"vecinfer: scale of shape {tuple(scale.shape)}, expected {(*book.shape[:2], dim)}"
            )
        self.codebook = None  # check() compares with a fitted dim
        self.check(dim, mx.float32)
        self.codebook = book.astype(mx.float32)
        self.scale = None if scale is None else scale.astype(mx.float32)

    def filter_batch(self, index: mx.array) -> None:
        """Keep the fitted state of the given batch rows."""
        if self.fitted:
            self.codebook = self.codebook[index]
            if self.scale is not None:
                self.scale = self.scale[index]

    def extend_batch(self, other: VecInfer) -> None:
        """Append the fitted state of ``other``'s batch rows."""
        if self.fitted != other.fitted:
            raise ValueError(
                "vecinfer: cannot join a fitted codec with an unfitted one; feed both caches "
                "past their calibration tokens first"
            )
        if not self.fitted:
            return
        if other.dim != self.dim:
            raise ValueError(f"vecinfer: cannot join head dims {self.dim} and {other.dim}")
        self.codebook = mx.concatenate([self.codebook, other.codebook], axis=0)
        if self.scale is not None:
            self.scale = mx.concatenate([self.scale, other.scale], axis=0)
