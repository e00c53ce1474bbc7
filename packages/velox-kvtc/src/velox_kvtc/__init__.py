"""KVTC for velox (arXiv 2511.01815): a transform coder for KV caches at rest and on the wire.

Keys with RoPE undone and values, every layer and head of a token side by side, are projected
on a PCA basis fitted once per model (:func:`fit_kvtc`, ``python -m velox_kvtc fit``), their
components quantized under a bit allocation chosen by dynamic programming for a target ratio,
and entropy coded with DEFLATE; the first and last tokens stay exact. :func:`save` /
:func:`load` write and read such caches as files, :func:`encode` / :func:`decode` as bytes
(to hand a cache to another process); loading rebuilds caches of the saved classes (mlx-lm
``KVCache``, velox caches) that continue decoding.
"""

from .allocation import Group, Plan, allocate, budget_bits, error_table
from .artifact import (
    KvtcBasis,
    MissingBasisError,
    load_basis,
    resolve_basis,
    save_basis,
)
from .fit import RATIOS, fit_kvtc
from .load import decode, inspect, load
from .store import RATIO, SINKS, WINDOW, Sizes, encode, save

__all__ = [
    "RATIO",
    "RATIOS",
    "SINKS",
    "WINDOW",
    "Group",
    "KvtcBasis",
    "MissingBasisError",
    "Plan",
    "Sizes",
    "allocate",
    "budget_bits",
    "decode",
    "encode",
    "error_table",
    "fit_kvtc",
    "inspect",
    "load",
    "load_basis",
    "resolve_basis",
    "save",
    "save_basis",
]
