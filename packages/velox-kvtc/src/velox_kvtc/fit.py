"""Fitting a model's KVTC transform on calibration text (arXiv 2511.01815, Sec. 3).

The calibration sequences run through the model (``velox_core.artifacts.Calibration``). Of each
sequence, the positions KVTC stores exactly are skipped (the first ``sinks`` and the last
``window``, as the paper samples only positions it compresses); every other position gives a
key row and a value row (:func:`velox_kvtc.features.to_rows`: RoPE undone, every layer and
head side by side). The sequences are split in two: the first ones fit the transform, the
last ``heldout`` share measures it.

* **PCA.** Per side, the mean and covariance of the fit rows (accumulated in float64) and its
  eigenvectors, sorted by eigenvalue (the PCA basis the paper takes from an SVD of the centred
  rows; with ``F`` in the thousands the exact eigendecomposition is cheap, where the paper
  needs a randomized SVD). The basis is stored in float16, and rounded so before anything is
  measured on it.
* **Bit allocation.** The held-out rows are projected on that basis; their error table
  (:func:`velox_kvtc.allocation.error_table`) gives, for each target ratio, the plan of least
  error within ``floor(16 F / ratio)`` bits per token (:func:`~velox_kvtc.allocation.allocate`).
  Measuring on rows the PCA did not see charges each plan the energy a new cache has outside
  the fitted subspace, which the fit rows understate.

The artifact keeps the basis columns the widest plan stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core.artifacts import Calibration
from velox_core.ops.pca import pca
from velox_core.ops.rope import find_rope, rope_spec
from velox_core.validation import check_float, check_int

from .allocation import SIZES, TYPES, allocate, budget_bits, error_table
from .artifact import SIDES, KvtcBasis
from .features import read_caches, to_rows
from .quant import check_dtype

__all__ = ["RATIOS", "fit_kvtc", "ratio_key"]

RATIOS = (8.0, 16.0, 20.0, 24.0, 32.0)  # target ratios a fit allocates bits for, by default


def ratio_key(ratio: Any) -> str:
    """The name a ratio's plan is stored under (``16`` -> ``"16"``, ``20.5`` -> ``"20.5"``).

    Raises:
        ValueError, TypeError: not a finite number > 1.
    """
    return f"{check_float('ratio', ratio, minimum=1.0, open_min=True):g}"


def fit_kvtc(
    model: Any,
    tokenizer_or_token_ids: Any,
    text: str | list[str] | None = None,
    *,
    max_tokens: int | None = None,
    seq_len: int = 2048,
    chunk: int = 512,
    source: str | None = None,
    ratios: Sequence[float] = RATIOS,
    sinks: int = 4,
    window: int = 128,
    heldout: float = 0.25,
    sizes: Sequence[int] = SIZES,
    types: Sequence[str] = TYPES,
) -> KvtcBasis:
    """Fit ``model``'s KVTC bases and bit allocations on calibration tokens.

    Args:
        ratios: target compression ratios (against float16, before entropy coding) to
            allocate bits for; a cache is saved at one of them.
        sinks, window: positions of each calibration sequence left out (KVTC keeps them).
        heldout: share of the sequences (the last ones) that measure the allocation's errors
            instead of fitting the PCA.
        sizes, types: the group sizes and data types the allocation chooses among.
        model, tokenizer_or_token_ids, text, max_tokens, seq_len, chunk, source: the model
            (run as it is) and its calibration (:class:`velox_core.artifacts.Calibration`).

    Raises:
        ValueError: too few calibration tokens for a held-out part and a fit, bad arguments.
    """
    cal = Calibration.of(
        tokenizer_or_token_ids, text, "fit_kvtc", max_tokens, seq_len, chunk, source, 2
    )
    ids = cal.ids
    sinks, window = check_int("sinks", sinks, minimum=0), check_int("window", window, minimum=0)
    check_float("heldout", heldout, minimum=0.0, maximum=1.0, open_min=True)
    keys = sorted({ratio_key(r) for r in ratios}, key=float)
    if not keys:
        raise ValueError("fit_kvtc: give at least one target ratio")
    sizes = sorted({check_int("sizes[i]", s, minimum=1) for s in sizes})
    types = [check_dtype(t, "types[i]") for t in types]
    if 1 not in sizes:
        raise ValueError("fit_kvtc: sizes must include 1 (any component count must be covered)")
    n_seq = -(-ids.size // seq_len)
    held = max(1, round(n_seq * heldout))
    if n_seq - held < 1 or seq_len <= sinks + window:
        raise ValueError(
            f"fit_kvtc: {ids.size} tokens make {n_seq} sequences of {seq_len}; a fit needs at "
            f"least 2 (one held out) longer than sinks + window = {sinks + window}"
        )
    grams = {s: None for s in SIDES}
    totals = {s: None for s in SIDES}
    held_rows: dict[str, list[mx.array]] = {s: [] for s in SIDES}
    n_fit, geometry, ropes = 0, None, None
    for j, (_, caches) in enumerate(cal.prefilled(model)):
        kv, _ = read_caches([c for _, c in caches])
        if ropes is None:
            idx = [i for i, _ in caches]
            ropes = {i: rope_spec(find_rope(model, i, method="kvtc"), method="kvtc") for i in idx}
            geometry = {i: (k.shape[1], k.shape[3], v.shape[3]) for i, (k, v) in zip(idx, kv)}
        t = kv[0][0].shape[2]
        if t <= sinks + window:
            continue
        rows = to_rows(kv, list(ropes.values()), sinks, t - window)
        for s, x in zip(SIDES, rows):
            if j >= n_seq - held:
                held_rows[s].append(x)
                continue
            xd = np.array(x, dtype=np.float64)
            g, tot = xd.T @ xd, xd.sum(axis=0)
            grams[s] = g if grams[s] is None else grams[s] + g
            totals[s] = tot if totals[s] is None else totals[s] + tot
        if j < n_seq - held:
            n_fit += rows[0].shape[0]
        mx.eval(held_rows["key"][-1:], held_rows["value"][-1:])
    if geometry is None or not n_fit or not held_rows["key"]:
        raise ValueError("fit_kvtc: no calibration rows (no attention layers, or too few tokens)")
    means, bases, variance, plans = {}, {}, {}, {k: {} for k in keys}
    for s in SIDES:
        mean, lam, vec = pca(totals[s], grams[s], n_fit)
        basis = mx.array(vec.astype(np.float16))
        mean_mx = mx.array(mean.astype(np.float32))
        z = (mx.concatenate(held_rows[s]) - mean_mx) @ basis.astype(mx.float32)
        table = error_table(z, sizes, types)
        for k in keys:
            plans[k][s] = allocate(table, z.shape[1], budget_bits(basis.shape[0], float(k)))
        keep = max(max(plans[k][s].components for k in keys), 1)
        means[s], bases[s], variance[s] = mean_mx, basis[:, :keep], [float(x) for x in lam[:keep]]
    provenance = cal.fitted(
        model,
        rows={"fit": int(n_fit), "heldout": int(sum(x.shape[0] for x in held_rows["key"]))},
        sinks=sinks,
        window=window,
        sizes=list(sizes),
        types=list(types),
    )
    return KvtcBasis(means, bases, geometry, ropes, plans, variance, **provenance)
