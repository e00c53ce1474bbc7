"""``KVQuantKeys``: per-channel, pre-RoPE keys, nuq datatype, dense-and-sparse outliers.

KVQuant (arXiv 2401.18079) quantizes keys per channel, because key caches have outlier
channels, and before RoPE, because RoPE mixes pairs of channels with position-dependent
angles. Keys reach the cache post-RoPE, so each block is first un-rotated at its absolute
positions (kept per token, int32, in the record) and the decoded keys are re-rotated there.

Per-channel scaling factors and outlier thresholds are calibrated once, as the paper does
offline, here on the first tokens the codec encodes, as in the authors' code for a capped
number of outliers per token: the ``outliers / 2`` and ``1 - outliers / 2`` quantiles over
tokens of every (head, channel) give first thresholds; each calibration token's ``k`` entries
most extreme under them are its outliers; the dense range of each channel is the min and max
of what remains (so no calibration entry is clipped), stored as fp16 ``zero`` (midpoint) and
``range`` (half width). With these fixed scales keys are coded one token at a time
(``block = 1``). Of each key vector, the ``k = round(outliers * D)`` entries whose dense code
would be furthest off in model units (``range * |u - level(u)|``, with ``u`` clipped into
``[-1, 1]`` first, so clipped entries come first) are kept exactly as fp16 outliers; every
other entry is coded with the layer's nuq datatype, fitted on the calibration entries inside
the range, each weighted by ``range**2``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import Packed
from velox_core.ops import pack
from velox_core.ops.quant import scale_dtype
from velox_core.ops.rope import RopeSpec, find_rope, rope_spec, rotate
from velox_core.validation import check_float, check_int

from .base import NuqCodec, check_bool
from .nuq import dequantize, outlier_count

__all__ = ["KVQuantKeys"]

_MIN_RANGE = 1e-4


class KVQuantKeys(NuqCodec):
    """KVQuant's key codec.

    Args:
        bits, outliers, datatype, qnorm: see :class:`~velox_kvquant.base.NuqCodec`.
        pre_rope: quantize keys before RoPE (the paper); False quantizes the post-RoPE keys
            per channel (the paper's ablation baseline).
        rope_base: the RoPE base for a standalone codec (no model bound). With a model,
            :meth:`bind` reads the model's RoPE; a ``rope_base`` that disagrees is an error.
        rope_traditional, rope_scale, rope_dims: the rest of ``mlx.nn.RoPE``'s settings,
            used with ``rope_base`` (``rope_dims`` defaults to the head dim).

    Packed layout per token: ``codes`` uint32 ``(ceil(D*bits/32),)``, ``sparse_val`` fp16
    ``(k,)``, ``sparse_idx`` uint8 ``(k,)``, and (pre-RoPE) ``pos`` int32 stored once per token
    for all heads, ``(B, 1, T)``.
    """

    name = "kvquant-key"
    _batch_state = ("levels", "bounds", "zero", "range")

    def __init__(
        self,
        bits: int = 4,
        outliers: float = 0.01,
        datatype: str = "nuq",
        qnorm: bool = False,
        pre_rope: bool = True,
        rope_base: float | None = None,
        rope_traditional: bool = False,
        rope_scale: float = 1.0,
        rope_dims: int | None = None,
    ):
        super().__init__(bits, outliers, datatype, qnorm)
        self.pre_rope = check_bool("pre_rope", pre_rope)
        self.rope_base = None if rope_base is None else check_float("rope_base", rope_base)
        if self.rope_base is not None and self.rope_base <= 1.0:
            raise ValueError(f"rope_base must be > 1, got {rope_base}")
        self.rope_traditional = check_bool("rope_traditional", rope_traditional)
        self.rope_scale = check_float("rope_scale", rope_scale, minimum=0.0, open_min=True)
        self.rope_dims = None if rope_dims is None else check_int("rope_dims", rope_dims, minimum=2)
        if self.rope_dims is not None and self.rope_dims % 2:
            raise ValueError(f"rope_dims must be even, got {rope_dims}")
        custom = rope_traditional or rope_scale != 1.0 or rope_dims is not None
        if not pre_rope and (rope_base is not None or custom):
            raise ValueError("rope_base/rope_traditional/rope_scale/rope_dims need pre_rope=True")
        if rope_base is None and custom:
            raise ValueError("rope_traditional/rope_scale/rope_dims need rope_base")
        self._rope: RopeSpec | None = None  # from the model (bind) or the state

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "pre_rope": self.pre_rope,
            "rope_base": self.rope_base,
            "rope_traditional": self.rope_traditional,
            "rope_scale": self.rope_scale,
            "rope_dims": self.rope_dims,
        }

    # -- RoPE --------------------------------------------------------------------------------
    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Read the RoPE of ``model.layers[layer]`` (pre-RoPE codecs only)."""
        if not self.pre_rope or model is None or layer is None:
            return
        spec = rope_spec(
            find_rope(model, layer, "kvquant", "pass rope_base=... or use pre_rope=False"),
            "kvquant",
            "pass rope_base=... or use pre_rope=False",
        )
        if self.rope_base is not None:
            mine = self._config_rope(spec.dims if self.rope_dims is None else self.rope_dims)
            if not mine.same_as(spec):
                raise ValueError(
                    f"kvquant: rope_base={self.rope_base} (and rope_traditional/rope_scale/"
                    f"rope_dims) disagree with layer {layer}'s RoPE ({spec.describe()}); "
                    "leave rope_base unset to use the model's"
                )
        self._rope = spec

    def _config_rope(self, dims: int) -> RopeSpec:
        return RopeSpec.from_base(self.rope_base, dims, self.rope_traditional, self.rope_scale)

    def _rope_for(self, dim: int) -> RopeSpec:
        if self._rope is None:
            if self.rope_base is None:
                raise ValueError(
                    "kvquant: pre-RoPE keys need the model's RoPE: build the caches with "
                    "velox_core.make_cache(model, ...), or pass rope_base=... for a "
                    "standalone cache, or pre_rope=False"
                )
            self._rope = self._config_rope(dim if self.rope_dims is None else self.rope_dims)
        if self._rope.dims > dim:
            raise ValueError(f"kvquant: RoPE rotates {self._rope.dims} channels of {dim}")
        return self._rope

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        super().check(dim, dtype)
        if self.pre_rope:
            self._rope_for(dim)

    # -- state: the fit, and the RoPE once known (so copies and files need no model) ----------
    def state(self) -> dict[str, mx.array]:
        out = super().state()
        if self.pre_rope and self._rope is not None:
            out.update(self._rope.arrays())
        return out

    def set_state(self, state: dict[str, mx.array]) -> None:
        state = dict(state)
        theta, layout = state.pop("rope_theta", None), state.pop("rope_layout", None)
        if (theta is None) != (layout is None) or (theta is not None and not self.pre_rope):
            raise ValueError(f"{self.name}: rope_theta and rope_layout go together, pre-RoPE only")
        if theta is not None:
            self._rope = RopeSpec.from_arrays(theta, layout)
        super().set_state(state)

    # -- coding ------------------------------------------------------------------------------
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        b, _, t, d = x.shape
        xf = x.astype(mx.float32)
        extra = {}
        if self.pre_rope:
            if positions is None or positions.shape != (t,):
                raise ValueError(f"kvquant: pre-RoPE keys need positions of shape ({t},)")
            spec = self._rope_for(d)
            pos = mx.broadcast_to(positions.astype(mx.int32).reshape(1, 1, t), (b, 1, t))
            xf = rotate(xf, pos, spec, inverse=True)
            extra = {"pos": pos}
        if not self.fitted:
            self._calibrate(xf, x.dtype)
        zero = self._fit["zero"].astype(mx.float32)[:, :, None]
        rng = self._fit["range"].astype(mx.float32)[:, :, None]
        u = (xf - zero) / rng
        codes = self._codes(u)
        # outliers: the entries whose dense code is furthest off, in model units
        err = mx.abs(u - dequantize(codes, self._fit["levels"])) * rng
        sparse = self._sparse(xf, err, x.dtype)
        return Packed({"codes": pack(codes, self.bits), **sparse, **extra}, t)

    def decode(self, packed: Packed) -> mx.array:
        zero = self._fit["zero"].astype(mx.float32)[:, :, None]
        rng = self._fit["range"].astype(mx.float32)[:, :, None]
        x = self._unsparse(self._undense(packed.data["codes"]) * rng + zero, packed)
        if self.pre_rope:
            x = rotate(x, packed.data["pos"], self._rope)
        return x

    def _calibrate(self, xf: mx.array, dtype: mx.Dtype) -> None:
        """Per-(row, head, channel) thresholds from quantiles over tokens, then the datatype."""
        a = np.array(xf)  # (B, H, T, D)
        q = self.outliers / 2
        lo, hi = np.quantile(a, [q, 1 - q], axis=2)  # (B, H, D) each
        k = outlier_count(self.outliers, a.shape[-1])
        if k:
            # the reference's capped variant: each token's k most extreme entries under these
            # thresholds are its outliers; the dense range is what remains (nothing clipped)
            mid, half = (hi + lo) / 2, np.maximum((hi - lo) / 2, _MIN_RANGE)
            u = np.abs(a - mid[:, :, None]) / half[:, :, None]
            out = np.zeros(a.shape, dtype=bool)
            np.put_along_axis(out, np.argpartition(-u, k - 1, axis=-1)[..., :k], True, -1)
            lo = np.where(out, np.inf, a).min(axis=2)
            hi = np.where(out, -np.inf, a).max(axis=2)
            lo, hi = np.where(np.isfinite(lo), lo, mid), np.where(np.isfinite(hi), hi, mid)
        sdt = scale_dtype(dtype)
        zero = mx.array(((hi + lo) / 2).astype(np.float32)).astype(sdt)
        rng = mx.array(np.maximum((hi - lo) / 2, _MIN_RANGE).astype(np.float32)).astype(sdt)
        self._fit = {"zero": zero, "range": rng}
        r32 = rng.astype(mx.float32)[:, :, None]
        u = (xf - zero.astype(mx.float32)[:, :, None]) / r32
        self._fit_levels(u, mx.abs(u) <= 1.0, r32 * r32)
