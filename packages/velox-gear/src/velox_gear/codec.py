"""``GearCodec``: GEAR's codes, low-rank residual and sparse outliers for one side.

GEAR (arXiv 2403.05527) writes a block ``X`` of ``n_b`` tokens as ``D + L + S``:

1. **S, the outliers**: in each block and KV head the ``k = int(outliers * n_b * D / 2)``
   largest and the ``k`` smallest entries (signed, as the authors' code ranks them) are
   taken out; before quantizing they are replaced by the mean of their quantization group
   so that they do not stretch its range.
2. **D, the backbone**: the block is quantized by ``velox_core.Uniform`` at ``bits``: keys
   per channel (a group is the block's ``group`` tokens of one channel), values per token
   (``group`` channels of one token): KIVI's scheme, the backbone of the paper's GEAR.
3. **S, kept**: at each outlier the correction ``x - D`` is stored in fp16 with its index
   in the block (uint16), so ``D + S`` equals ``X`` at the outliers up to fp16 rounding.
4. **L, the residual**: ``R = X - D - S`` is approximated at rank ``rank`` by ``iters``
   power (subspace) iterations from a seeded random start: ``L = A B^T`` with ``A`` fp16
   ``(n_b, r)`` per token (orthonormal columns) and ``B`` fp16 ``(D, r)`` per block.

Attention reads the parts without decoding the block: ``q . x = q . D + (q B) . A +
sum_outliers q_c s``, and ``w . X = w . D + ((w A) B^T) + sparse``, block by block.

Deviations from the authors' code: outliers are ranked within one block of one KV head
(the code ranks each token's entries across all heads for values and each channel's along
the whole prefill for keys); every power iteration re-orthonormalizes (the code does so on
its last one only), from one seeded ``(D, r)`` start shared by every block (a sequence's
codes do not depend on its batch); one rank for prefill and decode blocks (the code: 4 and
2); the outliers' correction ``x - D`` is stored rather than ``x``, so the parts add; only
the KIVI backbone is built (not KCVT nor per-token uniform).
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed, Uniform
from velox_core.ops import scale_dtype
from velox_core.validation import check_choice, check_float, check_int

from .parts import grid, lowrank, outlier_index

__all__ = ["GearCodec"]

_INDEX_LIMIT = 1 << 16  # entries of one block addressable by the uint16 outlier indices


class GearCodec(Codec):
    """GEAR's codec for keys (``axis="channel"``) or values (``axis="token"``).

    Args:
        bits: backbone code width, 2 to 8.
        group: the block of tokens coded together (the paper's streaming buffer ``n_b``),
            also the backbone's group: tokens per key channel group, channels per value
            token group.
        axis: ``"channel"`` (KIVI's keys) or ``"token"`` (KIVI's values).
        rank: rank of the residual's approximation per block and head (0: none).
        outliers: fraction of each block's entries kept as sparse outliers, in ``[0, 0.5]``.
        iters: power iterations of the low-rank solver.
        seed: the random start of the power iterations.

    Packed layout (``P`` blocks, ``r`` rank, ``n = 2k`` outliers per block): the backbone's
    ``codes``, ``scale``, ``zero`` (``velox_core.Uniform``); ``lr_a`` fp16 ``(B, H, T, r)``;
    per block ``lr_b`` fp16 ``(B, H, P, D, r)``, ``sp_idx`` uint16 ``(B, H, P, n)`` (index in
    the block's ``n_b * D`` entries, token-major) and ``sp_val`` fp16 ``(B, H, P, n)``.
    """

    name = "gear"
    settings = ("bits", "group", "axis", "rank", "outliers", "iters", "seed")
    compressed_scores = True
    compressed_mix = True

    def __init__(
        self,
        bits: int = 2,
        group: int = 64,
        axis: str = "channel",
        rank: int = 4,
        outliers: float = 0.02,
        iters: int = 3,
        seed: int = 0,
    ):
        self.axis = check_choice("axis", axis, ("channel", "token"))
        self.base = Uniform(bits, group, axis)
        self.bits, self.group = self.base.bits, self.base.group
        self.rank = check_int("rank", rank, minimum=0)
        self.outliers = check_float("outliers", outliers, minimum=0.0, maximum=0.5)
        self.iters = check_int("iters", iters, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self.block = self.group

    def per_side(self, dim: int) -> int:
        """Outliers per sign, block and KV head: ``int(outliers * group * dim / 2)``."""
        return int(self.outliers * self.group * dim / 2 + 1e-6)

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        self.base.check(dim, dtype)
        if self.rank > min(self.group, dim):
            raise ValueError(
                f"gear: rank={self.rank} exceeds min(group={self.group}, head dim {dim})"
            )
        if self.group * dim > _INDEX_LIMIT:
            raise ValueError(
                f"gear: group={self.group} x head dim {dim} exceeds {_INDEX_LIMIT} entries "
                "(outlier indices are uint16)"
            )

    def _base(self, packed: Packed) -> Packed:
        data = {n: packed.data[n] for n in ("codes", "scale", "zero")}
        per_block = frozenset(data) - {"codes"} if self.axis == "channel" else frozenset()
        return Packed(data, packed.tokens, self.base.block, per_block)

    def _fill(self, x: mx.array) -> mx.array:
        """Each entry's quantization-group mean. Shapes: x, returns float32 ``(B, H, T, D)``."""
        b, h, t, d = x.shape
        g = self.group
        if self.axis == "channel":
            m = mx.mean(x.reshape(b, h, t // g, g, d), axis=3, keepdims=True)
            return mx.broadcast_to(m, (b, h, t // g, g, d)).reshape(x.shape)
        m = mx.mean(x.reshape(b, h, t, d // g, g), axis=-1, keepdims=True)
        return mx.broadcast_to(m, (b, h, t, d // g, g)).reshape(x.shape)

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        b, h, t, d = x.shape
        g, p, k, sdt = self.group, t // self.group, self.per_side(d), scale_dtype(x.dtype)
        xf = x.astype(mx.float32)
        data: dict[str, mx.array] = {}
        xq = xf
        if k:
            idx = outlier_index(xf.reshape(b, h, p, g * d), k)  # (B, H, P, 2k)
            hit = mx.zeros((b, h, p, g * d), mx.bool_)
            hit = mx.put_along_axis(hit, idx, mx.array(True), axis=-1)
            xq = mx.where(hit.reshape(x.shape), self._fill(xf), xf)
        base = self.base.encode(xq)
        resid = (xf - self.base.decode(base)).reshape(b, h, p, g * d)
        if k:
            val = mx.take_along_axis(resid, idx, axis=-1).astype(sdt)
            left = mx.take_along_axis(resid, idx, axis=-1) - val.astype(mx.float32)
            resid = mx.put_along_axis(resid, idx, left, axis=-1)  # fp16 rounding of S only
            data["sp_idx"], data["sp_val"] = idx.astype(mx.uint16), val
        if self.rank:
            a, bf = lowrank(resid.reshape(b, h, p, g, d), self.rank, self.iters, self.seed)
            data["lr_a"] = a.reshape(b, h, t, self.rank).astype(sdt)
            data["lr_b"] = bf.astype(sdt)
        data.update(base.data)
        per_block = frozenset({"lr_b", "sp_idx", "sp_val"} & set(data)) | base.per_block
        return Packed(data, t, g, per_block)

    # -- the three parts, read block by block ------------------------------------------------
    def _factors(self, packed: Packed) -> tuple[mx.array, mx.array] | None:
        """``A`` float32 ``(B, H, P, n_b, r)`` and ``B`` float32 ``(B, H, P, D, r)``, or None."""
        if "lr_a" not in packed.data:
            return None
        a, bf = packed.data["lr_a"], packed.data["lr_b"]
        b, h, t, r = a.shape
        a = a.astype(mx.float32).reshape(b, h, t // self.group, self.group, r)
        return a, bf.astype(mx.float32)

    def _sparse(self, packed: Packed, dim: int) -> tuple[mx.array, mx.array, mx.array] | None:
        """The outliers' tokens and channels int32 and corrections float32, each
        ``(B, H, P * n)`` (tokens counted from the record's start), or None."""
        if "sp_idx" not in packed.data:
            return None
        idx = packed.data["sp_idx"].astype(mx.int32)  # (B, H, P, n)
        b, h, p, n = idx.shape
        tok = idx // dim + (mx.arange(p) * self.group)[:, None]
        val = packed.data["sp_val"].astype(mx.float32)
        return tok.reshape(b, h, p * n), (idx % dim).reshape(b, h, p * n), val.reshape(b, h, -1)

    def decode(self, packed: Packed) -> mx.array:
        x = self.base.decode(self._base(packed))  # (B, H, T, D)
        b, h, _, d = x.shape
        if (f := self._factors(packed)) is not None:
            x = x + (f[0] @ mx.swapaxes(f[1], -1, -2)).reshape(x.shape)
        if (sp := self._sparse(packed, d)) is not None:
            tok, ch, val = sp
            x = x.at[(*grid(b, h), tok, ch)].add(val)
        return x

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        # q . D from the codes, + (q B) . A per block, + q_c * s at each outlier
        out = self.base.scores(q, self._base(packed))  # (B, H, M, T)
        b, h, m, t = out.shape
        if (f := self._factors(packed)) is not None:
            a, bf = f
            lr = (q[:, :, None] @ bf) @ mx.swapaxes(a, -1, -2)  # (B, H, P, M, n_b)
            out = out + mx.swapaxes(lr, 2, 3).reshape(b, h, m, t)
        if (sp := self._sparse(packed, q.shape[-1])) is not None:
            tok, ch, val = sp
            qc = mx.take_along_axis(q, mx.broadcast_to(ch[:, :, None], (b, h, m, ch.shape[-1])), -1)
            bi, hi, mi = grid(b, h, m)
            out = out.at[bi, hi, mi, tok[:, :, None]].add(qc * val[:, :, None])
        return out

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        # w . D from the codes, + ((w A) B^T) summed over blocks, + w_t * s at each outlier
        out = self.base.mix(w, self._base(packed))  # (B, H, M, D)
        b, h, m, t = w.shape
        if (f := self._factors(packed)) is not None:
            a, bf = f
            wg = mx.swapaxes(w.reshape(b, h, m, t // self.group, self.group), 2, 3)
            out = out + mx.sum((wg @ a) @ mx.swapaxes(bf, -1, -2), axis=2)
        if (sp := self._sparse(packed, out.shape[-1])) is not None:
            tok, ch, val = sp
            at = mx.broadcast_to(tok[:, :, None], (b, h, m, tok.shape[-1]))
            wt = mx.take_along_axis(w, at, -1)
            bi, hi, mi = grid(b, h, m)
            out = out.at[bi, hi, mi, ch[:, :, None]].add(wt * val[:, :, None])
        return out
