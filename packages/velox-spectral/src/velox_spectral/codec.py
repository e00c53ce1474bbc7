"""``SpectralKeys`` and ``SpectralValues``: tokens coded in a calibrated PCA basis, the leading
("signal") components by one Lloyd-Max codebook and the rest ("noise") by a coarser one.

A token ``x`` of KV head ``h`` (a key post-RoPE, as the caches hold it, or a value) is coded
as follows, with the head's fitted mean ``mu``, basis ``P`` (orthonormal columns, largest
eigenvalue first) and component deviations ``sigma_j = sqrt(lambda_j)``
(:mod:`velox_spectral.fit`):

1. projected, ``y = P^+ (x - mu)`` (``P^T`` but for the rounding of the held basis, see
   below), and each component scaled, ``z_j = y_j / sigma_j``;
2. normalized by the token's RMS ``s = sqrt(mean_j z_j^2)`` over the coded components, so
   each ``u_j = z_j / s`` is close to a standard normal;
3. the first ``rank`` components coded by the Gaussian Lloyd-Max codebook of
   ``signal_bits`` (:func:`velox_core.ops.lloyd_max.lloyd_max_gaussian`), the others by
   that of ``noise_bits`` (0: dropped, decoded as 0), both bit-packed
   (:func:`velox_core.ops.pack`);
4. the token's gain ``g`` (fp16, bf16 for bf16 models) is the least-squares one in the PCA
   domain given the codes, ``g = sum_j sigma_j^2 z_j c_j / sum_j sigma_j^2 c_j^2``, so the
   token decodes on its own: ``x_hat = mu + P (g * sigma * c)``.

Attention reads the codes (:meth:`scores`, :meth:`mix`), a tile of :data:`TILE` tokens at a
time: the query is projected once a call, ``q . x_hat = q . mu + g * ((P^T q) * sigma) . c``,
and the weights mix the levels in the PCA domain, mapped back once, ``o = (sum_t w_t g_t c_t
* sigma) P^T + (sum_t w_t) mu``. No velox-core kernel layout reads these codes (two code
widths a token, a scale per component, a mean), so decode steps take this path on every
backend; a prefill decodes the stored tokens a slice at a time (:attr:`decodes_slices`).

Where the bases come from: the model's artifact (:mod:`velox_spectral.artifact`), found by
``bind(model, layer)`` (``velox_core.make_cache`` calls it), or ``artifact=PATH`` with
``layer=i``. What a layer's codes need of it is codec state (counted in ``nbytes`` and saved
with the cache): ``basis`` ``(H, D, k)`` (``k = D``, or ``rank`` with ``noise_bits=0``: the
other columns are never read) as the artifact holds it, int8 codes with a float32 scale a
column (half the resident bytes of float16; the tokens are projected by its pseudo-inverse,
so that the rounding, about 2% of a vector, never adds to the codes' error),
``mean`` and ``sigma`` float32, and the ``rank`` in use.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np

from velox_core import Codec, Packed
from velox_core.artifacts import LayerFit
from velox_core.ops import BYTE_BITS, byte_table, lookup, pack, scale_dtype, unpack
from velox_core.ops.lloyd_max import lloyd_max_gaussian
from velox_core.validation import check_bits, check_float, check_int

from .artifact import KIND, SpectralBases

__all__ = [
    "DEFAULT_VARIANCE",
    "TILE",
    "SpectralKeys",
    "SpectralValues",
    "code_words",
    "packed_rank",
    "rank_for_variance",
]

TILE = 1024  # tokens the reference path decodes at once
DEFAULT_VARIANCE = 0.8  # the rank's variance fraction where neither rank nor variance is given
_TINY = 1e-6  # floor of a component's deviation, relative to the head's largest


def rank_for_variance(eigenvalues: np.ndarray, variance: float) -> int:
    """The smallest rank whose leading components hold ``variance`` of every head's variance:
    the largest over the heads of each one's smallest such rank (one rank a layer and side:
    its codes are one array).

    Shapes: eigenvalues ``(H, D)``, descending.
    """
    lam = np.asarray(eigenvalues, dtype=np.float64)
    frac = np.cumsum(lam, axis=-1) / np.maximum(lam.sum(-1, keepdims=True), 1e-300)
    per_head = np.argmax(frac >= variance - 1e-12, axis=-1) + 1
    return int(per_head.max())


def _pseudo_inverse(p: mx.array) -> mx.array:
    """``E = P (P^T P)^-1``, so that ``y = E^T x`` is the least-squares ``y`` of ``P y = x``:
    with the int8 basis (nearly, not exactly orthonormal) the coefficients decode back
    through ``P`` exactly. Computed at each encode (a flush of tokens), never held.

    Shapes: p ``(H, D, k)`` float32; returns ``(H, D, k)``.
    """
    gram = mx.swapaxes(p, -1, -2) @ p
    return p @ mx.linalg.inv(gram, stream=mx.cpu)


def code_words(rank: int, dim: int, signal_bits: int, noise_bits: int) -> int:
    """uint32 words a token's codes take: the signal's and the noise's, each padded."""
    noise = -(-(dim - rank) * noise_bits // 32) if noise_bits else 0
    return -(-rank * signal_bits // 32) + noise


def packed_rank(rank: int, dim: int, signal_bits: int, noise_bits: int) -> int:
    """The largest rank from ``rank`` up whose codes take the fewest words: the signal grows
    into the bits the word padding would waste (a rank of 42 of 128 at 5/3 bits takes 16
    words, one of 43 takes 15)."""
    return min(
        range(rank, dim + 1), key=lambda r: (code_words(r, dim, signal_bits, noise_bits), -r)
    )


class _SpectralSide(LayerFit, Codec):
    kind = KIND
    side: ClassVar[str] = "key"
    settings = ("signal_bits", "noise_bits", "rank", "variance", "artifact", "layer")
    compressed_scores = True
    compressed_mix = True
    decodes_slices = True  # per-token codes and gains, a fixed basis

    def __init__(
        self,
        signal_bits: int = 5,
        noise_bits: int = 3,
        rank: int | None = None,
        variance: float | None = None,
        artifact: str | os.PathLike | None = None,
        layer: int | None = None,
    ):
        self.signal_bits = check_bits("signal_bits", signal_bits, 1, 8)
        self.noise_bits = check_bits("noise_bits", noise_bits, 0, 8)
        if self.noise_bits > self.signal_bits:
            raise ValueError(
                f"noise_bits={noise_bits} must not exceed signal_bits={signal_bits} (the noise "
                "components carry the least variance)"
            )
        if rank is not None and variance is not None:
            raise ValueError(
                f"give rank or variance, not both (rank={rank!r}, variance={variance!r})"
            )
        self.rank = None if rank is None else check_int("rank", rank, minimum=1)
        self.variance = (
            None
            if variance is None
            else check_float("variance", variance, minimum=0.0, maximum=1.0, open_min=True)
        )
        self.init_fit(artifact, layer)  # _fit: basis, mean, sigma, rank
        self._dim: int | None = None
        self._r = 0
        self._books = (lloyd_max_gaussian(self.signal_bits), None)
        if self.noise_bits:
            self._books = (self._books[0], lloyd_max_gaussian(self.noise_bits))
        self._tables: dict[tuple[int, mx.Dtype], mx.array] = {}

    # -- the model's artifact (LayerFit) -----------------------------------------------------
    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Find the artifact fitted for ``model`` and read this layer's basis."""
        art = self.found(model, layer)
        if art is not None:
            self._fit = self._select(art)

    def _select(self, art: SpectralBases) -> dict[str, mx.array]:
        fit = art.side(self.layer, self.side)
        d = fit["basis"].shape[1]
        lam = np.asarray(fit["eigenvalues"], dtype=np.float64)
        if self.rank is not None:
            self._check_rank(self.rank, d)
            r = self.rank
        else:
            r = rank_for_variance(lam, self.variance or DEFAULT_VARIANCE)
            r = packed_rank(r, d, self.signal_bits, self.noise_bits)
        k = d if self.noise_bits else r
        sigma = np.sqrt(lam[:, :k])
        sigma = np.maximum(sigma, _TINY * np.maximum(sigma[:, :1], 1e-30))
        return {
            "basis": fit["basis"][:, :, :k],
            "basis_scale": fit["basis_scale"][:, :k].astype(mx.float32),
            "mean": fit["mean"].astype(mx.float32),
            "sigma": mx.array(sigma.astype(np.float32)),
            "rank": mx.array([r], dtype=mx.int32),
        }

    def _check_rank(self, r: int, dim: int) -> None:
        if r > dim:
            raise ValueError(
                f"spectral: rank={r} exceeds the {self.side} head dim {dim} (components: 1 to "
                f"{dim})"
            )

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if self._fit is None:
            how = "the spectral quantizer codes tokens in PCA bases"
            self._fit = self._select(self.record("bases", how))
        self._ready(dim)

    def _ready(self, dim: int) -> None:
        if self._dim == dim:
            return
        if self._fit is None:
            self.check(dim, mx.float32)
            return
        basis = self._fit["basis"]
        if basis.shape[1] != dim:
            raise ValueError(
                f"spectral: layer {self.layer}'s {self.side} bases are {basis.shape[1]}-dim, the "
                f"cache holds {dim}-dim heads: they were fitted for another model"
            )
        self._r = int(self._fit["rank"][0].item())
        self._dim = dim

    def _heads(self, h: int) -> None:
        fitted = self._fit["basis"].shape[0]
        if h != fitted:
            raise ValueError(
                f"spectral: layer {self.layer}'s {self.side} bases are fitted for {fitted} KV "
                f"heads, the cache holds {h}: they were fitted for another model"
            )

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        """``basis`` int8 ``(H, D, k)`` and ``basis_scale`` float32 ``(H, k)``, ``mean``
        ``(H, D)`` and ``sigma`` ``(H, k)`` float32, ``rank`` int32 ``(1,)``; empty before the
        artifact is read."""
        return {} if self._fit is None else dict(self._fit)

    def set_state(self, state: dict[str, mx.array]) -> None:
        self._dim = None
        if not state:  # nothing read yet: check() reads the artifact
            self._fit = None
            return
        want = {"basis", "basis_scale", "mean", "sigma", "rank"}
        if set(state) != want:
            raise ValueError(f"{self.name}: state must hold {sorted(want)}, got {sorted(state)}")
        basis, mean, sigma, rank = (state[n] for n in ("basis", "mean", "sigma", "rank"))
        if basis.ndim != 3 or basis.dtype != mx.int8 or rank.shape != (1,):
            raise ValueError(f"{self.name}: basis must be int8 (H, D, k) and rank (1,)")
        h, d, k = basis.shape
        r = int(rank[0].item())
        self._check_rank(max(r, 1), d)
        if r < 1 or (self.rank is not None and r != self.rank):
            raise ValueError(f"{self.name}: saved rank {r} does not match {self.describe()}")
        if k != (d if self.noise_bits else r):
            raise ValueError(
                f"{self.name}: basis has {k} columns, {self.describe()} needs "
                f"{d if self.noise_bits else r}"
            )
        shapes = (mean.shape, sigma.shape, state["basis_scale"].shape)
        if tuple(map(tuple, shapes)) != ((h, d), (h, k), (h, k)):
            raise ValueError(
                f"{self.name}: mean must be ({h}, {d}), sigma and basis_scale ({h}, {k})"
            )
        self._fit = dict(state)
        self._ready(d)

    @property
    def rank_in_use(self) -> int:
        """The rank the codes use (the given ``rank``, or the one ``variance`` chose), once the
        artifact is read; 0 before."""
        return self._r

    # -- coding ------------------------------------------------------------------------------
    def _parts(self) -> tuple[mx.array, mx.array, mx.array]:
        """``P`` ``(H, D, k)``, ``sigma`` ``(1, H, 1, k)`` and ``mu`` ``(1, H, 1, D)``, float32."""
        f = self._fit
        h = f["mean"].shape[0]
        sigma = f["sigma"].reshape(1, h, 1, -1)
        p = f["basis"].astype(mx.float32) * f["basis_scale"][:, None, :]
        return p, sigma, f["mean"].reshape(1, h, 1, -1)

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Shapes: x ``(B, H, T, D)``."""
        _, h, t, d = x.shape
        self._ready(d)
        self._heads(h)
        p, sigma, mu = self._parts()
        r, (sb, nb) = self._r, self._books
        z = ((x.astype(mx.float32) - mu) @ _pseudo_inverse(p)) / sigma  # (B, H, T, k)
        s = mx.sqrt(mx.mean(z * z, axis=-1, keepdims=True))
        u = z / mx.maximum(s, 1e-30)
        noise = nb is not None and r < d  # a rank of the whole head leaves no noise
        codes = [sb.encode(u[..., :r])]
        c = [sb.decode(codes[0])]
        if noise:
            codes.append(nb.encode(u[..., r:]))
            c.append(nb.decode(codes[1]))
        c = c[0] if len(c) == 1 else mx.concatenate(c, axis=-1)
        s2 = sigma * sigma
        gain = mx.sum(s2 * z * c, axis=-1) / mx.sum(s2 * c * c, axis=-1)
        data = {"signal": pack(codes[0], self.signal_bits)}
        if noise:
            data["noise"] = pack(codes[1], self.noise_bits)
        data["gain"] = gain.astype(scale_dtype(x.dtype))
        return Packed(data, t)

    def _levels(self, data: dict[str, mx.array], dtype: mx.Dtype = mx.float32):
        """The codes' levels ``(B, H, T, r)`` and ``(B, H, T, k - r)`` (None without noise
        codes), in ``dtype``."""
        out = []
        for name, bits, book, n in (
            ("signal", self.signal_bits, self._books[0], self._r),
            ("noise", self.noise_bits, self._books[1], self._dim - self._r),
        ):
            if book is None or n == 0:
                out.append(None)
                continue
            words = data[name]
            if bits in BYTE_BITS:
                key = (bits, dtype)
                if key not in self._tables:
                    self._tables[key] = byte_table(book.levels(), bits).astype(dtype)
                out.append(lookup(words, bits, n, self._tables[key]))
            else:
                idx = unpack(words, bits, n).astype(mx.int32)
                out.append(mx.take(book.levels().astype(dtype), idx))
        return out

    def decode(self, packed: Packed) -> mx.array:
        """Shapes: returns float32 ``(B, H, T, D)``."""
        if self._dim is None:
            raise ValueError(f"{self.name}: the head dim is not known yet")
        p, sigma, mu = self._parts()
        c = [a for a in self._levels(packed.data) if a is not None]
        c = c[0] if len(c) == 1 else mx.concatenate(c, axis=-1)
        y = c * (packed.data["gain"].astype(mx.float32)[..., None] * sigma)
        return y @ mx.swapaxes(p, -1, -2) + mu

    # -- attention from the codes, a tile at a time -------------------------------------------
    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q k_hat^T`` from the codes: the query projected once, ``q . mu`` added.

        Shapes: q ``(B, H, M, D)`` float32, scale applied; returns float32 ``(B, H, M, T)``.
        """
        self._ready(q.shape[-1])
        p, sigma, mu = self._parts()
        qs = (q.astype(mx.float32) @ p) * sigma  # (B, H, M, k)
        qmu = mx.sum(q * mu, axis=-1, keepdims=True)  # (B, H, M, 1)
        r = self._r
        parts = []
        for _, _, tile in packed.tiles(TILE):
            cs, cn = self._levels(tile.data)
            s = qs[..., :r] @ mx.swapaxes(cs, -1, -2)
            if cn is not None:
                s = s + qs[..., r:] @ mx.swapaxes(cn, -1, -2)
            g = tile.data["gain"].astype(mx.float32)[:, :, None, :]
            parts.append(s * g + qmu)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w v_hat``: the weights mix the levels in the PCA domain, mapped back once.

        Shapes: w ``(B, H, M, T)`` float32; returns float32 ``(B, H, M, D)``.
        """
        if self._dim is None:
            raise ValueError(f"{self.name}: the head dim is not known yet")
        p, sigma, mu = self._parts()
        acc_s = acc_n = None
        for a, e, tile in packed.tiles(TILE):
            cs, cn = self._levels(tile.data)
            wg = w[..., a:e] * tile.data["gain"].astype(mx.float32)[:, :, None, :]
            acc_s = wg @ cs if acc_s is None else acc_s + wg @ cs
            if cn is not None:
                acc_n = wg @ cn if acc_n is None else acc_n + wg @ cn
        y = acc_s if acc_n is None else mx.concatenate([acc_s, acc_n], axis=-1)
        return (y * sigma) @ mx.swapaxes(p, -1, -2) + mx.sum(w, axis=-1, keepdims=True) * mu


class SpectralKeys(_SpectralSide):
    """The spectral quantizer's key codec (post-RoPE keys).

    Args:
        signal_bits: code width of the leading ``rank`` components (1 to 8).
        noise_bits: code width of the other components (0 to ``signal_bits``; 0 drops them).
        rank: the components coded at ``signal_bits``; None: chosen by ``variance``.
        variance: the fraction of each head's variance the leading components must hold (the
            rank: the largest over the layer's heads of the smallest such rank, then raised
            while the codes take no more words, :func:`packed_rank`); None with ``rank`` None:
            :data:`DEFAULT_VARIANCE`.
        artifact: path of the spectral artifact; None finds the model's at ``bind``.
        layer: the model layer (set by ``bind``).

    Packed layout: per token ``signal`` uint32 ``(ceil(rank * signal_bits / 32),)``, ``noise``
    uint32 ``(ceil((D - rank) * noise_bits / 32),)`` (without ``noise_bits=0``) and ``gain``
    fp16 (bf16 for bf16 input). State: see the module.
    """

    name = "spectral-key"
    side = "key"


class SpectralValues(_SpectralSide):
    """The spectral quantizer's value codec. Args and layout: see :class:`SpectralKeys`."""

    name = "spectral-value"
    side = "value"
