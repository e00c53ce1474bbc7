"""Fitting a model's Palu bases and rank-allocation weights on calibration text.

Palu (arXiv 2407.21118, Sec. 3.1-3.3; the authors' ``decomposition.py`` and
``svd_linear.py``) factors each head group's projection ``W`` (``gD x n``) by an SVD whitened
with the calibration inputs ``X`` (``N x n``): with ``S S^T = X^T X`` (Cholesky), ``W S =
U Sigma V^T``, the rank-``r`` factors ``L = U_r Sigma_r^(1/2)`` and
``R = Sigma_r^(1/2) V_r^T S^-1`` minimize ``||X W^T - X (L R)^T||_F``, and the cache holds
``h = x R^T``. Since ``(X W^T)^T (X W^T) = W S S^T W^T = U Sigma^2 U^T``, ``U`` and
``Sigma`` are the right-singular vectors and singular values of the calibration *outputs*
``Y = X W^T``, and for every ``x``, ``x (L R)^T = x W^T U_r U_r^T``: the rank-``r`` Palu
projection of ``x`` is the exact output projected onto ``U_r``, and ``h = y U_r
Sigma_r^(-1/2)``. :func:`fit_palu` therefore needs only the outputs, which a velox cache
sees: it accumulates each group's Gram matrix ``Y^T Y`` of the pre-RoPE keys (post-RoPE keys
turned back at their positions) and of the values, over every calibration token, takes its
eigenvectors (float64) and stores them all (caches pick ``r``). A projection bias is taken off
first and kept (Palu leaves it outside the factors).

Rank allocation (:mod:`velox_palu.ranks`) uses the Fisher information of each layer's
``k_proj`` and ``v_proj`` weights: the mean over the weights of the root-mean-square gradient
of the next-token loss over the calibration sequences, as the authors' ``calib_fisher_info``.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from velox_core.artifacts import Calibration
from velox_core.ops.pca import principal_axes
from velox_core.ops.rope import fast_rotate as rope_at
from velox_core.ops.rope import find_rope, rope_spec
from velox_core.validation import check_int

from .artifact import PaluBases

__all__ = ["bases_from_gram", "fisher_information", "fit_palu", "group_gram"]

_PROJ = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|attention|attn)\.([kv])_proj\.weight$")


def group_gram(y: mx.array, g: int) -> mx.array:
    """Each head group's Gram matrix of its outputs.

    Shapes: y ``(B, H, T, D)``; returns float32 ``(H/g, gD, gD)`` summed over batch and tokens.
    """
    b, h, t, d = y.shape
    yg = y.astype(mx.float32).reshape(b, h // g, g, t, d).transpose(1, 0, 3, 2, 4)
    yg = yg.reshape(h // g, b * t, g * d)
    return mx.swapaxes(yg, -1, -2) @ yg


def bases_from_gram(gram: np.ndarray, tokens: int) -> tuple[mx.array, mx.array]:
    """Right-singular vectors and RMS singular values from a Gram matrix.

    Shapes: gram ``(G, gD, gD)``; returns basis float32 ``(G, gD, gD)`` (columns sorted by
    singular value, largest first, signs fixed so each column's largest entry is positive) and
    sigma float32 ``(G, gD)`` (``sqrt(eigenvalue / tokens)``).
    """
    lam, vec = principal_axes(gram)
    sigma = np.sqrt(lam / max(tokens, 1))
    return mx.array(vec.astype(np.float32)), mx.array(sigma.astype(np.float32))


def _attention(model: Any, layer: int) -> Any:
    for a in ("self_attn", "attention", "attn"):
        m = getattr(model.layers[layer], a, None)
        if m is not None:
            return m
    return None


def _bias(model: Any, layer: int, side: str, h: int, d: int) -> mx.array | None:
    proj = getattr(_attention(model, layer), f"{side[0]}_proj", None)
    b = getattr(proj, "bias", None) if proj is not None else None
    if b is None or b.size != h * d:
        return None
    return b.astype(mx.float32).reshape(h, d)


def fisher_information(model: Any, sequences: list[mx.array]) -> dict[int, list[float]]:
    """Per attention layer, ``[key, value]``: the mean over each projection's weights of
    ``sqrt(mean over sequences of grad^2)`` of the next-token cross-entropy.

    Raises:
        ValueError: the model has no ``k_proj`` / ``v_proj`` weights with gradients (a
            quantized or fused-projection model): fit with ``allocation="uniform"``.
    """
    names = [n for n, _ in tree_flatten(model.parameters()) if _PROJ.search(n)]
    if not names or any(
        not mx.issubdtype(p.dtype, mx.floating)
        for n, p in tree_flatten(model.parameters())
        if n in names
    ):
        raise ValueError(
            "palu: Fisher rank allocation needs float layers.<i>.self_attn.k_proj/v_proj weights "
            "(this model has none: quantized or fused projections); fit with --no-fisher "
            "(uniform allocation)"
        )

    def loss(m, x):
        logits = m(x[:, :-1])
        return nn.losses.cross_entropy(logits.astype(mx.float32), x[:, 1:], reduction="mean")

    grad = nn.value_and_grad(model, loss)
    sums: dict[str, mx.array] = {}
    for seq in sequences:
        _, grads = grad(model, seq)
        flat = dict(tree_flatten(grads))
        for n in names:
            g2 = flat[n].astype(mx.float32) ** 2
            sums[n] = g2 if n not in sums else sums[n] + g2
        mx.eval(sums)
    out: dict[int, list[float]] = {}
    for n in names:
        i, side = _PROJ.search(n).groups()
        f = float(mx.mean(mx.sqrt(sums[n] / len(sequences))).item())
        out.setdefault(int(i), [0.0, 0.0])[0 if side == "k" else 1] = f
    return out


def fit_palu(
    model: Any,
    tokenizer_or_token_ids: Any,
    text: str | list[str] | None = None,
    *,
    max_tokens: int | None = None,
    heads_per_group: int | None = None,
    seq_len: int = 2048,
    fisher: bool = True,
    chunk: int = 512,
    source: str | None = None,
) -> PaluBases:
    """Fit the Palu bases (and Fisher weights) of ``model`` on calibration tokens.

    Args:
        seq_len: tokens per calibration sequence (the Fisher pass runs the same sequences).
        heads_per_group: KV heads per group ``g`` (Palu's G-LRD; default 4, or all KV heads
            where a layer has fewer); must divide every layer's KV heads.
        fisher: compute the Fisher information for rank allocation.
        model, tokenizer_or_token_ids, text, max_tokens, chunk, source: the model (run as it
            is: cast it first to fit in another dtype) and its calibration
            (:class:`velox_core.artifacts.Calibration`).
    """
    cal = Calibration.of(
        tokenizer_or_token_ids, text, "fit_palu", max_tokens, seq_len, chunk, source, 2
    )
    ids = cal.ids
    if ids.size < 2:
        raise ValueError(f"fit_palu: the calibration holds {ids.size} token; it needs 2 at least")
    if heads_per_group is not None:
        check_int("heads_per_group", heads_per_group, minimum=1)
    grams: dict[tuple[int, str], mx.array] = {}
    specs, heads, tokens = {}, {}, 0
    sequences = []  # (1, T) each, run again by the Fisher pass
    for seq, caches in cal.prefilled(model):
        sequences.append(seq)
        tokens += seq.shape[1]
        for i, cache in caches:
            k, v = cache.keys_and_values()
            h, d = k.shape[1], k.shape[3]
            if i not in specs:
                specs[i] = rope_spec(find_rope(model, i, method="palu"), method="palu")
                g = heads_per_group or min(4, h)
                if h % g:
                    raise ValueError(f"heads_per_group={g} must divide layer {i}'s {h} KV heads")
                heads[i] = (h, d, g)
            g = heads[i][2]
            pre = rope_at(k, mx.zeros((1,), mx.int32), specs[i], inverse=True)
            for side, y in (("key", pre), ("value", v.astype(mx.float32))):
                bias = _bias(model, i, side, h, d)
                y = y if bias is None else y - bias[None, :, None]
                gram = group_gram(y, g)
                grams[(i, side)] = gram if (i, side) not in grams else grams[(i, side)] + gram
            mx.eval([grams[(i, s)] for s in ("key", "value")])
    if not grams:
        raise ValueError("fit_palu: no attention layer was observed (no velox-cached layers?)")
    gs = {g for _, _, g in heads.values()}
    if len(gs) != 1:
        raise ValueError(f"fit_palu: layers would need different head groups {sorted(gs)}")
    bases, biases = {}, {}
    for (i, side), gram in grams.items():
        bases[(i, side)] = bases_from_gram(np.array(gram), tokens)
        h, d, _ = heads[i]
        bias = _bias(model, i, side, h, d)
        if bias is not None:
            biases[(i, side)] = bias
    weights = {}
    if fisher:
        weights = fisher_information(model, sequences)
        weights = {i: weights[i] for i in heads if i in weights}
        if set(weights) != set(heads):
            raise ValueError(
                "palu: Fisher information was found for layers "
                f"{sorted(weights)} of {sorted(heads)}; fit with --no-fisher"
            )
    layouts = {i: [int(s.dims), int(s.traditional)] for i, s in specs.items()}
    provenance = cal.fitted(model, tokens=int(tokens), fisher=bool(fisher))
    return PaluBases(bases, biases, gs.pop(), layouts, weights, **provenance)
