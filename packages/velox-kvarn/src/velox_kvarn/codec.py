"""``KVarNKeys`` and ``KVarNValues``: KVarN's tile codes of keys and of values.

KVarN (arXiv 2606.03458) codes a tile of ``group`` tokens of one KV head at a time:

1. the channels are rotated, ``y = H x`` (:class:`HadamardRotation`);
2. the tile ``Y`` (``G x D``) is balanced, ``B = Y / (t c^T)``, by the iterated dual-scaling
   variance normalization of :func:`velox_kvarn.normalize.normalize` (``t`` per token, ``c``
   per channel);
3. ``B`` is rounded to nearest, asymmetric (a step and a minimum), at ``bits``: keys per
   channel over the tile's tokens (KIVI's key axis), values per token over its channels;
4. each rounding's step and minimum are absorbed into the normalization scale of the same
   axis, and stored in fp16 (bf16 for bf16 models) with the other axis's scale.

So a key is ``y_td = t_t (a_d q_td + z_d)`` with ``a = c * step``, ``z = c * min`` per
channel and tile, and a value ``y_td = c_d (b_t q_td + w_t)`` with ``b = t * step``,
``w = t * min`` per token. Stored per tile: keys ``D`` codes a token, ``t`` (a scale a token),
``a`` and ``z`` (``D`` each); values ``D`` codes a token, ``b`` and ``w`` (one each a token),
``c`` (``D``): the authors' layout, ``(2 D + G)`` fp16 numbers a tile and side.

Attention reads the codes, tile by tile and batched over the tiles. Scores: the query is
rotated once, each tile's channel scales ``a`` are folded into it, the codes are read by
``mx.quantized_matmul`` with the token scales ``t`` as its per-token scale, and
``t_t (Hq . z)`` is added. Mix: the weights of each tile read the value codes by
``mx.quantized_matmul`` (per-token ``b``, ``w``), the tile's channel scales ``c`` multiply the
result, the tiles are summed and rotated back once. No whole fp16 copy of the cache is built.
Where MLX's layout does not apply (head dims other than 32, 64 or 128, 7-bit codes, MLX's CUDA
backend), the codes are unpacked tile-batched to float32 and multiplied the same way.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.codec.hadamard import HadamardRotated
from velox_core.ops import affine_matmul, mlx_readable, pack, scale_dtype, unpack
from velox_core.validation import check_bits, check_int

from .normalize import normalize
from .rotation import HadamardRotation

__all__ = ["MAX_ITERS", "KVarNKeys", "KVarNValues"]

MAX_ITERS = 64  # normalization iterations allowed (the authors run 8 or 16)
_MIN_STEP = 1e-10  # the rounding step of a constant row (the reference's clamp)


class _KVarN(HadamardRotated, Codec):
    """What both sides share: settings, the rotation, the tile pipeline up to the codes.

    Args:
        bits: code width, 2 to 8.
        group: tokens per tile (at least 2: a deviation over the tile's tokens needs two).
        iters: normalization iterations, 0 to ``MAX_ITERS`` (0: rotation and rounding only).
        seed: None for the Sylvester Hadamard rotation (the paper's), or a seed of random
            signs.
    """

    side: str = ""
    per_tile: frozenset[str] = frozenset()  # the stored scales kept per tile, not per token
    settings = ("bits", "group", "iters", "seed")
    compressed_scores = True
    compressed_mix = True

    def __init__(self, bits: int = 4, group: int = 128, iters: int = 8, seed: int | None = None):
        self.bits = check_bits("bits", bits, minimum=2, maximum=8)
        self.group = check_int("group", group, minimum=2)
        self.iters = check_int("iters", iters, minimum=0, maximum=MAX_ITERS)
        self.seed = None if seed is None else check_int("seed", seed, minimum=0)
        self.block = self.group
        self.rotation: HadamardRotation | None = None

    # -- set-up and state -------------------------------------------------------------------
    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if dim % 2:
            raise ValueError(f"kvarn: head dim {dim} is odd: no Hadamard block divides it")
        self._ready(dim)

    # -- coding ------------------------------------------------------------------------------
    def _tiles(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
        """Rotate, normalize and round ``x`` ``(B, H, T, D)``: the codes uint8 ``(B, H, P, G,
        D)``, the log scales ``(.., G, 1)`` and ``(.., 1, D)``, the rounding step and minimum
        (keys ``(.., 1, D)``, values ``(.., G, 1)``), all float32."""
        b, h, t, d = x.shape
        y = self._ready(d).forward(x).reshape(b, h, t // self.group, self.group, d)
        log_tok, log_chan = normalize(y, self.iters, self.side)
        bal = y * mx.exp(-(log_tok + log_chan))
        axis = -2 if self.side == "key" else -1  # keys per channel, values per token
        lo = mx.min(bal, axis=axis, keepdims=True)
        qmax = (1 << self.bits) - 1
        step = mx.maximum((mx.max(bal, axis=axis, keepdims=True) - lo) / qmax, _MIN_STEP)
        codes = mx.clip(mx.round((bal - lo) / step), 0, qmax).astype(mx.uint8)
        return codes, log_tok, log_chan, step, lo

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        b, h, t, d = x.shape
        codes, log_tok, log_chan, step, lo = self._tiles(x)
        scales = self._scales(mx.exp(log_tok), mx.exp(log_chan), step, lo)
        sdt = scale_dtype(x.dtype)
        data = {"codes": pack(codes.reshape(b, h, t, d), self.bits)}
        data.update((name, a.astype(sdt)) for name, a in scales.items())
        return Packed(data, t, self.group, self.per_tile)

    def _scales(self, tok, chan, step, lo) -> dict[str, mx.array]:
        """The side's stored scales by name, float32, from the token scales ``tok`` ``(B, H, P,
        G, 1)``, the channel scales ``chan`` ``(B, H, P, 1, D)`` and :meth:`_tiles`' rounding
        step and minimum: per token ``(B, H, T, 1)``, or per tile ``(B, H, P, D)`` for those
        named in :attr:`per_tile`."""
        raise NotImplementedError

    def _codes(self, packed: Packed, dim: int) -> mx.array:
        """The codes as float32 tiles ``(B, H, P, G, D)``."""
        c = unpack(packed.data["codes"], self.bits, dim).astype(mx.float32)
        b, h, t, _ = c.shape
        return c.reshape(b, h, t // self.group, self.group, dim)

    def _words(self, packed: Packed) -> mx.array:
        """The packed codes as tiles ``(B, H, P, G, words)``."""
        w = packed.data["codes"]
        b, h, t, n = w.shape
        return w.reshape(b, h, t // self.group, self.group, n)

    def _per_token(self, packed: Packed, name: str) -> mx.array:
        """A per-token scale as tiles ``(B, H, P, G, 1)`` in its stored dtype."""
        a = packed.data[name]
        return a.reshape(a.shape[0], a.shape[1], -1, self.group, 1)

    def rotated(self, packed: Packed) -> mx.array:
        """The reconstruction in the rotated domain, ``H x_hat``: float32 ``(B, H, T, D)``."""
        raise NotImplementedError

    def decode(self, packed: Packed) -> mx.array:
        y = self.rotated(packed)
        return self._ready(y.shape[-1]).inverse(y)

    def decode_rotated_as(self, packed: Packed, dtype: mx.Dtype) -> mx.array:
        return self.rotated(packed).astype(dtype)


class KVarNKeys(_KVarN):
    """KVarN's key codec (arguments: see ``_KVarN``).

    Packed layout (head dim ``D``, ``P`` tiles): per token ``codes`` uint32
    ``(ceil(D*bits/32),)`` and ``tok`` ``(1,)``; per tile ``scale`` and ``zero`` ``(D,)``;
    scales fp16 (bf16 for bf16 input).
    """

    name = "kvarn-key"
    side = "key"
    per_tile = frozenset({"scale", "zero"})

    def _scales(self, tok, chan, step, lo) -> dict[str, mx.array]:
        tok = tok.reshape(*tok.shape[:2], -1, 1)
        return {"tok": tok, "scale": (chan * step).squeeze(-2), "zero": (chan * lo).squeeze(-2)}

    def rotated(self, packed: Packed) -> mx.array:
        p = packed.data
        d = p["scale"].shape[-1]
        a, z = (p[n].astype(mx.float32)[:, :, :, None, :] for n in ("scale", "zero"))
        tok = self._per_token(packed, "tok").astype(mx.float32)
        y = (self._codes(packed, d) * a + z) * tok
        return y.reshape(*y.shape[:2], packed.tokens, d)

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ k_hat.T`` from the codes. Shapes: q ``(B, H, M, D)``; returns ``(B, H, M, T)``."""
        p = packed.data
        d = p["scale"].shape[-1]
        qr = self._ready(d).forward(q)[:, :, None]  # (B, H, 1, M, D)
        qa = qr * p["scale"].astype(mx.float32)[:, :, :, None, :]  # (B, H, P, M, D)
        bias = mx.sum(qr * p["zero"].astype(mx.float32)[:, :, :, None, :], -1, keepdims=True)
        tok = self._per_token(packed, "tok")  # (B, H, P, G, 1)
        if mlx_readable(self.bits, d):  # t_t (qa . q_t): the token scale as MLX's scale
            dots = affine_matmul(
                qa, self._words(packed), tok, mx.zeros_like(tok), self.bits, d, True
            )
            out = dots + bias * mx.swapaxes(tok, -1, -2).astype(mx.float32)
        else:
            c = self._codes(packed, d)
            out = (qa @ mx.swapaxes(c, -1, -2) + bias) * mx.swapaxes(tok, -1, -2).astype(mx.float32)
        b, h, m = q.shape[:3]
        return mx.swapaxes(out, 2, 3).reshape(b, h, m, packed.tokens)


class KVarNValues(_KVarN):
    """KVarN's value codec (arguments: see ``_KVarN``).

    Packed layout (head dim ``D``, ``P`` tiles): per token ``codes`` uint32
    ``(ceil(D*bits/32),)``, ``scale`` and ``zero`` ``(1,)``; per tile ``chan`` ``(D,)``;
    scales fp16 (bf16 for bf16 input).
    """

    name = "kvarn-value"
    side = "value"
    per_tile = frozenset({"chan"})

    def _scales(self, tok, chan, step, lo) -> dict[str, mx.array]:
        scale, zero = ((tok * a).reshape(*tok.shape[:2], -1, 1) for a in (step, lo))
        return {"scale": scale, "zero": zero, "chan": chan.squeeze(-2)}

    def rotated(self, packed: Packed) -> mx.array:
        d = packed.data["chan"].shape[-1]
        s, z = (self._per_token(packed, n).astype(mx.float32) for n in ("scale", "zero"))
        chan = packed.data["chan"].astype(mx.float32)[:, :, :, None, :]
        y = (self._codes(packed, d) * s + z) * chan
        return y.reshape(*y.shape[:2], packed.tokens, d)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w @ v_hat`` from the codes. Shapes: w ``(B, H, M, T)``; returns ``(B, H, M, D)``."""
        d = packed.data["chan"].shape[-1]
        b, h, m, t = w.shape
        wg = mx.swapaxes(w.reshape(b, h, m, t // self.group, self.group), 2, 3)  # (B,H,P,M,G)
        s, z = self._per_token(packed, "scale"), self._per_token(packed, "zero")
        if mlx_readable(self.bits, d):
            out = affine_matmul(wg, self._words(packed), s, z, self.bits, d, False)
        else:
            s, z = s.astype(mx.float32), z.astype(mx.float32)
            out = (wg * mx.swapaxes(s, -1, -2)) @ self._codes(packed, d) + wg @ z
        out = out * packed.data["chan"].astype(mx.float32)[:, :, :, None, :]  # (B,H,P,M,D)
        return self._ready(d).inverse(mx.sum(out, axis=2))
