"""Reading AnchorKV's records: the key and value sides of the compressed prompt's segment.

A side's record (:class:`velox_core.Packed`, one block of the prompt's ``S`` tokens) holds
what is resident, nothing else:

* ``index`` ``(B, H, S)`` int16 (int32 past 32,767 anchors): each token's anchor;
* ``gamma`` ``(B, H, S)`` float16: each token's coefficient on it;
* ``anchors`` ``(B, H, 1, k, D)`` in the cache's dtype: the anchor vectors (keys pre-RoPE);
* ``codes`` ``(B, 1, 1, N, words)`` uint32, ``scale`` ``(B, 1, 1, N)`` float16 and ``slot``
  ``(B, 1, 1, N)`` int32 (``head * S + token``): the ``N`` residuals of the layer, pooled
  across its KV heads (absent when ``N = 0``); a key's residual is coded before RoPE, as
  its anchor and coefficient are.

Attention reads them without a resident fp16 copy. Values are mixed through the anchors:
``Σ_t p_t γ_t a_idx(t)`` is the weights times ``γ`` scatter-added onto the ``k`` anchors, then
one ``(k, D)`` product; the residuals are mixed with their tokens' weights in their Hadamard
domain (``level · scale``, one table gather) and the ``(M, D)`` sum rotated back once. Keys
need RoPE at each token's own position, so a step rebuilds them transiently (``γ a``
gathered, the residuals decoded and added, one fused rotation) for its scores and drops them:
the reference path.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.codec.prerope import PreRope
from velox_core.ops.rope import fast_rotate

from .anchors import gather_rows
from .residual import ResidualCodec

__all__ = ["AnchorKeys", "AnchorValues"]

PER_BLOCK = frozenset({"anchors", "codes", "scale", "slot"})


class AnchorSide(Codec):
    """One side's reader (see the module). ``bits`` and ``seed`` set its residual codec; a
    record is made by :func:`velox_anchorkv.compress.compress_prompt`, which needs both sides
    and the observation queries, never by :meth:`encode` alone."""

    name = "anchorkv"
    side = "values"

    def __init__(self, bits: int = 2, seed: int = 0):
        self.bits, self.seed = bits, seed
        self._res: dict[int, ResidualCodec] = {}

    def config(self) -> dict[str, Any]:
        return {"bits": self.bits, "seed": self.seed}

    def residual_codec(self, dim: int) -> ResidualCodec:
        """The residual codec of heads of ``dim`` channels (made once)."""
        if dim not in self._res:
            self._res[dim] = ResidualCodec(dim, self.bits, self.seed)
        return self._res[dim]

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        raise TypeError(
            "anchorkv codes a whole prompt at once, keys and values together with the "
            "observation queries (velox_anchorkv.compress_prompt); a side alone has no encode"
        )

    def record(self, proj, codes, scale, slot) -> Packed:
        """The side's record from its projection and its residuals (see the module)."""
        s = proj.index.shape[2]
        k = proj.anchors.shape[2]
        data = {
            "index": proj.index.astype(mx.int16 if k <= 32767 else mx.int32),
            "gamma": proj.gamma,
            "anchors": mx.expand_dims(proj.anchors, 2),
        }
        if slot.shape[-1]:
            data["codes"] = codes[:, None, None]
            data["scale"] = scale[:, None, None]
            data["slot"] = slot.astype(mx.int32)[:, None, None]
        return Packed(data, s, block=s, per_block=PER_BLOCK & set(data))

    def coded(self, packed: Packed) -> tuple[mx.array, mx.array] | None:
        """The residuals in their rotated domain (levels times scales, float32
        ``(B, N, D)``) and their slots ``(B, N)``, or None."""
        if "slot" not in packed.data:
            return None
        codec = self.residual_codec(packed.data["anchors"].shape[-1])
        y = codec.levels(packed.data["codes"][:, 0, 0], packed.data["scale"][:, 0, 0])
        return y, packed.data["slot"][:, 0, 0]

    def base(self, packed: Packed) -> mx.array:
        """``γ a`` of every token, as projected (keys before RoPE), float32 ``(B, H, S, D)``."""
        a = packed.data["anchors"][:, :, 0].astype(mx.float32)
        gamma = packed.data["gamma"].astype(mx.float32)[..., None]
        return gather_rows(a, packed.data["index"]) * gamma

    def add_residuals(self, x: mx.array, packed: Packed) -> mx.array:
        """``x`` ``(B, H, S, D)`` with each stored residual added at its token."""
        coded = self.coded(packed)
        if coded is None:
            return x
        y, slot = coded
        r = self.residual_codec(x.shape[-1]).rotation.inverse(y)
        b, h, s, d = x.shape
        flat = slot + (mx.arange(b, dtype=mx.int32) * (h * s))[:, None]
        return x.reshape(b * h * s, d).at[flat].add(r).reshape(b, h, s, d)


