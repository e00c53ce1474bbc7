"""Fitting a model's OSCAR rotations and clip ratios on calibration text (arXiv 2605.17757).

Per attention layer, from the post-RoPE queries, keys and values of the calibration tokens (the
authors dump them at the attention kernel, after RoPE; here a recording policy sees every
query a velox cache attends with, and the caches hold the keys and values):

1. **Keys.** ``C_Q``, the query covariance each KV head's keys meet: for KV head ``h``,
   ``C_h = Q_h^T Q_h / n`` over the rows of its group of query heads (GQA), and ``C_Q`` their
   mean over the layer's KV heads. A key error ``e`` moves a logit by ``q . e``, whose mean
   square is ``e^T C_h e``: the eigenvectors of ``C_Q`` are the directions attention reads.
   ``R_K = U_Q H P_br`` (:func:`velox_oscar.rotation.oscar_rotation`).
2. **Values.** Each token's weight ``w_t = k_t^T C_h k_t`` (its expected squared logit), and
   ``C_S``, the mean over KV heads of ``sum_t w_t v_t v_t^T / sum_t w_t``;
   ``R_V = U_S H P_br``. Both estimates are those of the authors' ``compute_kv_rotation.py``
   (``qqt`` and ``sst``, composition ``r_h_pbr``), over every calibration token.
3. **Clip ratios.** On a sample of each layer's tokens, each ratio of :data:`CLIPS` is tried
   at every code width (2 to 8 bits) with the group the caches use (the rotation rounded to
   float16 as the caches hold it): keys scored by the logit error ``sum_h mean_t e^T C_h e``,
   values by the score-weighted error ``sum_h sum_t w_t |e_t|^2 / sum_t w_t``; the smallest
   wins (the first, least clipping, on a tie). The same is fitted for the plain Hadamard
   basis (the ablation), and for both bases with the keys centred (4).
4. **Key means.** Each KV head's mean key over every calibration token, the shift
   ``centre=True`` takes off the keys before they are coded (exact for attention: a shift
   common to every key moves all of a query's logits by the same amount). The rotations do
   not change: ``R_K`` comes from the queries alone (the logit error ``e^T C_h e`` does not
   depend on the keys' mean), and ``R_V``'s token weights are the authors' (uncentred keys).

Queries are seen in two passes over the calibration: the first accumulates ``C_Q`` (the
weights of step 2 need the whole of it), the second the value covariance and the sample.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import RetentionPolicy, Uniform, VeloxCache, make_cache, routed
from velox_core.artifacts import Calibration
from velox_core.ops import HadamardRotation
from velox_core.validation import check_int

from .artifact import OscarRotations
from .codec import default_group
from .rotation import Rotation, oscar_rotation, quantile_clip

__all__ = ["CLIPS", "WIDTHS", "clip_error", "fit_oscar", "gram_by_head"]

WIDTHS = tuple(range(2, 9))  # the code widths clip ratios are fitted for
# the clip tables: (basis, keys centred) -> the artifact's name, in OscarRotations' order
_TABLES = {
    ("oscar", False): "clips",
    ("hadamard", False): "hadamard_clips",
    ("oscar", True): "centred_clips",
    ("hadamard", True): "hadamard_centred_clips",
}
CLIPS = (1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92, 0.9, 0.88, 0.85, 0.8, 0.75, 0.7)


def gram_by_head(x: mx.array, heads: int) -> mx.array:
    """Each KV head's Gram matrix of its rows, the query heads of its group together.

    Shapes: x ``(B, Hx, L, D)`` with ``Hx`` a multiple of ``heads``; returns float32
    ``(heads, D, D)`` (``sum`` over batch, the group's heads and tokens).
    """
    b, hx, n, d = x.shape
    r = hx // heads
    g = x.astype(mx.float32).reshape(b, heads, r * n, d).transpose(1, 0, 2, 3)
    g = g.reshape(heads, b * r * n, d)
    return mx.swapaxes(g, -1, -2) @ g


class _QueryRecorder(RetentionPolicy):
    """Accumulates each KV head's query Gram matrix of one layer (keeps every token)."""

    name = "oscar-query-recorder"

    def __init__(self, store: dict, layer: int):
        super().__init__()
        self.store, self.layer = store, layer

    def observe(self, view, queries: mx.array, scale: float) -> None:
        gram = gram_by_head(queries, view.kv_heads)
        rows = queries.shape[0] * (queries.shape[1] // view.kv_heads) * queries.shape[2]
        old = self.store.get(self.layer)
        self.store[self.layer] = (gram, rows) if old is None else (old[0] + gram, old[1] + rows)


def _sample(rng: np.random.Generator, t: int, want: int) -> mx.array:
    return mx.array(np.sort(rng.choice(t, size=min(t, want), replace=False)).astype(np.int32))


def clip_error(
    x: mx.array,
    rot: Rotation | HadamardRotation,
    ratio: float,
    quant: Uniform,
    metric: mx.array | None = None,
    weights: mx.array | None = None,
) -> float:
    """The attention-aware error of coding ``x`` rotated, clipped at ``ratio`` and quantized.

    Args:
        x: ``(H, N, D)`` sample rows of each KV head.
        metric: ``(H, D, D)`` (keys): each head's query covariance, the error scored as
            ``mean_t e_t^T C_h e_t`` in the model's basis; None for values.
        weights: ``(H, N)`` (values): each row's score weight, the error scored as
            ``sum_t w_t |e_t|^2 / sum_t w_t`` (the rotation keeps norms).

    Returns:
        the error summed over heads.
    """
    y = rot.forward(x)
    e = quant.decode(quant.encode(quantile_clip(y, ratio)[None]))[0] - y  # (H, N, D), rotated
    if metric is not None:
        e = rot.inverse(e)
        return float(mx.sum(mx.mean(mx.sum((e @ metric) * e, axis=-1), axis=-1)).item())
    sq = mx.sum(e * e, axis=-1)
    return float(mx.sum(mx.sum(weights * sq, -1) / mx.sum(weights, -1)).item())


def _best_clip(x, rot, quant, metric=None, weights=None) -> float:
    errors = [clip_error(x, rot, c, quant, metric, weights) for c in CLIPS]
    return CLIPS[int(np.argmin(errors))]


def fit_oscar(
    model: Any,
    tokenizer_or_token_ids: Any,
    text: str | list[str] | None = None,
    *,
    max_tokens: int | None = None,
    seq_len: int = 2048,
    chunk: int = 512,
    samples: int = 4096,
    group: int | None = None,
    seed: int = 0,
    source: str | None = None,
) -> OscarRotations:
    """Fit the OSCAR rotations and clip ratios of ``model`` on calibration tokens.

    Args:
        samples: tokens per layer (every KV head's) on which the clip ratios are fitted.
        group: the group the clip ratios are fitted for (None: the caches' default, the whole
            head up to 128 channels).
        seed: seed of that sample.
        model, tokenizer_or_token_ids, text, max_tokens, seq_len, chunk, source: the model (run
            as it is: cast it first to fit in another dtype) and its calibration
            (:class:`velox_core.artifacts.Calibration`).
    """
    cal = Calibration.of(
        tokenizer_or_token_ids, text, "fit_oscar", max_tokens, seq_len, chunk, source
    )
    ids = cal.ids
    check_int("samples", samples, minimum=1)
    if group is not None:
        check_int("group", group, minimum=1)
    check_int("seed", seed, minimum=0)

    # pass 1: every layer's query Gram matrices per KV head
    grams: dict[int, tuple[mx.array, int]] = {}
    for s in range(0, ids.size, seq_len):
        seq = mx.array(ids[s : s + seq_len])[None]
        caches = make_cache(model, lambda i: VeloxCache(policy=_QueryRecorder(grams, i)))
        with routed(model):
            for c in range(0, seq.shape[1], chunk):
                model(seq[:, c : c + chunk], cache=caches)
                mx.eval([g for g, _ in grams.values()])
    if not grams:
        raise ValueError("fit_oscar: no attention layer was observed (no velox-cached layers?)")
    c_q = {i: g / n for i, (g, n) in grams.items()}  # (H, D, D) per layer

    # pass 2: score-weighted value covariances and the clip sample
    rng = np.random.default_rng(seed)
    per_seq = -(-samples * seq_len // max(ids.size, 1))
    vsum: dict[int, list[mx.array]] = {}
    ksum: dict[int, tuple[mx.array, int]] = {}
    sample: dict[int, list[tuple[mx.array, mx.array, mx.array]]] = {}
    for _, caches in cal.prefilled(model):
        for i, cache in caches:
            k, v = cache.keys_and_values()
            k, v = k[0].astype(mx.float32), v[0].astype(mx.float32)  # (H, T, Dk), (H, T, Dv)
            w = mx.sum((k @ c_q[i]) * k, axis=-1)  # (H, T)
            cov = mx.swapaxes(v * w[..., None], -1, -2) @ v
            acc = vsum.get(i)
            ws = mx.sum(w, -1)
            vsum[i] = [cov, ws] if acc is None else [acc[0] + cov, acc[1] + ws]
            s0, n0 = ksum.get(i, (0.0, 0))
            ksum[i] = (s0 + mx.sum(k, axis=1), n0 + k.shape[1])
            pick = _sample(rng, k.shape[1], per_seq)
            sample.setdefault(i, []).append((k[:, pick], v[:, pick], w[:, pick]))
            mx.eval(vsum[i], ksum[i][0], sample[i][-1])

    layers: dict[int, dict[str, mx.array]] = {}
    tables: dict[str, dict[int, dict[int, list[float]]]] = {}
    for i in sorted(c_q):
        kq = np.array(c_q[i], dtype=np.float64)
        cov, wsum = (np.array(a, dtype=np.float64) for a in vsum[i])
        c_s = np.mean(cov / np.maximum(wsum, 1e-30)[:, None, None], axis=0)
        try:
            r_k, lam_k = oscar_rotation(np.mean(kq, axis=0))
            r_v, lam_v = oscar_rotation(c_s)
        except ValueError as e:
            raise ValueError(f"fit_oscar: layer {i}: {e}") from None
        layers[i] = {
            "key": mx.array(r_k.astype(np.float32)),
            "value": mx.array(r_v.astype(np.float32)),
            "key_eigenvalues": mx.array(lam_k.astype(np.float32)),
            "value_eigenvalues": mx.array(lam_v.astype(np.float32)),
            "key_mean": ksum[i][0] / ksum[i][1],
        }
        ks, vs, ws = (mx.concatenate([p[j] for p in sample[i]], axis=1) for j in range(3))
        ks, vs = ks[:, :samples], vs[:, :samples]
        ws = ws[:, :samples]
        for (basis, centred), name in _TABLES.items():
            table = {b: [] for b in WIDTHS}
            centre = layers[i]["key_mean"][:, None] if centred else 0.0
            for side, x in (("key", ks - centre), ("value", vs)):
                d = x.shape[-1]
                g = group or default_group(d)
                if d % g:
                    raise ValueError(f"fit_oscar: group={g} must divide layer {i}'s head dim {d}")
                if basis == "oscar":
                    rot = Rotation(layers[i][side].astype(mx.float16))
                else:
                    rot = HadamardRotation(d)
                for b in WIDTHS:
                    quant = Uniform(b, g)
                    if side == "key":
                        table[b].append(_best_clip(x, rot, quant, metric=c_q[i]))
                    elif centred:  # the values are not centred: their uncentred ratio
                        table[b].append(tables[name.replace("centred_", "")][i][b][1])
                    else:
                        table[b].append(_best_clip(x, rot, quant, weights=ws))
            tables.setdefault(name, {})[i] = table
    provenance = cal.fitted(model, samples=samples, seed=seed)
    return OscarRotations(layers, *(tables[n] for n in _TABLES.values()), group or 0, **provenance)
