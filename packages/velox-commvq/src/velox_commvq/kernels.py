"""GPU kernel path of CommVQ keys: fused decode attention on the codes (arXiv 2506.18879).

velox-core's portable decode kernel (``metal/decode_attention.metal``, one body for Metal and
CUDA) reads CommVQ's keys as *table* codes (:class:`velox_commvq.layout.TableCodes`, with
``TableKeys``) through the key pass this package ships (``metal/decode_table_keys.metal``,
:class:`velox_commvq.layout.TableLayout`): the method's decode step as the paper defines it,
on the codes:

* once per call the host (MLX ops) meets the query with every codeword:
  ``conj(q_p) A[s, p, k]`` and ``conj(q_p) J B[s, p, k]`` per KV head, query row, stage, pair
  and entry (:func:`kernel_tables`, from :func:`velox_commvq.scores.codeword_tables`), the
  query's pairs taken in the layer's RoPE layout (traditional or not, partial rotary dims);
* the kernel reads each key's packed indices, sums its two looked-up 2-vectors per pair and
  stage into ``W_p``, rotates the sums by the key's angle (its stored position times the
  pair's frequency from the codec's ``RopeSpec``, base and scale included:
  ``Re(e^{i t theta_p} W_p)``), adds the pairs and scales by the stored norm: no key is
  decoded;
* values are mixed from their per-token ``Uniform`` codes in the same pass, the splits merged
  (with a cache's fp16 window and sinks in one softmax, :func:`joint_call`).

The tables are ``S * P * 2K`` complex numbers per query row and KV head (8,192 floats at
the default geometry and D = 128): too large for a threadgroup's memory beside the scores,
so the kernel reads them from device memory, where every split of the head reads the same
ones.

Where the kernel does not apply (kernels off or the CPU, the table layout turned off with
``VELOX_LAYOUTS_OFF=table``, codebooks not yet read, values not a per-token ``Uniform``, a
geometry the kernel's plan declines: see ``velox_core.kernels.portable.plan``) the functions
return None and the caller takes the reference path (:func:`velox_commvq.scores.code_scores`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from velox_core import Packed, Uniform
from velox_core.kernels import decode as _kd
from velox_core.kernels import use_kernels
from velox_core.kernels.config import kernel_config
from velox_core.kernels.joint import JointQuery, JointRun, joint_glue, plan_joint
from velox_core.kernels.records import AffineCodes
from velox_core.ops.rope import to_pairs

from .layout import TableCodes, TableKeys, TableLayout
from .scores import codeword_tables

if TYPE_CHECKING:
    from .codec import CommVQKeys

__all__ = ["attend_partial", "joint_call", "kernel_keys", "kernel_sides", "kernel_tables"]


def kernel_keys(codec: CommVQKeys, packed: Packed) -> TableCodes | None:
    """The decode kernel's view of a key record (:class:`velox_commvq.layout.TableCodes`):
    the packed indices, the norms and the positions as stored, the stages and each pair's
    RoPE frequency (``TableKeys``); None before the codec has read its codebooks."""
    if not codec.ready:
        return None
    g, p = codec.geometry, packed.data
    return TableCodes(
        bits=g.index_bits,
        group=g.pairs,
        codes=p["codes"],
        norm=p["norm"],
        positions=p["pos"],
        table=TableKeys(codec.stages, codec.pair_theta()),
    )


def kernel_sides(
    codec: CommVQKeys, keys: Packed, value_codec, values: Packed
) -> tuple[TableCodes, AffineCodes] | None:
    """Both records as the decode kernel reads them, or None where no kernel applies
    (kernels off or the CPU, the table layout turned off: ``KernelConfig.layouts_off``,
    codebooks not read, values not a per-token ``Uniform``)."""
    if not use_kernels() or TableLayout.name in kernel_config().layouts_off:
        return None
    if not isinstance(value_codec, Uniform) or value_codec.axis != "token":
        return None
    ks = kernel_keys(codec, keys)
    return None if ks is None else (ks, value_codec.kernel_codes(values))


def kernel_tables(codec: CommVQKeys, q: mx.array) -> mx.array:
    """The query tables the kernel scores from (:class:`TableKeys`' layout), one row per query.

    Shapes:
        q ``(B, H, M, D)`` (any float dtype, scaled or not: the scale the kernel applies is
        the one the tables lack); returns float32 ``(B, H, M, S * P * 2 * K * 2)``.
    """
    a, b = codec.codewords()
    tab = codeword_tables(to_pairs(q, codec.rope), a, b)  # (B, H, M, S, P, 2, K, 2)
    return tab.reshape(*q.shape[:3], -1)


def _sides_for(codec: CommVQKeys, dim: int, keys: Packed, value_codec, values: Packed):
    """:func:`kernel_sides` where the query's head dim ``dim`` is the codec's, else None."""
    sides = kernel_sides(codec, keys, value_codec, values)
    if sides is None or dim != 2 * sides[0].table.theta.shape[0]:
        return None
    return sides


def attend_partial(
    codec: CommVQKeys, q: mx.array, keys: Packed, value_codec, values: Packed
) -> tuple[mx.array, mx.array, mx.array] | None:
    """``CommVQKeys.attend_partial``: the partial ``(o, m, l)`` of one segment from its codes
    (the decode kernel and the split merge), or None where no kernel applies. Shapes as
    ``velox_core.Codec.attend_partial`` (q float32 with the scale applied)."""
    sides = _sides_for(codec, q.shape[-1], keys, value_codec, values)
    if sides is None:
        return None
    return _kd.decode_attention(q, *sides, q_sketch=kernel_tables(codec, q))


def _plan_joint(
    codec: CommVQKeys, query: JointQuery, keys: Packed, value_codec, values: Packed
) -> JointRun | None:
    """``CommVQKeys.joint_call``: attention over this segment's codes and up to two fp16
    segments (a cache's sinks and window) in one softmax, planned once: a callable
    ``run(q, fp16)`` that builds the query tables from ``q`` (unscaled with ``scale``, else
    float32 with it applied) and launches the decode kernel and the merge that joins the fp16
    tokens, returning ``(B, H, M, D)`` in ``out_dtype``; or None where :func:`attend_partial`
    would decline. See ``velox_core.Codec.joint_call``."""
    sides = _sides_for(codec, query.shape[-1], keys, value_codec, values)
    if sides is None:
        return None
    return plan_joint(query, *sides, lambda q: (q, None, kernel_tables(codec, q)), q_sketch=True)


joint_call = joint_glue(_plan_joint)
