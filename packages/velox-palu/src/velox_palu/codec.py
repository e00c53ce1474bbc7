"""``PaluKeys`` and ``PaluValues``: a head group's low-rank latent (arXiv 2407.21118).

Palu factors each head group's key (and value) projection ``W_g`` (``gD x hidden``, the
``g`` KV heads of the group) as ``W_g ~ L_g R_g`` by an SVD whitened with the calibration
inputs, caches the latent ``h = x R_g^T`` (``r`` numbers per group and token) and rebuilds
``k = h L_g^T`` when attending. mlx-lm hands a cache the projected keys, not ``x``; but the
whitened SVD's rank-``r`` optimum is, for every input, the projection of the exact output
``y = x W_g^T`` onto the top-``r`` right-singular subspace ``U_r`` of the calibration outputs
(:mod:`velox_palu.fit` derives it; the tests check it). So the codec stores
``h = (y - b) U_r`` (orthonormal ``U_r``, ``b`` the projection's bias), which is Palu's latent
up to the fixed diagonal ``Sigma_r^(1/2)`` Palu splits between its factors, and rebuilds
``y ~ h U_r^T + b``: the same vectors Palu rebuilds, from the model's unmodified weights.

Keys arrive post-RoPE: each is turned back at its position first, and rebuilt keys are turned
forward again, one tile of tokens at a time inside attention (the paper's
reconstruct-then-RoPE; nothing rebuilt is kept). Values are never rebuilt: the attention
weights meet the latent first, ``p @ (h U_r^T) = (p @ h) U_r^T`` (the paper folds ``U_r``
into the output projection; velox, which leaves the model as it is, applies it to the
``r``-wide mix).

With ``bits`` the latent is quantized after a Hadamard rotation of the group's ``r``
dimensions (folded into the basis, ``U_r H``), per token, as Palu's low-rank-aware
quantization; the codes are ``velox_core.Uniform``'s.

Layout: a group's ``r`` latent dimensions are split over its ``g`` heads' rows of the record
(``r / g`` each), so the record has the cache's ``(B, H, T, ...)`` shape and holds exactly
the latent's bytes. Tokens of one record are consecutive (the cache codes them in order);
keys keep their positions, int32 ``(B, 1, T)``. Such a latent mixes a group's heads, so the
codecs take no retention policy (``per_head = False``).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from velox_core import Codec, Packed, Uniform
from velox_core.artifacts import LayerFit, bound_layer
from velox_core.codec.prerope import PreRope
from velox_core.ops import block_size, hadamard
from velox_core.ops.rope import fast_rotate as rope_at
from velox_core.validation import check_bits, check_choice, check_float, check_int

from .artifact import KIND, PaluBases
from .ranks import ALLOCATIONS, allocate

__all__ = ["PaluKeys", "PaluValues"]

TILE = 1024  # tokens rebuilt at a time inside attention


class _PaluLatent(LayerFit, Codec):
    kind = KIND
    side = "key"
    per_head = False  # a group's latent mixes its heads: no per-head retention
    settings = ("rank", "ratio", "allocation", "bits", "group", "artifact", "layer")

    def __init__(
        self,
        rank: int | None = None,
        ratio: float = 0.5,
        allocation: str = "fisher",
        bits: int | None = None,
        group: int | None = None,
        artifact: str | os.PathLike | None = None,
        layer: int | None = None,
    ):
        self.rank = None if rank is None else check_int(f"{self.side}_rank", rank, minimum=1)
        self.ratio = check_float("ratio", ratio, minimum=0.0, maximum=1.0, open_min=True)
        self.allocation = check_choice("allocation", allocation, ALLOCATIONS)
        self.bits = None if bits is None else check_bits(f"{self.side}_bits", bits, 2, 8)
        self.group = None if group is None else check_int("group", group, minimum=1)
        if group is not None and bits is None:
            raise ValueError("group (channels per quantization scale) needs bits")
        self.init_fit(artifact, layer)  # _fit: basis (G, gD, r) fp16, bias (H, D)

    # -- the model's artifact (LayerFit) -----------------------------------------------------
    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Find the artifact fitted for ``model`` and select this layer's basis (read again
        at ``check``)."""
        art = self.found(model, layer)
        if art is not None:
            self._select(art, None, None)

    def rank_of(self, art: PaluBases) -> int:
        """This layer's rank per group: the explicit one, or the allocation's."""
        basis = art.side(self.layer, self.side)[0]
        g, full = art.heads_per_group, int(basis.shape[1])
        step = g * (self.group or 1)
        if self.rank is not None:
            if self.rank % step or self.rank > full:
                raise ValueError(
                    f"palu: {self.side}_rank={self.rank} must be a multiple of {step} (heads per "
                    f"group {g}" + (f" x group {self.group}" if self.group else "") + f") and at "
                    f"most the group's {full} dimensions"
                )
            return self.rank
        if self.allocation == "fisher":
            if not art.fisher:
                raise ValueError(
                    "palu: allocation='fisher' needs an artifact fitted with Fisher information "
                    "(python -m velox_palu fit ... without --no-fisher); or pass "
                    "allocation='uniform'"
                )
            w = {
                (i, s): art.fisher[i][j] for i in art.layers for j, s in enumerate(("key", "value"))
            }
        else:
            w = {(i, s): 1.0 for i in art.layers for s in ("key", "value")}
        return allocate(w, full, self.ratio, step)[(self.layer, self.side)]

    def _select(self, art: PaluBases, heads: int | None, dim: int | None) -> dict[str, mx.array]:
        basis, _, bias = art.side(self.layer, self.side)
        g = art.heads_per_group
        if heads is not None and (heads != basis.shape[0] * g or basis.shape[1] != g * dim):
            raise ValueError(
                f"palu: layer {self.layer}'s bases are for {basis.shape[0] * g} KV heads of "
                f"{basis.shape[1] // g} channels, the cache holds {heads} heads of {dim}: they "
                "were fitted for another model"
            )
        self._check_layout(art)
        r = self.rank_of(art)
        u = basis[:, :, :r].astype(mx.float32)  # (G, gD, r)
        if self.bits is not None:  # Palu's Hadamard on the latent, folded into the basis
            u = hadamard(u, block_size(r))
        out = {"basis": u.astype(mx.float16)}
        if bias is not None:
            out["bias"] = bias.astype(mx.float16)
        return out

    def _check_layout(self, art: PaluBases) -> None:  # keys check their RoPE
        pass

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if self._fit is None:
            art = self.record("bases", "Palu projects onto bases")
            self._fit = self._select(art, None, None)
        full = self._fit["basis"].shape[1]
        if full % dim:
            raise ValueError(
                f"palu: bases of {full}-channel groups, the cache holds {dim}-dim heads"
            )

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        return {} if self._fit is None else dict(self._fit)

    def set_state(self, state: dict[str, mx.array]) -> None:
        state = dict(state)
        if not state:
            self._fit = None
            return
        if not set(state) <= {"basis", "bias"} or "basis" not in state or state["basis"].ndim != 3:
            raise ValueError(f"{self.name}: state must hold basis (G, gD, r) and optionally bias")
        self._fit = state

    @property
    def width(self) -> int:
        """Latent dimensions per group ``r``."""
        return int(self._fit["basis"].shape[2])

    # -- coding ------------------------------------------------------------------------------
    def _quantizer(self, chunk: int) -> Uniform:
        return Uniform(self.bits, self.group or chunk)

    def _project(self, y: mx.array) -> dict[str, mx.array]:
        """Latent rows of vectors. Shapes: y float32 ``(B, H, T, D)``; returns arrays
        ``(B, H, T, ...)``: the group's ``r`` dimensions, ``r / g`` per head."""
        b, h, t, d = y.shape
        basis = self._fit["basis"]
        groups = basis.shape[0]
        g = basis.shape[1] // d
        if groups * g != h:
            raise ValueError(f"palu: bases for {groups * g} KV heads, the cache holds {h}")
        if "bias" in self._fit:
            y = y - self._fit["bias"].astype(mx.float32)[None, :, None]
        yg = y.reshape(b, groups, g, t, d).transpose(0, 1, 3, 2, 4).reshape(b, groups, t, g * d)
        lat = yg @ basis.astype(mx.float32)  # (B, G, T, r)
        c = self.width // g
        rows = lat.reshape(b, groups, t, g, c).transpose(0, 1, 3, 2, 4).reshape(b, h, t, c)
        if self.bits is None:
            return {"latent": rows.astype(mx.float16)}
        return self._quantizer(c).encode(rows).data

    def latent(self, packed: Packed) -> mx.array:
        """The groups' latents. Shapes: returns float32 ``(B, G, T, r)``."""
        p = packed.data
        groups = self._fit["basis"].shape[0]
        g = self.heads(packed) // groups
        if self.bits is None:
            rows = p["latent"].astype(mx.float32)
        else:
            sub = Packed({k: p[k] for k in ("codes", "scale", "zero")}, packed.tokens)
            rows = self._quantizer(self.width // g).decode(sub)
        b, _, t, c = rows.shape
        return (
            rows.reshape(b, groups, g, t, c).transpose(0, 1, 3, 2, 4).reshape(b, groups, t, g * c)
        )

    def rebuild(self, packed: Packed, heads: int) -> mx.array:
        """``h U_r^T + b``, float32 ``(B, H, T, D)`` (pre-RoPE keys, or values)."""
        lat = self.latent(packed)
        b, groups, t, _ = lat.shape
        basis = self._fit["basis"]
        g = heads // groups
        d = basis.shape[1] // g
        y = lat @ mx.swapaxes(basis.astype(mx.float32), -1, -2)  # (B, G, T, gD)
        y = y.reshape(b, groups, t, g, d).transpose(0, 1, 3, 2, 4).reshape(b, heads, t, d)
        if "bias" in self._fit:
            y = y + self._fit["bias"].astype(mx.float32)[None, :, None]
        return y

    @staticmethod
    def heads(packed: Packed) -> int:
        return next(iter(packed.data.values())).shape[1]


class PaluValues(_PaluLatent):
    """Palu's value codec. Args: see :class:`PaluKeys` (no RoPE).

    Packed layout (``r`` dimensions per group of ``g`` heads, ``c = r / g``): ``latent``
    float16 ``(B, H, T, c)``; with ``bits``, ``velox_core.Uniform``'s ``codes`` uint32
    ``(B, H, T, ceil(c * bits / 32))`` and fp16 ``scale`` and ``zero`` ``(B, H, T, c / group)``.
    State: ``basis`` fp16 ``(G, gD, r)``, ``bias`` fp16 ``(H, D)`` where the projection has one.
    """

    name = "palu-value"
    side = "value"
    compressed_mix = True

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        self.check(x.shape[-1], x.dtype)
        return Packed(self._project(x.astype(mx.float32)), x.shape[2])

    def decode(self, packed: Packed) -> mx.array:
        return self.rebuild(packed, self.heads(packed))

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``(w @ h) U_r^T (+ sum(w) b)`` per head, never rebuilding a value.

        Shapes: w ``(B, H, M, T)`` float32; returns float32 ``(B, H, M, D)``.
        """
        b, h, m, t = w.shape
        lat = self.latent(packed)  # (B, G, T, r)
        basis = self._fit["basis"].astype(mx.float32)  # (G, gD, r)
        groups = basis.shape[0]
        g = h // groups
        d = basis.shape[1] // g
        wl = w.reshape(b, groups, g, m, t) @ lat[:, :, None]  # (B, G, g, M, r)
        per_head = mx.swapaxes(basis.reshape(groups, g, d, basis.shape[2]), -1, -2)  # (G,g,r,D)
        out = (wl @ per_head).reshape(b, h, m, d)
        if "bias" in self._fit:
            bias = self._fit["bias"].astype(mx.float32)[None, :, None]
            out = out + mx.sum(w, axis=-1, keepdims=True) * bias
        return out


class PaluKeys(PreRope, _PaluLatent):
    """Palu's key codec.

    Args:
        rank: latent dimensions per head group (None: from ``ratio`` and ``allocation``).
        ratio: kept fraction of all key and value dimensions of the model (Palu's
            ``param_ratio_target``), allocated over layers by ``allocation``.
        allocation: ``"fisher"`` (Palu's Fisher-information rank search, from the artifact)
            or ``"uniform"``.
        bits: quantize the latent to this many bits after a Hadamard rotation (None: fp16).
        group: latent channels per quantization scale (None: a head's whole share ``r / g``).
        artifact: path of the Palu artifact; None finds the model's at ``bind``.
        layer: the model layer (set by ``bind``).
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone codec
            (:class:`~velox_core.codec.prerope.PreRope`), by name only.

    Packed layout: as :class:`PaluValues`, plus ``pos`` int32 ``(B, 1, T)``.
    """

    name = "palu-key"
    rope_method = "palu"
    side = "key"

    def __init__(
        self,
        *latent: Any,
        rope_base: float | None = None,
        rope_traditional: bool = False,
        rope_scale: float = 1.0,
        rope_dims: int | None = None,
        **settings: Any,
    ):
        # latent, settings: rank ... layer, positional or by name, as PaluValues takes them
        super().__init__(*latent, **settings)
        self.init_rope(rope_base, rope_traditional, rope_scale, rope_dims)

    def config(self) -> dict[str, Any]:
        return {**super().config(), **self.rope_config()}

    def fresh(self):
        out = super().fresh()
        out._rope = self._rope
        return out

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        if bound_layer(self, model, layer):
            self.bind_rope(model, self.layer)
        super().bind(model, layer)

    def _check_layout(self, art: PaluBases) -> None:
        if self._rope is not None and art.layouts[self.layer] != self._rope.layout:
            raise ValueError(
                f"palu: layer {self.layer}'s key bases were fitted under the RoPE pair layout "
                f"[dims, traditional] = {art.layouts[self.layer]}, this cache's RoPE has "
                f"{self._rope.layout}"
            )

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        self.rope_for(dim)
        super().check(dim, dtype)

    def state(self) -> dict[str, mx.array]:
        out = super().state()
        return {**out, **self.rope_state()} if out else out

    def set_state(self, state: dict[str, mx.array]) -> None:
        super().set_state(self.pop_rope_state(state))

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        b, _, t, d = x.shape
        pos = self.key_positions(positions, b, t)
        self.check(d, x.dtype)
        # one rotation offset per row: the block's positions are consecutive
        data = self._project(rope_at(x, pos[:, 0, 0], self._rope, inverse=True))
        data["pos"] = pos
        return Packed(data, t)

    def decode(self, packed: Packed) -> mx.array:
        y = self.rebuild(packed, self.heads(packed))
        return rope_at(y, packed.data["pos"][:, 0, 0], self._rope)

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ k^T``, the keys rebuilt and rotated ``TILE`` tokens at a time.

        Shapes: q ``(B, H, M, D)`` float32, scale applied; returns float32 ``(B, H, M, T)``.
        """
        n = packed.tokens
        parts = [
            q @ mx.swapaxes(self.decode(packed.slice(s, min(s + TILE, n))), -1, -2)
            for s in range(0, n, TILE)
        ]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
