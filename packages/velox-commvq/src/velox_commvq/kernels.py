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
  (with a cache's fp16 window and sinks in one softmax).

The tables are ``S * P * 2K`` complex numbers per query row and KV head (8,192 floats at
the default geometry and D = 128): too large for a threadgroup's memory beside the scores,
so the kernel reads them from device memory, where every split of the head reads the same
ones.

Where the kernel does not apply (kernels off or the CPU, the table layout turned off with
``VELOX_LAYOUTS_OFF=table``, codebooks not yet read, values not a per-token ``Uniform``, a
geometry the kernel's plan declines: see ``velox_core.kernels.portable.plan``) the caller
takes the reference path (:func:`velox_commvq.scores.code_scores`).
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.kernels.joint import KernelSide
from velox_core.kernels.records import AffineCodes, CodeRecord

from .layout import TableCodes, TableKeys
from .pairs import to_pairs
from .scores import codeword_tables

__all__ = ["kernel_keys", "kernel_tables", "table_codes"]


def table_codes(codec: Codec, packed: Packed) -> TableCodes:
    """The decode kernel's view of a key record (:class:`velox_commvq.layout.TableCodes`):
    the packed indices, the norms and the positions as stored, the stages and each pair's
    RoPE frequency (``TableKeys``). The codec has read its codebooks (``codec.ready``)."""
    g, p = codec.geometry, packed.data
    return TableCodes(
        bits=g.index_bits,
        group=g.pairs,
        codes=p["codes"],
        norm=p["norm"],
        positions=p["pos"],
        table=TableKeys(codec.stages, codec.pair_theta()),
    )


def kernel_keys(codec: Codec, packed: Packed, q_shape, values: CodeRecord) -> KernelSide | None:
    """:meth:`velox_core.Codec.kernel_keys` of CommVQ: the table codes, with the query
    tables (:func:`kernel_tables`) as their query-side input, beside per-token affine
    values; None before the codec has read its codebooks or for another head dim."""
    if not codec.ready or type(values) is not AffineCodes:
        return None
    rec = table_codes(codec, packed)
    if q_shape[-1] != 2 * rec.table.theta.shape[0]:
        return None
    return KernelSide(rec, query_input=lambda q: kernel_tables(codec, q))


def kernel_tables(codec: Codec, q: mx.array) -> mx.array:
    """The query tables the kernel scores from (:class:`TableKeys`' layout), one row per query.

    Shapes:
        q ``(B, H, M, D)`` (any float dtype, scaled or not: the scale the kernel applies is
        the one the tables lack); returns float32 ``(B, H, M, S * P * 2 * K * 2)``.
    """
    a, b = codec.codewords()
    tab = codeword_tables(to_pairs(q, codec.rope), a, b)  # (B, H, M, S, P, 2, K, 2)
    return tab.reshape(*q.shape[:3], -1)
