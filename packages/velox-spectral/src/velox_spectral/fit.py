"""Fitting a model's spectral (PCA) bases on calibration text.

Per attention layer and KV head, from the keys (post-RoPE, as the caches hold them, each
turned by the layer's RoPE to a position drawn uniformly from ``[0, positions)``, so that the
basis fits keys at every position a cache will hold, not only those of one calibration
sequence) and the values of the calibration tokens: the mean ``mu`` and the covariance
``C = E[x x^T] - mu mu^T`` over every token of every calibration sequence but the first
``skip`` of each (the attention sinks, whose outlying keys the caches keep exact), then the
eigen-decomposition ``C = P diag(lambda) P^T`` in float64, eigenvalues descending. Each
eigenvector's sign is fixed (its entry of largest magnitude positive), so a fit is
reproducible to the last bit on one machine, and each is stored as int8 codes with a float32
scale (:func:`~velox_spectral.artifact.int8_columns`, as the caches hold it).

One pass over the calibration: every sequence is prefilled into plain velox caches
(:meth:`velox_core.artifacts.Calibration.prefilled`) and each layer's sums ``n``, ``sum x`` and
``sum x x^T`` are accumulated in float64.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core.artifacts import Calibration
from velox_core.ops import pca as ops_pca
from velox_core.ops.rope import RopeSpec, find_rope, rope_spec, rotate
from velox_core.validation import check_int

from .artifact import SIDES, SpectralBases, int8_columns

__all__ = ["POSITIONS", "SKIP", "fit_spectral", "pca"]

SKIP = 4  # first tokens of every calibration sequence left out of the fit
POSITIONS = 16384  # the key bases cover positions 0 to this (keys moved there by RoPE)


def _rope(model: Any, layer: int) -> RopeSpec | None:
    """The layer's RoPE, or None where it has none velox reads (its keys are fitted as they
    are)."""
    try:
        return rope_spec(find_rope(model, layer, "fit_spectral"), "fit_spectral")
    except (ValueError, TypeError):
        return None


def moved(keys: mx.array, first: int, spec: RopeSpec, positions: int, rng) -> mx.array:
    """Post-RoPE keys at positions ``first, first + 1, ...`` turned to positions drawn
    uniformly from ``[0, positions)``, one each (RoPE composes: ``R(p) R(s)^-1 = R(p - s)``).

    Shapes: keys ``(H, T, D)``; returns float32 ``(H, T, D)``.
    """
    t = keys.shape[1]
    target = rng.integers(0, positions, size=t)
    delta = mx.array((target - np.arange(first, first + t)).astype(np.int32))
    return rotate(keys[None], delta, spec)[0]


def pca(total: np.ndarray, outer: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """The mean, eigenvalues (descending) and eigenvectors (columns, sign-fixed) of rows whose
    sum is ``total`` and whose sum of outer products is ``outer``
    (:func:`velox_core.ops.pca.pca`), of at least 2 rows.

    Shapes: total ``(H, D)``, outer ``(H, D, D)``; returns ``(H, D)``, ``(H, D)`` and
    ``(H, D, D)`` float64.
    """
    if n < 2:
        raise ValueError(f"pca: at least 2 rows are needed, got {n}")
    return ops_pca.pca(total, outer, n)


def fit_spectral(
    model: Any,
    tokenizer_or_token_ids: Any,
    text: str | list[str] | None = None,
    *,
    max_tokens: int | None = None,
    seq_len: int = 2048,
    chunk: int = 512,
    skip: int = SKIP,
    positions: int = POSITIONS,
    seed: int = 0,
    source: str | None = None,
) -> SpectralBases:
    """Fit the PCA bases of ``model``'s keys and values on calibration tokens.

    Args:
        skip: first tokens of every calibration sequence left out (the attention sinks).
        positions: the positions the key bases cover: each calibration key is turned by its
            layer's RoPE to a position drawn uniformly from ``[0, positions)`` (a post-RoPE
            key's law depends on its position: the components RoPE turns slowly are nearly
            constant over one calibration sequence, and keys past it would meet a basis
            fitted for none of their angles). 0: the keys as the calibration made them.
            Layers without a RoPE velox reads keep their keys.
        seed: seed of those positions.
        model, tokenizer_or_token_ids, text, max_tokens, seq_len, chunk, source: the model (run
            as it is: cast it first to fit in another dtype) and its calibration
            (:class:`velox_core.artifacts.Calibration`).
    """
    cal = Calibration.of(
        tokenizer_or_token_ids, text, "fit_spectral", max_tokens, seq_len, chunk, source
    )
    check_int("skip", skip, minimum=0)
    check_int("positions", positions, minimum=0)
    check_int("seed", seed, minimum=0)
    rng = np.random.default_rng(seed)
    ropes: dict[int, RopeSpec | None] = {}
    if skip >= seq_len:
        raise ValueError(f"fit_spectral: skip={skip} leaves nothing of {seq_len}-token sequences")

    sums: dict[tuple[int, str], list[Any]] = {}  # (layer, side) -> [n, sum x, sum x x^T]
    for _, caches in cal.prefilled(model):
        for i, cache in caches:
            for side, x in zip(SIDES, cache.keys_and_values()):
                x = x[0, :, skip:].astype(mx.float32)  # (H, T, D)
                if x.shape[1] == 0:
                    continue
                if side == "key" and positions:
                    spec = ropes[i] if i in ropes else ropes.setdefault(i, _rope(model, i))
                    if spec is not None:
                        x = moved(x, skip, spec, positions, rng)
                part = mx.sum(x, axis=1), mx.swapaxes(x, -1, -2) @ x
                mx.eval(part)
                acc = sums.setdefault((i, side), [0, 0.0, 0.0])
                acc[0] += x.shape[1]
                acc[1] = acc[1] + np.asarray(part[0], dtype=np.float64)
                acc[2] = acc[2] + np.asarray(part[1], dtype=np.float64)
    if not sums:
        raise ValueError(
            "fit_spectral: no keys were observed (no velox-cached layers, or every calibration "
            f"sequence is at most skip={skip} tokens)"
        )
    layers: dict[int, dict[str, dict[str, mx.array]]] = {}
    for (i, side), (n, total, outer) in sorted(sums.items()):
        try:
            mean, lam, vec = pca(total, outer, n)
        except ValueError as e:
            raise ValueError(f"fit_spectral: layer {i} {side}s: {e}") from None
        codes, scale = int8_columns(vec)
        layers.setdefault(i, {})[side] = {
            "basis": mx.array(codes),
            "basis_scale": mx.array(scale),
            "mean": mx.array(mean.astype(np.float32)),
            "eigenvalues": mx.array(lam.astype(np.float32)),
        }
    moved_layers = sorted(i for i, spec in ropes.items() if spec is not None)
    provenance = cal.fitted(
        model,
        skip=skip,
        positions=positions,
        seed=seed,
        moved_layers=moved_layers,
    )
    return SpectralBases(layers, **provenance)