class AnchorValues(AnchorSide):
    """The value side: decoded as ``γ a`` plus its residual, mixed through the anchors."""

    compressed_mix = True

    def decode(self, packed: Packed) -> mx.array:
        return self.add_residuals(self.base(packed), packed)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w @ v_hat`` without rebuilding the values (see the module): the residuals are
        mixed in their rotated domain and the sum rotated back once.

        Shapes: w ``(B, H, M, S)`` float32; returns float32 ``(B, H, M, Dv)``.
        """
        a = packed.data["anchors"][:, :, 0].astype(mx.float32)  # (B, H, k, D)
        b, h, k, _ = a.shape
        m, s = w.shape[2], w.shape[3]
        wg = w * packed.data["gamma"].astype(mx.float32)[:, :, None, :]
        flat = packed.data["index"].astype(mx.int32) + (
            mx.arange(b * h, dtype=mx.int32) * k
        ).reshape(b, h, 1)
        rows = mx.swapaxes(wg, 2, 3).reshape(b * h * s, m)
        onto = mx.zeros((b * h * k, m), dtype=mx.float32).at[flat.reshape(-1)].add(rows)
        out = mx.swapaxes(onto.reshape(b, h, k, m), 2, 3) @ a
        coded = self.coded(packed)
        if coded is None:
            return out
        y, slot = coded  # (B, N, D), (B, N)
        g = mx.take_along_axis(mx.swapaxes(w, 1, 2).reshape(b, m, h * s), slot[:, None], -1)
        head = ((slot // s)[..., None] == mx.arange(h)).astype(mx.float32)  # (B, N, H)
        per_head = mx.swapaxes(g[..., None] * head[:, None], 2, 3)  # (B, M, H, N)
        mixed = self.residual_codec(a.shape[-1]).rotation.inverse(per_head @ y[:, None])
        return out + mx.swapaxes(mixed, 1, 2)


class AnchorKeys(PreRope, AnchorSide):
    """The key side: anchors and residuals are pre-RoPE; decoding applies RoPE at each
    token's position ``0 ... S-1`` (the prompt starts the sequence).

    Args:
        bits, seed: the residual codec's.
        rope_base, rope_traditional, rope_scale, rope_dims: the standalone RoPE settings
            (:mod:`velox_core.codec.prerope`).
    """

    rope_method = "anchorkv"
    side = "keys"

    def __init__(
        self,
        bits: int = 2,
        seed: int = 0,
        rope_base: float | None = None,
        rope_traditional: bool = False,
        rope_scale: float = 1.0,
        rope_dims: int | None = None,
    ):
        AnchorSide.__init__(self, bits, seed)
        self.init_rope(rope_base, rope_traditional, rope_scale, rope_dims)

    def config(self) -> dict[str, Any]:
        return {**AnchorSide.config(self), **self.rope_config()}

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        if model is not None:
            self.bind_rope(model, layer)

    def state(self) -> dict[str, mx.array]:
        return self.rope_state()

    def set_state(self, state: dict[str, mx.array]) -> None:
        rest = self.pop_rope_state(state)
        if rest:
            raise ValueError(f"anchorkv: unexpected key state {sorted(rest)}")

    def decode(self, packed: Packed) -> mx.array:
        """``R_t (γ a + r)`` of every token, float32 ``(B, H, S, D)``: built transiently for
        a step's scores (one fused rotation at the tokens' positions)."""
        x = self.add_residuals(self.base(packed), packed)
        return fast_rotate(x, mx.zeros((1,), dtype=mx.int32), self.rope_for(x.shape[-1]))
