"""``SVDqKeys``: pre-RoPE keys in their SVD latent channels, precision falling with the
singular value (arXiv 2502.15304).

SVDq observes that the singular values of a key cache decay fast: in the basis of its right
singular vectors (the *latent channels*) almost all of a key's energy sits in the first few
channels. It quantizes each latent channel per channel, with a bit width that falls with its
singular value, and drops the last channels; the paper splits the ``D`` latent channels into
8 equal groups with widths such as ``(8, 4, 2, 1, 1, 0, 0, 0)`` (2 bits per channel on average).

Coding, per layer, KV head and sequence of the batch:

1. Keys arrive post-RoPE; each is un-rotated at its absolute position (``pre_rope``).
2. The first block the codec encodes fits the basis: the right singular vectors of those
   ``n`` pre-RoPE keys ``K`` (``n x D``), from the eigenvectors of ``K^T K`` in float64, sorted
   by singular value; the first ``r`` (the kept channels) are stored as fp16 ``basis``
   ``(B, H, D, r)``. With ``center`` the mean key is subtracted first and stored too.
3. Every key (the fitting block's and all later ones, prefill or decode) is projected onto that
   basis: ``c = (k - mean) @ basis``, ``r`` latent coefficients.
4. Latent channel ``j`` is quantized with its group's width ``b_j``, asymmetric per channel
   over ``group`` tokens (a scale and a zero per channel and block, fp16), as the paper
   quantizes latent channels per channel. Codes of one width are bit-packed together.

Decoding (and attention) rebuilds ``k = c @ basis^T + mean`` per call in float32, rotates it
by RoPE at the stored positions, and attends; nothing rebuilt is kept. This is the paper's
reconstruct-then-RoPE (its kernels fuse it). With ``pre_rope=False`` (post-RoPE keys, an
ablation) attention is computed in the latent: the query is rotated into the basis once
(``q @ basis``, ``M x r``) and scores are ``(q @ basis) @ c^T + q . mean``. With RoPE that form
needs the query un-rotated to every key's position and projected, ``M`` times the work of
rebuilding the key for ``M`` query rows per KV head, so the pre-RoPE path rebuilds the key.

Deviations from the paper (also in docs/svdq.md): the basis is fitted once, on the first
block the codec encodes (the paper fits it on the prefill's keys; a prefill that arrives whole
is one block here), and later keys, decode tokens included, are projected onto it; scales are
per channel and ``group`` tokens; ``center`` (removing the mean key) is an addition, off by
default; basis, scales and zeros are fp16; positions are stored as one int32 per block
(blocks hold consecutive positions); there is no fused kernel.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import Codec, Packed
from velox_core.codec.prerope import PreRope
from velox_core.ops import affine_dequantize, affine_quantize, pack, unpack
from velox_core.validation import check_bool, check_int

from .config import format_schedule, parse_schedule

__all__ = ["SVDqKeys", "channel_widths"]


def channel_widths(widths: tuple[int, ...], dim: int, rank: int | None) -> list[int]:
    """Bit width of each kept latent channel, in singular-value order.

    ``dim`` channels are split into ``len(widths)`` equal groups; channel ``j`` takes its
    group's width; the kept channels are the first ``rank`` (default: every channel above 0
    bits).

    Raises:
        ValueError: ``dim`` is not a multiple of the number of groups, or ``rank`` is larger
            than the channels the schedule codes.
    """
    n = len(widths)
    if dim % n:
        raise ValueError(
            f"svdq: schedule {format_schedule(widths)} has {n} groups, which must divide the "
            f"head dim {dim}"
        )
    per = [widths[j * n // dim] for j in range(dim)]
    coded = sum(1 for w in per if w > 0)
    if rank is not None and rank > coded:
        raise ValueError(
            f"svdq: rank={rank} exceeds the {coded} latent channels schedule "
            f"{format_schedule(widths)} codes at head dim {dim}; lower rank or give more "
            "groups bits"
        )
    return per[: coded if rank is None else rank]


def _runs(per: list[int]) -> list[tuple[int, int, int]]:
    """``(width, start, stop)`` of each run of equal width (contiguous: widths never rise)."""
    out, start = [], 0
    for j in range(1, len(per) + 1):
        if j == len(per) or per[j] != per[start]:
            out.append((per[start], start, j))
            start = j
    return out


class SVDqKeys(PreRope, Codec):
    """SVDq's key codec.

    Args:
        schedule: bit widths of the equal groups of latent channels (see
            :func:`~velox_svdq.config.parse_schedule`).
        rank: latent channels kept (None: every channel of a group above 0 bits).
        group: tokens per per-channel scale block (``block = group``).
        center: subtract the fitting block's mean key before the SVD.
        pre_rope: fit and code keys before RoPE (the paper); False codes post-RoPE keys.
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone codec
            (:class:`~velox_core.codec.prerope.PreRope`).

    Packed layout (``r`` kept channels, ``n_w`` of them ``w`` bits wide): ``codes<w>`` uint32
    ``(B, H, T, ceil(n_w * w / 32))`` for each width, ``scale`` and ``zero`` fp16
    ``(B, H, T / group, r)``, and ``pos`` int32 ``(B, 1, T / group)`` (the first position of
    each block, pre-RoPE only). State: ``basis`` fp16 ``(B, H, D, r)``, ``mean`` (``center``),
    and the RoPE's frequencies.
    """

    name = "svdq-key"
    rope_method = "svdq"
    rope_optional = True

    def __init__(
        self,
        schedule: Any = "8-4-2-1-1-0-0-0",
        rank: int | None = None,
        group: int = 64,
        center: bool = False,
        pre_rope: bool = True,
        rope_base: float | None = None,
        rope_traditional: bool = False,
        rope_scale: float = 1.0,
        rope_dims: int | None = None,
    ):
        self.widths = parse_schedule(schedule)
        self.rank = None if rank is None else check_int("rank", rank, minimum=1)
        self.group = check_int("group", group, minimum=1)
        self.block = self.group
        self.center = check_bool("center", center)
        self.pre_rope = check_bool("pre_rope", pre_rope)
        self.init_rope(rope_base, rope_traditional, rope_scale, rope_dims)
        self._fit: dict[str, mx.array] = {}

    def config(self) -> dict[str, Any]:
        return {
            "schedule": format_schedule(self.widths),
            "rank": self.rank,
            "group": self.group,
            "center": self.center,
            **self.rope_config(),
        }

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Read the RoPE of ``model.layers[layer]`` (pre-RoPE codecs only)."""
        if model is not None and layer is not None:
            self.bind_rope(model, layer)

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        channel_widths(self.widths, dim, self.rank)
        if self.fitted and dim != self.dim:
            raise ValueError(f"svdq: fitted on head dim {self.dim}, got {dim}")
        if self.pre_rope:
            self.rope_for(dim)

    # -- fitted state: the basis (and mean) per batch row, and the RoPE ------------------------
    @property
    def fitted(self) -> bool:
        return bool(self._fit)

    @property
    def dim(self) -> int:
        return int(self._fit["basis"].shape[2])

    def state(self) -> dict[str, mx.array]:
        return {**self._fit, **self.rope_state()}

    def set_state(self, state: dict[str, mx.array]) -> None:
        state = self.pop_rope_state(state)
        need = {"basis", "mean"} if self.center else {"basis"}
        if state and set(state) != need:
            raise ValueError(f"{self.name}: state must hold {sorted(need)}, got {sorted(state)}")
        self._fit = state

    def filter_batch(self, index: mx.array) -> None:
        self._fit = {k: a[index] for k, a in self._fit.items()}

    def extend_batch(self, other: SVDqKeys) -> None:
        if self.fitted != other.fitted:
            raise ValueError(
                f"{self.name}: cannot join a fitted codec with an unfitted one; feed both "
                "caches past their calibration tokens first"
            )
        self._fit = {k: mx.concatenate([a, other._fit[k]], axis=0) for k, a in self._fit.items()}

    def _fit_basis(self, xf: mx.array) -> None:
        """The right singular vectors of each (row, head)'s keys, largest singular value first.

        Shapes:
            xf ``(B, H, n, D)`` float32; stores ``basis`` fp16 ``(B, H, D, r)``.
        """
        a = np.array(xf).astype(np.float64)
        if self.center:
            mean = a.mean(axis=2)  # (B, H, D)
            a = a - mean[:, :, None]
            self._fit["mean"] = mx.array(mean.astype(np.float32)).astype(mx.float16)
        gram = np.swapaxes(a, -1, -2) @ a  # (B, H, D, D) = K^T K
        _, vecs = np.linalg.eigh(gram)  # ascending eigenvalues: sigma_j^2
        r = len(channel_widths(self.widths, a.shape[-1], self.rank))
        basis = vecs[..., ::-1][..., :r]
        # a fixed sign per vector (its largest entry positive), so a fit is reproducible
        big = np.take_along_axis(basis, np.abs(basis).argmax(axis=-2)[..., None, :], axis=-2)
        basis = basis * np.where(big < 0, -1.0, 1.0)
        self._fit["basis"] = mx.array(basis.astype(np.float32)).astype(mx.float16)

    # -- coding --------------------------------------------------------------------------------
    def _latent_layout(self) -> list[tuple[int, int, int]]:
        return _runs(channel_widths(self.widths, self.dim, self.rank))

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        b, _, t, _ = x.shape
        if t % self.group:
            raise ValueError(f"svdq: {t} tokens is not a multiple of group={self.group}")
        xf = x.astype(mx.float32)
        extra = {}
        if self.pre_rope:
            pos = self.key_positions(positions, b, t)
            blocks = np.array(pos[0, 0]).astype(np.int64).reshape(t // self.group, self.group)
            if np.any(blocks - blocks[:, :1] != np.arange(self.group)):
                raise ValueError("svdq: each block of group tokens must hold consecutive positions")
            start = mx.array(blocks[:, 0].astype(np.int32)).reshape(1, 1, -1)
            extra = {"pos": mx.broadcast_to(start, (b, 1, t // self.group))}
            xf = self.unrotate(xf, pos)
        if not self.fitted:
            self._fit_basis(xf)
        if self.center:
            xf = xf - self._fit["mean"].astype(mx.float32)[:, :, None]
        lat = xf @ self._fit["basis"].astype(mx.float32)  # (B, H, T, r)
        codes, scales, zeros = {}, [], []
        for w, lo, hi in self._latent_layout():
            # float32 latents: the scales and zeros come out fp16 (for bf16 models too)
            c, s, z = affine_quantize(lat[..., lo:hi], w, self.group, "channel")
            codes[f"codes{w}"] = pack(c, w)
            scales.append(s)
            zeros.append(z)
        data = {**codes, "scale": _cat(scales), "zero": _cat(zeros), **extra}
        return Packed(data, t, self.group, frozenset({"scale", "zero", "pos"}))

    def latent(self, packed: Packed) -> mx.array:
        """The dequantized latent coefficients. Shapes: returns float32 ``(B, H, T, r)``."""
        p, parts = packed.data, []
        for w, lo, hi in self._latent_layout():
            c = unpack(p[f"codes{w}"], w, hi - lo)
            s, z = p["scale"][..., lo:hi], p["zero"][..., lo:hi]
            parts.append(affine_dequantize(c, s, z, self.group, "channel"))
        return _cat(parts)

    def positions(self, packed: Packed) -> mx.array:
        """Absolute positions of the tokens. Shapes: returns int32 ``(B, 1, T)``."""
        start = packed.data["pos"]
        steps = mx.arange(self.group, dtype=mx.int32)
        return (start[..., None] + steps).reshape(*start.shape[:2], -1)

    def decode(self, packed: Packed) -> mx.array:
        k = self.latent(packed) @ mx.swapaxes(self._fit["basis"].astype(mx.float32), -1, -2)
        if self.center:
            k = k + self._fit["mean"].astype(mx.float32)[:, :, None]
        return self.rerotate(k, self.positions(packed)) if self.pre_rope else k

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ k_hat.T``: post-RoPE codes attend in the latent (the query rotated into the
        basis once); pre-RoPE codes rebuild the keys, rotate them and attend (see the module
        docstring).

        Shapes:
            q ``(B, H, M, D)`` float32 (scale applied); returns float32 ``(B, H, M, T)``.
        """
        if self.pre_rope:
            return super().scores(q, packed)
        qb = q @ self._fit["basis"].astype(mx.float32)  # (B, H, M, r)
        s = qb @ mx.swapaxes(self.latent(packed), -1, -2)
        if self.center:
            s = s + q @ self._fit["mean"].astype(mx.float32)[..., None]
        return s


def _cat(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
