"""``NSNQuantCodec``: NSNQuant's codes of keys or values (arXiv 2505.18231).

A block of ``group`` tokens of one KV head is coded as follows:

1. the normalize-shift-normalize transform and the Hadamard rotation
   (:mod:`velox_nsnquant.transform`): ``y = H x3`` with ``x = s1 (s2 x3 + o)``;
2. each sub-vector of ``dim`` channels of ``y`` is replaced by the index of its nearest
   codeword in the universal codebook of the width (:func:`velox_nsnquant.codebook.codebook`:
   k-means of synthetic ``N(0, I)`` vectors, the same for every model, layer and side);
3. the token's gain: with ``y_hat`` the codewords, ``alpha = (y . y_hat) / (y_hat . y_hat)``
   (the least-squares scale of the token's reconstruction), so the token is stored as
   ``H x_hat = a y_hat + n (H o)`` with ``a = s1 s2 alpha`` and ``n = s1``.

Stored (head dim ``D``, ``bits`` bits an entry): per token the codes, ``D * bits`` bits
packed into uint32 words (``D / dim`` indices of ``bits * dim`` bits), and ``a``, ``n`` (fp16,
bf16 for bf16 models); per block the rotated shift ``H o`` (``D`` fp16). At ``D = G = 128``:
``bits + 0.375`` bits an entry.

Attention reads the codes on the reference path, a tile of :data:`TILE` tokens at a time:
the query is rotated once (``q . x = (H q) . (H x)``), each tile's codewords are gathered
from the codebook and multiplied (scores: ``a (Hq . y_hat) + n (Hq . Ho)``; mix: the weights
times ``a`` against the codewords, the weights times ``n`` summed per block against ``Ho``),
and the mixed values are rotated back once. No kernel layout reads these codes (VecInfer's
``VQCodes`` has no per-token scales nor shift), so decode steps take this path on every
backend.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.codec.hadamard import HadamardRotated
from velox_core.ops import pack, scale_dtype, unpack
from velox_core.validation import check_bits, check_int

from .codebook import codebook, subvector
from .transform import Rotation, nsn

__all__ = ["TILE", "NSNQuantCodec"]

TILE = 1024  # tokens the reference path decodes at once
_ROWS = 1 << 20  # distance entries per block of a nearest-codeword search (4 MiB of floats)


class NSNQuantCodec(HadamardRotated, Codec):
    """NSNQuant's codec (keys and values alike).

    Args:
        bits: bits an entry, 1 to 8 (sub-vectors of 8, 4, 2, 2 channels at 1 to 4 bits with
            256, 256, 64, 256 codewords; scalar Gaussian Lloyd-Max levels above).
        group: tokens per block: the shift is the mean of a block's normalized tokens.
        seed: None for the Sylvester Hadamard rotation, or the seed of random signs.

    Packed layout (head dim ``D``): per token ``codes`` uint32 ``(ceil(D * bits / 32),)``,
    ``scale`` and ``norm`` ``(1,)``; per block ``shift`` ``(D,)``; fp16 (bf16 for bf16 input).
    """

    name = "nsnquant"
    settings = ("bits", "group", "seed")
    compressed_scores = True
    compressed_mix = True

    def __init__(self, bits: int = 2, group: int = 128, seed: int | None = None):
        self.bits = check_bits("bits", bits, minimum=1, maximum=8)
        self.group = check_int("group", group, minimum=1)
        self.seed = None if seed is None else check_int("seed", seed, minimum=0)
        self.block = self.group
        self.dim = subvector(self.bits)
        self.rotation: Rotation | None = None

    # -- set-up and state --------------------------------------------------------------------
    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if dim % 2:
            raise ValueError(f"nsnquant: head dim {dim} is odd: no Hadamard block divides it")
        if dim % self.dim:
            raise ValueError(
                f"nsnquant: head dim {dim} is not a multiple of the {self.dim}-channel "
                f"sub-vectors of {self.bits}-bit codes"
            )
        self._ready(dim)
        codebook(self.bits)  # loaded (or refused) now, not at the first flush

    # -- coding ------------------------------------------------------------------------------
    def _search(self, y: mx.array) -> mx.array:
        """Nearest codeword of each sub-vector, a block of rows at a time (each block's
        distances evaluated and freed before the next exist: a prefill chunk's transient is
        one block, not a distance for every sub-vector and codeword).

        Shapes: y ``(N, dim)``; returns uint32 ``(N,)``.
        """
        book = codebook(self.bits)
        ct = mx.swapaxes(book, 0, 1) * -2.0
        cn = mx.sum(book * book, axis=-1)
        step = max(1, _ROWS // book.shape[0])
        if y.shape[0] <= step:
            return mx.argmin(cn + y @ ct, axis=-1).astype(mx.uint32)
        mx.eval(y)
        parts = []
        for i in range(0, y.shape[0], step):
            part = mx.argmin(cn + y[i : i + step] @ ct, axis=-1).astype(mx.uint32)
            mx.eval(part)
            parts.append(part)
        return mx.concatenate(parts)

    def _codewords(self, codes: mx.array, d: int) -> mx.array:
        """The codewords of packed codes: float32 ``(..., T, D)``."""
        idx = unpack(codes, self.bits * self.dim, d // self.dim).astype(mx.int32)
        return mx.take(codebook(self.bits), idx, axis=0).reshape(*idx.shape[:-1], d)

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Shapes: x ``(B, H, T, D)`` with ``T`` a multiple of ``group``."""
        b, h, t, d = x.shape
        rot = self._ready(d)
        x3, s1, s2, o = nsn(x, self.group)
        y = rot.forward(x3)
        n = b * h * t * (d // self.dim)
        idx = self._search(y.reshape(n, self.dim)).reshape(b, h, t, d // self.dim)
        codes = pack(idx, self.bits * self.dim)
        y_hat = self._codewords(codes, d)
        alpha = mx.sum(y * y_hat, -1, keepdims=True) / mx.maximum(
            mx.sum(y_hat * y_hat, -1, keepdims=True), 1e-12
        )
        sdt = scale_dtype(x.dtype)
        data = {
            "codes": codes,
            "scale": (s1 * s2 * alpha).astype(sdt),
            "norm": s1.astype(sdt),
            "shift": rot.forward(o).astype(sdt),
        }
        return Packed(data, t, self.group, frozenset({"shift"}))

    def _per_token_shift(self, packed: Packed) -> mx.array:
        """``n (H o)`` of every token: float32 ``(B, H, T, D)``."""
        p = packed.data
        sh = mx.repeat(p["shift"].astype(mx.float32), self.group, axis=2)
        return p["norm"].astype(mx.float32) * sh

    def decode_rotated_as(self, packed: Packed, dtype: mx.Dtype) -> mx.array:
        """``H x_hat = a y_hat + n (H o)`` in ``dtype`` (no inverse rotation)."""
        p = packed.data
        d = p["shift"].shape[-1]
        y = self._codewords(p["codes"], d) * p["scale"].astype(mx.float32)
        return (y + self._per_token_shift(packed)).astype(dtype)

    def decode(self, packed: Packed) -> mx.array:
        y = self.decode_rotated_as(packed, mx.float32)
        return self._ready(y.shape[-1]).inverse(y)

    # -- attention from the codes, a tile at a time -------------------------------------------
    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ k_hat.T`` from the codes. Shapes: q ``(B, H, M, D)``; returns ``(B, H, M, T)``."""
        d = q.shape[-1]
        qr = self._ready(d).forward(q)
        parts = []
        for _, _, p in packed.tiles(TILE):
            pd = p.data
            y = self._codewords(pd["codes"], d)  # (B, H, Tt, D)
            s = (qr @ mx.swapaxes(y, -1, -2)) * mx.swapaxes(pd["scale"].astype(mx.float32), -1, -2)
            qs = qr @ mx.swapaxes(pd["shift"].astype(mx.float32), -1, -2)  # (B, H, M, Pt)
            qs = mx.repeat(qs, self.group, axis=-1)
            parts.append(s + qs * mx.swapaxes(pd["norm"].astype(mx.float32), -1, -2))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w @ v_hat`` from the codes. Shapes: w ``(B, H, M, T)``; returns ``(B, H, M, D)``."""
        d = packed.data["shift"].shape[-1]
        b, h, m, _ = w.shape
        out = None
        for a, e, p in packed.tiles(TILE):
            pd = p.data
            wt = w[..., a:e]
            y = self._codewords(pd["codes"], d)
            part = (wt * mx.swapaxes(pd["scale"].astype(mx.float32), -1, -2)) @ y
            wn = wt * mx.swapaxes(pd["norm"].astype(mx.float32), -1, -2)
            wn = mx.sum(wn.reshape(b, h, m, (e - a) // self.group, self.group), axis=-1)
            part = part + wn @ pd["shift"].astype(mx.float32)
            out = part if out is None else out + part
        return self._ready(d).inverse(out)
