"""Reading AnchorKV's records: the key and value sides of the compressed prompt's segment.

A side's record (:class:`velox_core.Packed`, one block of the prompt's ``S`` tokens) holds
what is resident, nothing else:

* ``index`` ``(B, H, S)`` int16 (int32 past 32,767 anchors): each token's anchor;
* ``gamma`` ``(B, H, S)`` float16: each token's coefficient on it;
* ``anchors`` ``(B, H, 1, k, D)`` in the cache's dtype: the anchor vectors (keys pre-RoPE);
* ``codes`` ``(B, 1, 1, N, words)`` uint32, ``scale`` ``(B, 1, 1, N)`` float16 and ``slot``
  ``(B, 1, 1, N)`` int32 (``head * S + token``): the ``N`` residuals of the layer, pooled
  across its KV heads (absent when ``N = 0``).

Attention reads them without a resident fp16 copy. Values are mixed through the anchors:
``Σ_t p_t γ_t a_idx(t)`` is the weights times ``γ`` scatter-added onto the ``k`` anchors, then
one ``(k, D)`` product, plus each residual's weight times its decoded residual. Keys need RoPE
at each token's own position, so a step rebuilds them transiently (``γ a`` gathered, the
residuals added, RoPE applied) and drops them after its scores: the reference path.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.codec.prerope import PreRope

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

    def residuals(self, packed: Packed) -> tuple[mx.array, mx.array] | None:
        """The decoded residuals ``(B, N, D)`` float32 and their slots ``(B, N)``, or None."""
        if "slot" not in packed.data:
            return None
        dim = packed.data["anchors"].shape[-1]
        codes = packed.data["codes"][:, 0, 0]
        r = self.residual_codec(dim).decode(codes, packed.data["scale"][:, 0, 0])
        return r, packed.data["slot"][:, 0, 0]

    def rebuild(self, packed: Packed) -> mx.array:
        """``γ a`` plus the stored residuals, as projected (keys pre-RoPE), float32
        ``(B, H, S, D)``."""
        a = packed.data["anchors"][:, :, 0].astype(mx.float32)
        x = (
            gather_rows(a, packed.data["index"])
            * packed.data["gamma"].astype(mx.float32)[..., None]
        )
        res = self.residuals(packed)
        if res is None:
            return x
        r, slot = res
        b, h, s, d = x.shape
        flat = slot + (mx.arange(b, dtype=mx.int32) * (h * s))[:, None]
        return x.reshape(b * h * s, d).at[flat].add(r).reshape(b, h, s, d)


class AnchorValues(AnchorSide):
    """The value side: decoded as :meth:`rebuild`, mixed through the anchors."""

    compressed_mix = True

    def decode(self, packed: Packed) -> mx.array:
        return self.rebuild(packed)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w @ v_hat`` without rebuilding the values (see the module).

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
        res = self.residuals(packed)
        if res is None:
            return out
        r, slot = res  # (B, N, D), (B, N)
        g = mx.take_along_axis(mx.swapaxes(w, 1, 2).reshape(b, m, h * s), slot[:, None], -1)
        head = (slot // s)[..., None] == mx.arange(h)  # (B, N, H)
        per_head = g[..., None] * head[:, None].astype(mx.float32)  # (B, M, N, H)
        extra = mx.swapaxes(per_head, 2, 3) @ r[:, None]  # (B, M, H, D)
        return out + mx.swapaxes(extra, 1, 2)


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
        x = self.rebuild(packed)
        return self.rerotate(x, mx.arange(x.shape[2], dtype=mx.int32))
