"""``SKVQ``: reordered channels, clipped dynamic group quantization (arXiv 2405.06219).

The codec sees one layer's vectors ``(B, H, T, D)``. Per sequence it fits, on the first tokens
it is given (:meth:`SKVQ.fit`; :class:`~velox_skvq.SKVQCache` calls it with every token seen
before the first one is coded), a permutation of the layer's ``H * D`` channels (heads mixed,
as the paper reorders a layer's whole hidden vector) and one clipping factor per channel group.
A token's reordered vector is cut into ``H`` chunks of ``D`` channels, stored where the heads
were, so a record keeps the cache's ``(B, H, T, ...)`` layout: ``codes`` (bit-packed),
``scale`` and ``zero`` (fp16, bf16 for bf16 models) per group of ``group`` channels.

Attention reads the codes. Chunk ``j`` holds channels of several heads, so the scores of
query head ``h`` are the sum over chunks of ``q~_hj . k_j``, where ``q~_hj`` is the query of
head ``h`` moved to the slots its channels occupy in chunk ``j`` and zero elsewhere (the query
is permuted; the stored tokens never are). The mix ``w @ v`` is taken against every chunk and
the slots of each head's channels are gathered back (the output is inverse-permuted). Both run
through ``mx.quantized_matmul`` when the width is 2-6 or 8 bits and ``group`` is 32, 64 or
128; otherwise (1.5-bit codes, other groups) a block is decoded first. ``reorder=False``
keeps the model's order, and attention is the plain per-head product.

Deviations (see docs/skvq.md): the permutation and clipping factors are fitted on the first
tokens of each sequence (at most 4,096 for the channel statistics, 256 for the clipping
search), not offline on a calibration set; groups hold exactly ``group`` channels (balanced
k-means) where the reference code's clusters have any size; the clipping factors are chosen by
least reconstruction error; keys are coded after RoPE; 1.5-bit codes are packed in base 3 and
attended by decoding; scales and zeros are fp16/bf16 (no fp8 option). Batch rows are fitted
separately (the state has a batch axis), and a record's chunks mix heads, so per-head token
gathers (``Packed.take`` with a ``(B, H, n)`` index) do not apply to it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from velox_core import Codec, Packed
from velox_core.ops import affine_matmul, mlx_readable, scale_dtype
from velox_core.validation import check_float, check_int

from .config import TERNARY, check_bits
from .quant import (
    clip_grid,
    dequantize,
    levels,
    pack_codes,
    quantize,
    search_clip,
    strided,
    unpack_codes,
)
from .reorder import fit_permutation, from_chunks, slots, to_chunks

__all__ = ["SKVQ"]

_CALIB_TOKENS = 4096  # calibration tokens for the channel statistics, at most
_CLIP_TOKENS = 256  # of which the clipping search uses at most (both evenly strided)


class SKVQ(Codec):
    """SKVQ's codec for keys or values of one layer.

    Args:
        bits: code width, 2 to 8, or 1.5 (three levels, packed in base 3).
        group: channels per group (after reordering); must divide the head dim.
        clip_min: smallest clipping factor of the searched grid (1.0: no clipping).
        reorder: fit a channel permutation (True) or keep the model's order.
    """

    name = "skvq"
    settings = ("bits", "group", "clip_min", "reorder")
    compressed_scores = True
    compressed_mix = True

    def __init__(self, bits: int | float = 2, group: int = 64, clip_min: float = 0.7, reorder=True):
        self.bits = check_bits("bits", bits)
        self.group = check_int("group", group, minimum=1)
        self.clip_min = check_float("clip_min", clip_min, minimum=0.5, maximum=1.0)
        if not isinstance(reorder, bool):
            raise TypeError(f"reorder must be True or False, got {reorder!r}")
        self.reorder = reorder
        self.top = levels(self.bits)
        self.perm: mx.array | None = None  # (B, H*D), the narrowest unsigned int that fits
        self.clip: mx.array | None = None  # (B, H, D // group)

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if dim % self.group:
            divs = ", ".join(str(g) for g in (16, 32, 64, 128) if dim % g == 0) or "1"
            raise ValueError(f"skvq: group={self.group} must divide the head dim {dim} ({divs})")

    # -- fitted state ------------------------------------------------------------------------
    @property
    def fitted(self) -> bool:
        return self.clip is not None

    def state(self) -> dict[str, mx.array]:
        if not self.fitted:
            return {}
        return {"clip": self.clip} | ({"perm": self.perm} if self.reorder else {})

    def set_state(self, state: dict[str, mx.array]) -> None:
        want = {"clip", "perm"} if self.reorder else {"clip"}
        if not state:
            self.perm = self.clip = None
            return
        if set(state) != want:
            raise ValueError(f"skvq: state must hold {sorted(want)}, got {sorted(state)}")
        clip, perm = state["clip"], state.get("perm")
        if clip.ndim != 3 or (
            perm is not None
            and (perm.shape != (clip.shape[0], clip.shape[1] * clip.shape[2] * self.group))
        ):
            raise ValueError(
                f"skvq: state shapes disagree: clip {tuple(clip.shape)} (B, H, D/group), "
                f"perm {None if perm is None else tuple(perm.shape)} (B, H*D), group {self.group}"
            )
        self.clip, self.perm = clip, perm

    def select_rows(self, index: mx.array) -> None:
        """Keep the fitted state of the given batch rows (the cache's ``filter``)."""
        if self.fitted:
            self.clip = self.clip[index]
            self.perm = None if self.perm is None else self.perm[index]

    def append_rows(self, other: SKVQ) -> None:
        """Append ``other``'s fitted rows (the cache's ``extend``)."""
        if self.fitted != other.fitted:
            raise ValueError("extend: one cache has fitted SKVQ codecs and the other not")
        if self.fitted:
            self.clip = mx.concatenate([self.clip, other.clip], axis=0)
            if self.perm is not None:
                self.perm = mx.concatenate([self.perm, other.perm], axis=0)

    def fit(self, x: mx.array) -> None:
        """Fit the permutation and clipping factors of each sequence on tokens ``x``.

        Shapes:
            x ``(B, H, T, D)`` with ``T >= 1``.
        """
        b, h, _, d = x.shape
        self.check(d, x.dtype)
        xf = strided(x, _CALIB_TOKENS).astype(mx.float32)
        if self.reorder:
            flat = mx.swapaxes(xf, 1, 2).reshape(b, -1, h * d)
            lo, hi = np.array(mx.min(flat, axis=1)), np.array(mx.max(flat, axis=1))
            perm = np.stack([fit_permutation(lo[i], hi[i], self.group) for i in range(b)])
            n = h * d
            self.perm = mx.array(
                perm.astype(np.uint8 if n <= 256 else np.uint16 if n <= 65536 else np.int32)
            )
        sdt = scale_dtype(x.dtype)
        grid = clip_grid(self.clip_min)
        xc = self._to_chunks(strided(xf, _CLIP_TOKENS))
        self.clip = search_clip(xc, grid, self.top, self.group, sdt)
        mx.eval(self.clip, *([] if self.perm is None else [self.perm]))

    # -- permutation ---------------------------------------------------------------------------
    def _to_chunks(self, x: mx.array) -> mx.array:
        return to_chunks(x, self.perm) if self.reorder else x

    def _from_chunks(self, x: mx.array) -> mx.array:
        return from_chunks(x, self.perm) if self.reorder else x

    # -- coding ----------------------------------------------------------------------------------
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        if not self.fitted:
            self.fit(x)
        if (x.shape[0], x.shape[1], x.shape[3] // self.group) != tuple(self.clip.shape):
            raise ValueError(
                f"skvq: tokens {tuple(x.shape)} do not match the fitted state "
                f"(batch {self.clip.shape[0]}, {self.clip.shape[1]} heads)"
            )
        xp = self._to_chunks(x.astype(mx.float32))
        codes, scale, zero = quantize(xp, self.clip, self.top, self.group, scale_dtype(x.dtype))
        return Packed(
            {"codes": pack_codes(codes, self.bits), "scale": scale, "zero": zero}, x.shape[2]
        )

    def _need_state(self) -> None:
        if not self.fitted:
            raise ValueError("skvq: the codec has no fitted state (encode or fit tokens first)")

    def _reordered(self, packed: Packed) -> mx.array:
        self._need_state()
        p = packed.data
        d = p["scale"].shape[-1] * self.group
        return dequantize(unpack_codes(p["codes"], self.bits, d), p["scale"], p["zero"], self.group)

    def decode(self, packed: Packed) -> mx.array:
        return self._from_chunks(self._reordered(packed))

    def _mlx(self, packed: Packed, x: mx.array, transpose: bool) -> mx.array:
        p = packed.data
        bits, group = int(self.bits), self.group
        return affine_matmul(x, p["codes"], p["scale"], p["zero"], bits, group, transpose)

    def _mlx_layout(self) -> bool:
        return self.bits != TERNARY and mlx_readable(int(self.bits), self.group)

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        self._need_state()
        if not self._mlx_layout():
            return super().scores(q, packed)
        if not self.reorder:
            return self._mlx(packed, q, transpose=True)
        b, h, m, d = q.shape
        perm = self.perm.astype(mx.int32)
        # q~[b, j, (h, m), i] = q[b, h, m, perm % D] where slot j*D+i belongs to head h, else 0
        spread = mx.take_along_axis(q, (perm % d)[:, None, None, :], axis=-1)  # (B, H, M, H*D)
        own = (perm // d)[:, None, None, :] == mx.arange(h)[None, :, None, None]
        qt = mx.where(own, spread, 0.0).reshape(b, h, m, h, d)
        qt = mx.transpose(qt, (0, 3, 1, 2, 4)).reshape(b, h, h * m, d)  # (B, J, H*M, D)
        s = mx.sum(self._mlx(packed, qt, transpose=True), axis=1)  # (B, H*M, T)
        return s.reshape(b, h, m, -1)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        self._need_state()
        if not self._mlx_layout():
            return super().mix(w, packed)
        if not self.reorder:
            return self._mlx(packed, w, transpose=False)
        b, h, m, t = w.shape
        wj = mx.broadcast_to(w.reshape(b, 1, h * m, t), (b, h, h * m, t))
        r = self._mlx(packed, wj, transpose=False)  # (B, J, H*M, D): every chunk, every row
        d = r.shape[-1]
        r = mx.swapaxes(r, 1, 2).reshape(b, h, m, h * d)  # slot j*D+i on the last axis
        pos = slots(self.perm).reshape(b, h, 1, d)
        return mx.take_along_axis(r, mx.broadcast_to(pos, (b, h, m, d)), axis=-1)
