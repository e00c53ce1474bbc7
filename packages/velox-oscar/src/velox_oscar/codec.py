"""``OscarKeys`` and ``OscarValues``: OSCAR's rotated, clipped INT2 codes (arXiv 2605.17757).

A token's key (or value) of one KV head is coded as follows:

1. rotated by the layer's fitted rotation, ``y = x R`` (``R_K = U_Q H P_br`` for keys,
   ``R_V = U_S H P_br`` for values, :mod:`velox_oscar.rotation`); keys are post-RoPE, as the
   authors fit and apply their rotation (their calibration dump is taken at the attention
   kernel, after RoPE);
2. clipped token-wise: each row clamped at its ``clip``-ratio order statistic of ``|y|``;
3. quantized by ``velox_core.Uniform``: per token, groups of ``group`` channels (default the
   whole head, at most 128: the paper's 128-channel groups), each with an fp16 scale and
   minimum (the asymmetric min-max grid of the authors' kernel, ``x = scale * code + min``),
   codes bit-packed in MLX's layout.

Attention reads the codes through that layout: the query is rotated once per call
(``q . k = (q R_K) . (k R_K)``) and scored against the codes by ``mx.quantized_matmul`` (the
fused decode kernel on a GPU, :mod:`velox_oscar.kernels`); the attention weights mix the value
codes the same way and the ``(M, D)`` result is rotated back once (``o R_V^T``). A prefill
attends in the rotated domain (:meth:`stored_rotation`): no stored token is ever rotated
back.

Where the rotation and clip come from: the model's artifact (:mod:`velox_oscar.artifact`),
found by ``bind(model, layer)`` (``velox_core.make_cache`` calls it), or ``artifact=PATH`` with
``layer=i``. The layer's rotation is codec state, float16 (``D x D``, counted in ``nbytes``
and saved with the cache), with the fitted clip ratio where ``clip`` is not given.
``rotation="hadamard"`` replaces ``R`` by the normalized Sylvester Hadamard matrix (the
paper's ablation: a data-free rotation); it needs no artifact when ``clip`` is given.

``centre=True`` (keys only; not in the paper) takes each KV head's fitted mean key ``mu``
(the artifact's ``key_mean``) off every key before it is rotated and coded, ``y = (k - mu)
R_K``, with the clip ratio fitted for centred keys. Keys that share a large mean (Gemma 3's
global layers, SmolLM2's) make a per-token code spend its range on it; less it, the same 2
bits hold the keys with about half the error (docs/oscar.md). Nothing is lost: the codec
still answers for the keys themselves, ``scores`` adds each query's ``q . mu`` back (one
``(M, D) x (D,)`` product a call, so the coded tokens meet the exact sinks and window in one
softmax, learned sink logits included) and ``decode`` adds ``mu`` back; a prefill's
rotated keys get ``mu R_K`` added. The fused decode kernels score the codes against the
query alone, so they decline centred keys and the step takes the reference path. ``mu``
(float32 ``(H, D)``) is codec state, saved with the cache.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import mlx.core as mx

from velox_core import Codec, Packed, Uniform
from velox_core.artifacts import LayerFit
from velox_core.ops import HadamardRotation
from velox_core.validation import check_bits, check_bool, check_choice, check_float, check_int

from . import kernels as _kernels
from .artifact import KIND, OscarRotations
from .rotation import Rotation, quantile_clip

__all__ = ["BASES", "MAX_GROUP", "OscarKeys", "OscarValues", "default_group"]

BASES = ("oscar", "hadamard")
MAX_GROUP = 128  # the paper's quantization group along the head dim


def default_group(dim: int) -> int:
    """The group of ``group=None``: the whole head, at most :data:`MAX_GROUP` channels."""
    return min(dim, MAX_GROUP)


def check_head_dim(method: str, rotation: str, group: int | None, dim: int, side: str) -> None:
    """Raise ``ValueError`` naming ``method`` and the head dim where it cannot be coded."""
    if rotation == "oscar" and dim & (dim - 1):
        raise ValueError(
            f"{method}: {side} head dim {dim} is not a power of two (the Walsh-Hadamard and "
            "bit-reversal factors of OSCAR's rotation need one)"
        )
    if dim % 2:
        raise ValueError(f"{method}: {side} head dim {dim} is odd: no Hadamard block divides it")
    g = default_group(dim) if group is None else group
    if dim % g:
        raise ValueError(
            f"{method}: group={g} must divide the {side} head dim {dim} (each token is coded "
            "in groups of `group` channels)"
        )


class _OscarSide(LayerFit, Codec):
    kind = KIND
    side: ClassVar[str] = "key"
    settings = ("bits", "group", "clip", "rotation", "artifact", "layer", "centre")
    compressed_scores = True
    compressed_mix = True
    decodes_slices = True  # per-token codes (Uniform's) in a fixed basis

    def __init__(
        self,
        bits: int = 2,
        group: int | None = None,
        clip: float | None = None,
        rotation: str = "oscar",
        artifact: str | os.PathLike | None = None,
        layer: int | None = None,
        centre: bool = False,
    ):
        self.bits = check_bits(f"{self.side}_bits", bits, 2, 8)
        self.centre = check_bool("centre", centre)
        if self.centre and self.side != "key":
            raise ValueError(f"{self.name}: centre applies to keys only (OscarKeys)")
        self.group = None if group is None else check_int("group", group, minimum=1)
        self.clip = (
            None
            if clip is None
            else check_float(f"{self.side}_clip", clip, minimum=0.0, maximum=1.0, open_min=True)
        )
        self.rotation = check_choice("rotation", rotation, BASES)
        self.init_fit(artifact, layer)  # _fit: rotation (D, D) fp16, clip (1,) f32
        self._dim: int | None = None
        self._rot: Rotation | HadamardRotation | None = None
        self._q: Uniform | None = None
        self._ratio = 1.0
        self._mean: mx.array | None = None  # centre: mu (H, D) float32
        self._shift: mx.array | None = None  # centre: mu R (H, D) float32

    @property
    def needs_artifact(self) -> bool:
        """Whether the layer's rotation, clip ratio or key mean comes from a fitted artifact."""
        return self.rotation == "oscar" or self.clip is None or self.centre

    # -- the model's artifact (LayerFit) -----------------------------------------------------
    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Find the artifact fitted for ``model`` and read this layer's rotation and clip."""
        art = self.found(model, layer)
        if art is not None:
            self._fit = self._select(art)

    def _select(self, art: OscarRotations) -> dict[str, mx.array]:
        out = {}
        if self.rotation == "oscar":
            out["rotation"] = art.rotation(self.layer, self.side).astype(mx.float16)
        if self.clip is None:
            ratio = art.clip(self.layer, self.side, self.bits, self.rotation, self.centre)
            out["clip"] = mx.array([ratio], dtype=mx.float32)
        if self.centre:
            out["mean"] = art.key_mean(self.layer).astype(mx.float32)
        return out

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        check_head_dim("oscar", self.rotation, self.group, dim, self.side)
        if self.needs_artifact and self._fit is None:
            self._fit = self._select(self.record("rotations", "OSCAR rotates by bases"))
        self._ready(dim)

    def _ready(self, dim: int) -> None:
        if self._dim == dim:
            return
        if self.rotation == "oscar":
            r = self._fit["rotation"] if self._fit else mx.zeros((0, 0))
            if r.shape != (dim, dim):
                raise ValueError(
                    f"oscar: layer {self.layer}'s {self.side} rotation is {tuple(r.shape)}, the "
                    f"cache holds {dim}-dim heads: it was fitted for another model"
                )
            self._rot = Rotation(r)
        else:
            self._rot = HadamardRotation(dim)
        if self.clip is None and not (self._fit and "clip" in self._fit):
            raise ValueError(f"{self.name}: no clip ratio (the artifact was not read)")
        # the ratio as fitted (its float32 copy rounded back: ratios have a few digits)
        fitted = round(float(self._fit["clip"][0].item()), 6) if self.clip is None else None
        self._ratio = self.clip if fitted is None else fitted
        self._mean = self._shift = None
        if self.centre:
            mean = self._fit.get("mean") if self._fit else None
            if mean is None or mean.ndim != 2 or mean.shape[1] != dim:
                got = "none" if mean is None else tuple(mean.shape)
                raise ValueError(
                    f"oscar: layer {self.layer}'s key mean is {got}, the cache holds {dim}-dim "
                    "heads (centre=True needs the artifact's (H, D) key_mean)"
                )
            self._mean = mean.astype(mx.float32)
            self._shift = self._rot.forward(self._mean)
        self._q = Uniform(self.bits, self.group or default_group(dim))
        self._dim = dim

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        """The fitted arrays (``rotation``, ``clip``, ``mean``) and, once known, the head dim
        (``dim``, int32 ``(1,)``: a loaded cache's codes need it before any query)."""
        out = {} if self._fit is None else dict(self._fit)
        if self._dim is not None:
            out["dim"] = mx.array([self._dim], dtype=mx.int32)
        return out

    def set_state(self, state: dict[str, mx.array]) -> None:
        state = dict(state)
        dim = state.pop("dim", None)
        self._dim = self._rot = self._q = None
        if not state and dim is None:  # nothing read yet: check() reads the artifact
            self._fit = None
            return
        want = (
            ({"rotation"} if self.rotation == "oscar" else set())
            | ({"clip"} if self.clip is None else set())
            | ({"mean"} if self.centre else set())
        )
        if set(state) != want or (dim is not None and dim.shape != (1,)):
            raise ValueError(
                f"{self.name}: state must hold {sorted(want | {'dim'})} for {self.describe()}, "
                f"got {sorted(state)}"
            )
        r = state.get("rotation")
        if r is not None and (r.ndim != 2 or r.shape[0] != r.shape[1]):
            raise ValueError(f"{self.name}: rotation must be (D, D), got {tuple(r.shape)}")
        c = state.get("clip")
        if c is not None and (c.shape != (1,) or not 0.0 < float(c[0].item()) <= 1.0):
            raise ValueError(f"{self.name}: clip must hold one ratio in (0, 1]")
        m = state.get("mean")
        if m is not None and (m.ndim != 2 or not bool(mx.all(mx.isfinite(m)).item())):
            raise ValueError(f"{self.name}: mean must be a finite (H, D) array")
        self._fit = state
        if dim is not None:
            d = int(dim[0].item())
            check_head_dim("oscar", self.rotation, self.group, d, self.side)
            self._ready(d)

    def kernel_values(self, packed: Packed, dim: int):
        """The decode kernels' value side (GPU): :func:`velox_oscar.kernels.kernel_values`."""
        return _kernels.kernel_values(self, packed, dim)

    def kernel_keys(self, packed: Packed, q_shape, values):
        """The decode kernels' key side (GPU): :func:`velox_oscar.kernels.kernel_keys` (None
        for centred keys: the kernels score the codes against the query alone)."""
        return _kernels.kernel_keys(self, packed, q_shape, values)

    def stored_rotation(self) -> Rotation | HadamardRotation | None:
        return self._rot

    @property
    def ratio(self) -> float:
        """The clip ratio in use (the given ``clip``, or the fitted one once read)."""
        return self._ratio

    # -- coding ------------------------------------------------------------------------------
    def _heads(self, a: mx.array, h: int) -> mx.array:
        """A per-head ``(H, D)`` array (``mu`` or ``mu R``) shaped to broadcast over ``(B, h,
        T, D)``; ``ValueError`` where the cache holds another number of KV heads."""
        if a.shape[0] != h:
            raise ValueError(
                f"oscar: layer {self.layer}'s key mean was fitted for {a.shape[0]} KV heads, the "
                f"cache holds {h}"
            )
        return a[None, :, None, :]

    def _uncentre(self, y: mx.array, shift: mx.array | None) -> mx.array:
        """``y`` with the per-head ``shift`` added back (nothing without ``centre``)."""
        return y if shift is None else y + self._heads(shift, y.shape[1])

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Shapes: x ``(B, H, T, D)``."""
        self._ready(x.shape[-1])
        xc = x if self._mean is None else x.astype(mx.float32) - self._heads(self._mean, x.shape[1])
        y = quantile_clip(self._rot.forward(xc), self._ratio)
        # Uniform keeps its scales in bfloat16 for bfloat16 input, float16 otherwise
        return self._q.encode(y.astype(mx.bfloat16) if x.dtype == mx.bfloat16 else y)

    def decode_rotated_as(self, packed: Packed, dtype: mx.Dtype) -> mx.array:
        """``x_hat R`` (the stored, rotated vectors, ``mu R`` added back for centred keys) in
        ``dtype``."""
        y = self._q.decode_as(packed, dtype)
        return y if self._shift is None else self._uncentre(y, self._shift).astype(dtype)

    def decode(self, packed: Packed) -> mx.array:
        return self._uncentre(self._rot.inverse(self._q.decode(packed)), self._mean)

    def decode_as(self, packed: Packed, dtype: mx.Dtype) -> mx.array:
        x = self._rot.inverse(self._q.decode_as(packed, dtype))
        return self._uncentre(x, self._mean).astype(dtype)

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q k_hat^T`` from the codes: the query rotated once, scored by the affine codes
        (centred keys: ``q . mu`` added to each query's row).

        Shapes: q ``(B, H, M, D)`` float32, scale applied; returns float32 ``(B, H, M, T)``.
        """
        s = self._q.scores(self._rot.forward(q), packed)
        if self._mean is None:
            return s
        mu = self._heads(self._mean, q.shape[1])  # (1, H, 1, D)
        return s + mx.sum(q.astype(mx.float32) * mu, axis=-1, keepdims=True)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w v_hat``: the weights mix the codes, the result is rotated back once.

        Shapes: w ``(B, H, M, T)`` float32; returns float32 ``(B, H, M, D)``.
        """
        return self._rot.inverse(self._q.mix(w, packed))

    @property
    def quantizer(self) -> Uniform:
        """The ``Uniform`` codes in the rotated basis (once the head dim is known)."""
        if self._q is None:
            raise ValueError(f"{self.name}: the head dim is not known yet")
        return self._q


class OscarKeys(_OscarSide):
    """OSCAR's key codec.

    Args:
        bits: code width (the paper: 2; 2 to 8).
        group: channels per fp16 scale and minimum (None: the whole head, at most 128).
        clip: the clip ratio (the rank ``int(clip * D)`` of a row's absolute values is its
            threshold; 1 clips nothing); None: the artifact's, fitted per layer.
        rotation: ``"oscar"`` (the fitted ``U_Q H P_br``) or ``"hadamard"`` (the Sylvester
            Hadamard matrix alone: the paper's ablation).
        artifact: path of the OSCAR artifact; None finds the model's at ``bind``.
        layer: the model layer (set by ``bind``).
        centre: code each key less its KV head's fitted mean (the artifact's ``key_mean``),
            with the clip ratio fitted for centred keys; attention and ``decode`` add it back.

    Packed layout: ``velox_core.Uniform``'s per-token records (``codes`` uint32, ``scale``
    and ``zero`` fp16 per group). State: ``rotation`` fp16 ``(D, D)`` (``rotation="oscar"``),
    ``clip`` float32 ``(1,)`` (``clip=None``), ``mean`` float32 ``(H, D)`` (``centre``).
    """

    name = "oscar-key"
    side = "key"


class OscarValues(_OscarSide):
    """OSCAR's value codec (``R_V = U_S H P_br``). Args and layout: see :class:`OscarKeys`."""

    name = "oscar-value"
    side = "value"
