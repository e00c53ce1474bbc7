"""GPU kernel paths of TurboQuant_mse: fused decode attention (here) and fused encode
(:mod:`velox_turboquant.encode`).

Decode reuses velox-core's kernels (:mod:`velox_core.kernels.decode`) with *codebook* codes;
encode runs this package's (``metal/encode_codebook.metal``,
``metal/encode_residual_sketch.metal``). A TurboQuant_mse record is, in the rotated domain,
``x = norm * levels[code]`` per coordinate, with one norm per token, which the decode kernels
read as ``velox_core.kernels.records.CodebookCodes`` (``prod`` keys with the residual
sketch's ``signs`` and ``rnorm``).

* Decode attention: the query is rotated once (``R q``, an MLX op); the kernel scores it
  against the key levels times the key norms, and mixes the value levels times the value
  norms with the softmax weights, all in the rotated domain, in one pass over the codes
  split along the context; the ``(M, D)`` output is mapped back once (by the value
  rotation's inverse as a ``(D, D)`` matrix, kept per quantizer: the value side's ``back``).
  ``m`` and ``l`` need no rotation.
* Decode attention with a cache's fp16 sinks and window (planned once per segment): the same
  kernel on the rotated query, then velox-core's fused merge, which maps the splits'
  weighted sum back by the same matrix and joins the fp16 tokens, scored with the unrotated
  query, in one softmax: three launches (query rotation, kernel, merge) for a layer's attention.
* Encode: the norm and the rotation stay MLX ops; the kernel does the Lloyd-Max search
  (the same threshold comparisons as :meth:`velox_core.ops.Codebook.encode`) and packs the
  codes, bit for bit the reference. ``prod`` records (any width, 1-bit included) take the
  same codes kernel and a second launch for the residual's sign sketch and norm
  (``metal/encode_residual_sketch.metal``; 1 bit: QJL's sketch kernel, the residual being
  the vector itself).

* ``prod`` keys (TurboQuant_prod: ``bits - 1`` of Lloyd-Max codes and a 1-bit QJL sketch of
  the residual, at least 2 bits) take the same kernel with the sketch term: the host also
  sketches the rotated query once (``S R q`` times ``sqrt(pi/2) / D``, an MLX op), and the
  kernel adds ``rnorm * <S R q, sign(S r)>`` to each token's codebook score before the norm
  multiplies it. Values are TurboQuant_mse (``prod`` values have no kernel).

* Fractional widths (TurboQuant_mse on both sides, one of them fractional: the outlier
  channels chosen per group of tokens, two rotated parts) take this package's outlier kernel
  (:mod:`velox_turboquant.outlier`): the query is placed and rotated per group inside the
  kernel, and the values come back to the model's domain there, so neither needs an MLX op
  around the launch; a cache's fp16 tokens join in the same merge. Its records are this
  package's layout (:mod:`velox_turboquant.layout`); integer values beside fractional keys
  are restated in it by the keys' side.

* ``rvq`` keys or values (two residual stages of ``b / 2`` bits, stored as one ``b``-bit code
  whose level is the sum of the stages' levels: :mod:`velox_turboquant.residual`) are codebook
  codes over that ``2**b``-level table, and take the codebook kernels as mse codes do, beside
  integer-width codebook values.

Fractional ``prod`` keys, ``prod`` values, 1-bit ``prod`` keys (the sketch alone), ``rvq``
keys beside fractional values and parts rotated by a dense Haar matrix (parts whose Hadamard
block would be under 16 channels) fall back to the reference in attention (the codec gives no
kernel side); every integer-width mse or prod record and each part of a fractional one is
encoded by the kernels (``rvq`` records by MLX ops: two searches, no thresholds).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from velox_core import Packed
from velox_core.kernels.joint import KernelSide
from velox_core.kernels.records import CodebookCodes, CodeRecord

from .layout import OutlierCodes, TurboCodebookCodes
from .outlier import OutlierSide, RotatedPart, outlier_launch, outlier_threads, side_table

if TYPE_CHECKING:
    from .quantizer import SphereQuantizer

__all__ = ["kernel_keys", "kernel_values"]


def _is_turboquant(codec) -> bool:
    """Whether ``codec`` is a TurboQuant codec, by its registered name (this glue depends on
    the codec's public attributes, never imports it: the codec imports the glue)."""
    return getattr(codec, "name", None) == "turboquant"


def _single_part(codec, variants: tuple[str, ...]) -> SphereQuantizer | None:
    """The single quantizer of an integer-width codec of one of ``variants`` (with codebook
    codes: a ``prod`` codec of at least 2 bits; ``rvq``'s two stages are one code of its
    ``2**bits``-level table), else None."""
    if not _is_turboquant(codec) or codec.fractional or codec.variant not in variants:
        return None
    if codec.dim is None or len(codec.parts) != 1:
        return None
    quant = codec.parts[0][1]
    return quant if quant.codebook is not None else None


# per quantizer: [S_hi^T; S_hi^T; S_lo^T] for the split product of _query_sketch
_SKETCH_SPLIT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _bf16_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    hi = x.astype(mx.bfloat16).astype(mx.float32)
    return hi, x - hi


def _query_sketch(quant: SphereQuantizer, q_rot: mx.array) -> mx.array | None:
    """``S R q`` times the QJL constant, for keys with a residual sketch; else None.

    A GPU runs float32 matmuls in TF32 unless ``MLX_ENABLE_TF32=0`` (MLX's default on CUDA
    and on recent Apple GPUs): 10-bit mantissas, about 1e-3 relative error in the sketched
    query, as large as the sketch term's own precision needs. So both factors are split into
    bfloat16 parts, exact in TF32, and ``q_hi S_hi + q_lo S_hi + q_hi S_lo`` is one matmul
    over the concatenated parts (to about 2^-17 relative)."""
    if quant.sketch is None:
        return None
    stack = _SKETCH_SPLIT.get(quant)
    if stack is None:
        s_hi, s_lo = _bf16_parts(quant.sketch.astype(mx.float32))
        stack = mx.concatenate([s_hi.T, s_hi.T, s_lo.T], axis=0)
        _SKETCH_SPLIT[quant] = stack
    q_hi, q_lo = _bf16_parts(q_rot.astype(mx.float32))
    return (mx.concatenate([q_hi, q_lo, q_hi], axis=-1) @ stack) * quant.qjl


def _codebook_codes(quant, data: dict[str, mx.array], outlier=None) -> TurboCodebookCodes:
    """One side's record for the kernels: its quantizer's codes and norms over its levels,
    with the residual sketch's ``signs`` and ``rnorm`` where the quantizer sketches (prod
    keys), and ``outlier``, the same codes as the outlier kernel reads them (values)."""
    sketch = quant.sketch is not None
    return TurboCodebookCodes(
        bits=quant.mse_bits,
        dim=quant.dim,
        codes=data["codes"],
        norm=data["norm"],
        levels=quant.levels,
        symmetric=quant.levels_symmetric,
        signs=data["signs"] if sketch else None,
        rnorm=data["rnorm"] if sketch else None,
        outlier=outlier,
    )


# per codec: (head dim, the static parts, their side_table)
_OUTLIER_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _outlier_parts(codec) -> tuple[tuple[RotatedPart, ...], mx.array] | None:
    """The static parts of an mse codec (outliers first) and their table, or None where the
    outlier kernel does not apply (``prod``, no codebook, a Haar rotation)."""
    if not _is_turboquant(codec) or codec.variant != "mse" or codec.dim is None:
        return None
    hit = _OUTLIER_TABLES.get(codec)
    if hit is not None and hit[0] == codec.dim:
        return hit[1]
    parts = []
    for _, quant in codec.parts:
        had = quant.rotation.hadamard
        if quant.codebook is None or had is None:
            return None
        parts.append(
            RotatedPart(
                bits=quant.mse_bits,
                channels=quant.dim,
                levels=quant.codebook.centroids,
                signs=np.asarray(had.signs),
                inv_perm=None if had.inv_perm is None else np.asarray(had.inv_perm),
                block=had.block,
            )
        )
    parts = tuple(parts)
    hit = (codec.dim, (parts, side_table(parts)))
    _OUTLIER_TABLES[codec] = hit
    return hit[1]


def _outlier_side(codec, packed: Packed) -> OutlierSide | None:
    static = _outlier_parts(codec)
    if static is None:
        return None
    parts, table = static
    d = packed.data
    if codec.fractional:
        return OutlierSide(
            parts,
            (d["hi.codes"], d["lo.codes"]),
            (d["hi.norm"], d["lo.norm"]),
            d["mask"],
            codec.group,
            table,
        )
    return OutlierSide(parts, (d["codes"],), (d["norm"],), None, 1, table)


_INVERSE: dict[int, tuple[object, mx.array]] = {}


def _inverse_matrix(quant: SphereQuantizer) -> mx.array:
    """``A`` (float32 ``(D, D)``) with ``quant.rotation.inverse(o) == o @ A``: the inverse
    applied to the identity (rows ``inverse(e_i)``), computed once per rotation."""
    rot = quant.rotation
    hit = _INVERSE.get(id(rot))
    if hit is None:  # (an entry holds its rotation, so its id cannot be reused meanwhile)
        if len(_INVERSE) >= 1024:
            _INVERSE.clear()
        a = rot.inverse(mx.eye(quant.dim, dtype=mx.float32)).astype(mx.float32)
        mx.eval(a)
        hit = (rot, a)
        _INVERSE[id(rot)] = hit
    return hit[1]


def kernel_values(codec, packed: Packed, dim: int) -> KernelSide | None:
    """:meth:`velox_core.Codec.kernel_values` of TurboQuant: an integer-width mse or rvq record
    as codebook codes in the rotated domain (mapped back by the value rotation's inverse, a
    ``(D, D)`` matrix), with its outlier view; a fractional mse record as outlier codes
    (brought back inside the outlier kernel). None for ``prod`` values, a Haar-rotated
    fractional record or another head dim."""
    if not _is_turboquant(codec) or codec.dim != dim:
        return None
    if codec.fractional:
        side = _outlier_side(codec, packed)
        return None if side is None else KernelSide(OutlierCodes(side=side))
    vq = _single_part(codec, ("mse", "rvq"))
    if vq is None:
        return None
    rec = _codebook_codes(vq, packed.data, _outlier_side(codec, packed))
    return KernelSide(rec, back=_inverse_matrix(vq))


def _outlier_keys(codec, packed: Packed, q_shape, values: CodeRecord) -> KernelSide | None:
    """Keys for the outlier kernel (fractional keys, or any mse keys beside fractional
    values), restating integer values in its layout; None where it has no layout."""
    if isinstance(values, OutlierCodes):
        vside, restated = values.side, None
    else:
        vside = getattr(values, "outlier", None)
        restated = None if vside is None else KernelSide(OutlierCodes(side=vside))
    ks = _outlier_side(codec, packed)
    if ks is None or vside is None or sum(p.channels for p in vside.parts) != codec.dim:
        return None
    if outlier_launch(q_shape[2], q_shape[3], ks, vside, outlier_threads()) is None:
        return None
    return KernelSide(OutlierCodes(side=ks), values=restated)


def kernel_keys(codec, packed: Packed, q_shape, values: CodeRecord) -> KernelSide | None:
    """:meth:`velox_core.Codec.kernel_keys` of TurboQuant: integer-width mse, prod or rvq keys
    (Lloyd-Max codes; rvq's summed-stage table) as codebook codes scored against the rotated
    query (prod keys: with the sketched query as their query-side input) beside codebook
    values; the outlier kernel's keys where either side is fractional. None for ``prod`` keys
    of 1 bit or of a fractional width, ``rvq`` keys beside fractional values, another head
    dim, or values of another layout."""
    if not _is_turboquant(codec) or codec.dim != q_shape[-1]:
        return None
    if codec.fractional or isinstance(values, OutlierCodes):
        return _outlier_keys(codec, packed, q_shape, values)
    kq = _single_part(codec, ("mse", "prod", "rvq"))
    if kq is None or not isinstance(values, CodebookCodes) or values.dim != kq.dim:
        return None
    sketch = None if kq.sketch is None else (lambda q_rot: _query_sketch(kq, q_rot))
    rec = _codebook_codes(kq, packed.data)
    return KernelSide(rec, query=kq.rotation.forward, query_input=sketch)
