"""Fitting a mapper: closed-form ridge regressions from the source's K/V to the target's.

Both models prefill the same calibration sequences (each from position 0) into mlx-lm
``KVCache``; every layer's keys are taken back to content space (RoPE undone,
:func:`velox_transfer.spec.layer_features`). For each target layer, the regressors at
position ``t`` are the concatenated content-space keys and values (every KV head) of the
chosen source layers at positions ``t - l`` for each lag ``l`` in ``lags`` (position 0's
where ``t - l < 0``: :func:`lagged`); all of them are in the source's cache. The responses
are the target layer's content-space keys and values at ``t`` (every KV head; each head's
columns are their own regression, they only share the inputs). The fit needs only second
moments, accumulated sequence by sequence in float64 over the source's and target's rows
side by side, so calibration length costs time, not memory.

Which source layers: every one by default (one eigendecomposition shared by all target
layers). With ``layers_per_target`` below the source's layer count, greedy forward
selection by held-out fit: starting from none, the source layer whose addition gives the
best held-out score (the mean of the keys' and the values' R²) is added, up to
``layers_per_target``, stopping early when no layer adds at least ``MIN_GAIN`` to it.
The ridge strength is chosen per target layer (and candidate) from ``alphas`` (relative to
the mean eigenvalue of the regressors' covariance) on the same held-out rows. The held-out
rows come from calibration documents the regressions never see.

Factorisation: target layers that read the same source layers form a group, and the group's
ridge maps ``W = [W_i ...]`` (``(F, sum of O_i)``) are replaced by ``u v`` of rank ``r``:
``v``'s rows are the leading eigenvectors of the fitted values' covariance ``Wᵀ C W`` (``C``
the regressors' fit covariance), with each target layer's keys and each one's values scaled
to equal fit variance first, so that the kept directions serve every layer's R² rather than
the outputs of largest variance. The rank is the smallest of 16, 24, 32, 48, 64, ... whose
held-out error (one minus the mean over the group's layers of their keys' and values' R²) is
at most ``1 + rank_tol`` times the unfactorised maps', or ``rank`` when given. ``u`` and
``v`` are rounded to the storage dtype before that score and the intercepts are computed, so
the manifest's R² are those of the weights saved.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from velox_core.validation import check_int

from .mapper import WEIGHT_DTYPES, LayerMap, Mapper
from .spec import ModelSpec, layer_features

__all__ = ["ALPHAS", "LAGS", "RANK_TOL", "fit_mapper", "lagged", "model_rows"]

ALPHAS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
LAGS = (0, 1, 2, 3)  # source positions t, t-1, t-2, t-3 feed target position t
CHUNK = 512  # prefill chunk, tokens
MIN_GAIN = 1e-3  # held-out score a further source layer must add to be taken
RANK_TOL = 0.01  # held-out error a factorised map may add, relative to the unfactorised one's


def model_rows(model: Any, spec: ModelSpec, tokens: np.ndarray) -> np.ndarray:
    """Every layer's content-space rows for one sequence, layers side by side.

    Shapes:
        tokens ``(T,)``; returns float32 ``(T, sum of the layers' features)``.
    """
    caches = [KVCache() for _ in spec.layers]
    ids = mx.array(np.asarray(tokens, dtype=np.int32))[None]
    for s in range(0, ids.shape[1], CHUNK):
        model(ids[:, s : s + CHUNK], cache=caches)
        mx.eval([c.keys for c in caches], [c.values for c in caches])
    rows = [layer_features(*c.keys_and_values(), 0, ls)[0] for c, ls in zip(caches, spec.layers)]
    out = mx.concatenate(rows, axis=-1)
    mx.eval(out)
    return np.asarray(out, dtype=np.float32)


def lagged(rows: np.ndarray, lags: tuple[int, ...]) -> np.ndarray:
    """Each position's row with those ``lags`` positions back beside it (position 0's row
    where a lag reaches before the sequence).

    Shapes:
        rows ``(T, F)`` of positions ``0 .. T-1``; returns ``(T, len(lags) * F)``: lag
        ``lags[0]``'s ``F`` columns first.
    """
    at = np.arange(rows.shape[0])
    return np.concatenate([rows[np.maximum(at - lag, 0)] for lag in lags], axis=1)


def check_lags(lags) -> tuple[int, ...]:
    """``lags`` as a tuple of distinct non-negative ints, or a ``ValueError``."""
    if (
        not isinstance(lags, (tuple, list))
        or not lags
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in lags)
        or len(set(lags)) != len(lags)
    ):
        raise ValueError(f"lags must be distinct non-negative ints (e.g. (0, 1)), got {lags!r}")
    return tuple(int(x) for x in lags)


class _Moments:
    """Count, sums and cross products of regressor rows ``x`` and response rows ``y``
    (shifted by fixed vectors for float precision; of ``y`` only each column's square)."""

    def __init__(self, shift_x: np.ndarray, shift_y: np.ndarray):
        self.hx, self.hy = shift_x.astype(np.float64), shift_y.astype(np.float64)
        self.n = 0
        self.sx, self.sy = np.zeros(self.hx.size), np.zeros(self.hy.size)
        self.gxx = np.zeros((self.hx.size, self.hx.size))
        self.gxy = np.zeros((self.hx.size, self.hy.size))
        self.syy = np.zeros(self.hy.size)

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        u, v = x - self.hx.astype(np.float32), y - self.hy.astype(np.float32)
        self.n += u.shape[0]
        self.sx += u.sum(axis=0, dtype=np.float64)
        self.sy += v.sum(axis=0, dtype=np.float64)
        self.gxx += (u.T @ u).astype(np.float64)
        self.gxy += (u.T @ v).astype(np.float64)
        self.syy += np.einsum("ij,ij->j", v, v, dtype=np.float64)

    def means(self) -> tuple[np.ndarray, np.ndarray]:
        return self.hx + self.sx / self.n, self.hy + self.sy / self.n

    def centered(self, mx_: np.ndarray, my: np.ndarray) -> tuple:
        """``sum dx dx^T``, ``sum dx dy^T`` and ``sum dy**2`` (per column) about the means
        ``mx_``, ``my`` (``dx = x - mx_``, ``dy = y - my``)."""
        a, c = mx_ - self.hx, my - self.hy
        sa = np.outer(self.sx, a)
        cxx = self.gxx - sa - sa.T + self.n * np.outer(a, a)
        cxy = self.gxy - np.outer(self.sx, c) - np.outer(a, self.sy) + self.n * np.outer(a, c)
        cyy = self.syy - 2 * c * self.sy + self.n * c * c
        return cxx, cxy, cyy


def _offsets(spec: ModelSpec) -> list[slice]:
    out, at = [], 0
    for ls in spec.layers:
        out.append(slice(at, at + ls.features))
        at += ls.features
    return out


class _Selector:
    """Held-out scores of ridge fits on subsets of source layers, with each subset's
    eigendecomposition reused across target layers."""

    def __init__(self, train: _Moments, val: _Moments, alphas):
        self.mx, self.my = train.means()
        self.cxx, self.cxy, self.cyy = train.centered(self.mx, self.my)  # fit moments
        # held-out moments about the fit's means, and the held-out spread about its own
        self.vxx, self.vxy, self.vyy = val.centered(self.mx, self.my)
        self.sst = val.centered(*val.means())[2]
        self.alphas, self._eig = alphas, {}

    def _decomp(self, idx: np.ndarray, key: tuple) -> tuple:
        if key not in self._eig:
            e, q = np.linalg.eigh(self.cxx[np.ix_(idx, idx)])
            e = np.maximum(e, 0.0)
            a = q.T @ self.vxx[np.ix_(idx, idx)] @ q
            self._eig[key] = (e, q, a)
        return self._eig[key]

    def fit(self, idx: np.ndarray, key: tuple, cols: np.ndarray, nk: int) -> dict:
        """The best ridge (over ``alphas``) from features ``idx`` to outputs ``cols`` (the
        first ``nk`` of them keys): its score, alpha, weights and held-out SSE per column."""
        e, q, a = self._decomp(idx, key)
        p = q.T @ self.cxy[np.ix_(idx, cols)]
        bv = q.T @ self.vxy[np.ix_(idx, cols)]
        vyy = self.vyy[cols]
        sst = self.sst[cols]
        best = None
        for alpha in self.alphas:
            wq = p / (e + alpha * max(e.mean(), 1e-12))[:, None]
            sse = vyy - 2 * np.sum(wq * bv, axis=0) + np.sum(wq * (a @ wq), axis=0)
            r2k = 1 - sse[:nk].sum() / max(sst[:nk].sum(), 1e-30)
            r2v = 1 - sse[nk:].sum() / max(sst[nk:].sum(), 1e-30)
            score = 0.5 * (r2k + r2v)
            if best is None or score > best["score"]:
                best = {"score": score, "alpha": alpha, "wq": wq, "sse": sse, "r2": (r2k, r2v)}
        best["w"] = q @ best.pop("wq")
        return best


def _rounded(a: np.ndarray, dtype: mx.Dtype, what: str) -> np.ndarray:
    """``a`` rounded to ``dtype`` (float64 again), or a ``ValueError`` where it overflows."""
    out = np.array(mx.array(a.astype(np.float32)).astype(dtype).astype(mx.float32), np.float64)
    if not np.isfinite(out).all():
        raise ValueError(f"the mapper's {what} overflows {dtype}; fit with weights_dtype='float32'")
    return out


def _candidate_ranks(exact: int) -> list[int]:
    """16, 24, 32, 48, 64, 96, ... below ``exact``, then ``exact``."""
    out, r = [], 16
    while r < exact:
        out += [x for x in (r, r * 3 // 2) if x < exact]
        r *= 2
    return [*out, exact]


def _score(sse: np.ndarray, sst: np.ndarray, parts: list) -> float:
    """Mean over the layers of ``parts`` of their keys' and values' held-out R²."""
    at, scores = 0, []
    for _, cols, nk in parts:
        e, t = sse[at : at + cols.size], sst[cols]
        r2k = 1 - e[:nk].sum() / max(t[:nk].sum(), 1e-30)
        r2v = 1 - e[nk:].sum() / max(t[nk:].sum(), 1e-30)
        scores.append(0.5 * (r2k + r2v))
        at += cols.size
    return float(np.mean(scores))


def _factorise(sel: _Selector, idx: np.ndarray, parts: list, rank, tol: float, dtype) -> tuple:
    """One group's maps as ``u (F, r)`` and ``v (r, sum of O)`` (rounded to ``dtype``), and
    the held-out SSE of each output column.

    ``parts``: per target layer of the group, ``(res, cols, nk)``: its unfactorised fit
    (``res["w"]`` ``(F, O)``), its output columns and how many of them are keys.
    """
    scale = np.concatenate(  # each layer's keys and each one's values: equal fit variance
        [
            np.full(blk.size, 1 / np.sqrt(max(sel.cyy[blk].sum(), 1e-30)))
            for _, cols, nk in parts
            for blk in (cols[:nk], cols[nk:])
        ]
    )
    a = np.concatenate([res["w"] for res, _, _ in parts], axis=1) * scale  # (F, sum of O)
    e, q = np.linalg.eigh(a.T @ (sel.cxx[np.ix_(idx, idx)] @ a))
    e, q = e[::-1], q[:, ::-1]  # largest first
    exact = max(1, int(np.sum(e > max(e[0], 0.0) * 1e-10)))  # directions the data has
    cols = np.concatenate([c for _, c, _ in parts])
    vxx, vxy = sel.vxx[np.ix_(idx, idx)], sel.vxy[np.ix_(idx, cols)]
    full = _score(np.concatenate([res["sse"] for res, _, _ in parts]), sel.sst, parts)

    def at(r: int) -> tuple:
        u = a @ q[:, :r]
        norm = np.linalg.norm(u, axis=0)
        norm = np.where(norm > 0, norm, 1.0)  # u's columns of unit length, for the dtype
        u = _rounded(u / norm, dtype, "u")
        v = _rounded(norm[:, None] * q[:, :r].T / scale, dtype, "v")
        sse = (
            sel.vyy[cols] - 2 * np.sum(v * (u.T @ vxy), axis=0) + np.sum(v * (u.T @ vxx @ u @ v), 0)
        )
        return u, v, sse

    if rank is not None:
        return at(min(rank, exact))
    for r in _candidate_ranks(exact):
        u, v, sse = at(r)
        if 1 - _score(sse, sel.sst, parts) <= (1 + tol) * (1 - full):
            break
    return u, v, sse


def _moments(source, src: ModelSpec, target, tgt: ModelSpec, fit_seqs, held_seqs, lags) -> tuple:
    """Both models' rows of every sequence, accumulated: the fit and held-out
    :class:`_Moments` (regressors lagged by ``lags``) and their token counts."""
    train = val = None
    tokens = {"fit": 0, "heldout": 0}
    for name, seqs in (("fit", fit_seqs), ("heldout", held_seqs)):
        for seq in seqs:
            x = lagged(model_rows(source, src, seq), lags)
            y = model_rows(target, tgt, seq)
            if train is None:
                train = _Moments(x.mean(axis=0), y.mean(axis=0))
                val = _Moments(train.hx, train.hy)
            (train if name == "fit" else val).add(x, y)
            tokens[name] += x.shape[0]
    return train, val, tokens


def fit_mapper(
    source: Any,
    target: Any,
    fit_sequences: list[np.ndarray],
    heldout_sequences: list[np.ndarray],
    *,
    layers_per_target: int | None = None,
    lags: tuple[int, ...] = LAGS,
    alphas: tuple[float, ...] = ALPHAS,
    rank: int | None = None,
    rank_tol: float = RANK_TOL,
    weights_dtype: str = "float16",
    calibration: dict[str, Any] | None = None,
) -> Mapper:
    """Fit the mapper from ``source``'s caches to ``target``'s.

    Args:
        source, target: mlx-lm models sharing a tokenizer.
        fit_sequences: token sequences (each ``(T,)`` int, from position 0) the regressions
            are fitted on.
        heldout_sequences: other sequences, for the choice of source layers and ridge
            strength and for the R² the manifest reports.
        layers_per_target: most source layers feeding one target layer (``None``: all of
            them, no selection).
        lags: source positions back from each target position whose rows are regressors.
        alphas: candidate ridge strengths, relative to the mean eigenvalue of the regressors'
            covariance.
        rank: the rank of each group's factorised map (at most the rank its data has:
            a rank at least that keeps the maps unfactorised in effect); ``None``: the
            smallest candidate whose held-out error (one minus the mean R²) is at most
            ``1 + rank_tol`` times the unfactorised maps'.
        rank_tol: the held-out error the factorisation may add, relative to the unfactorised
            maps', when ``rank`` is ``None``.
        weights_dtype: storage dtype of ``u`` and ``v`` (``float16``, ``bfloat16`` or
            ``float32``); applying computes in float32 either way.
        calibration: recorded in the manifest (where the tokens came from).
    """
    lags = check_lags(lags)
    if layers_per_target is not None:
        check_int("layers_per_target", layers_per_target, minimum=1)
    if (
        not isinstance(alphas, (tuple, list))
        or not alphas
        or any(isinstance(a, bool) or not isinstance(a, (int, float)) or a <= 0 for a in alphas)
    ):
        raise ValueError(f"alphas must be positive numbers, got {alphas!r}")
    if rank is not None:
        check_int("rank", rank, minimum=1)
    if isinstance(rank_tol, bool) or not isinstance(rank_tol, (int, float)) or rank_tol < 0:
        raise ValueError(f"rank_tol must be a number >= 0, got {rank_tol!r}")
    if weights_dtype not in WEIGHT_DTYPES:
        raise ValueError(
            f"weights_dtype must be one of {sorted(WEIGHT_DTYPES)}, got {weights_dtype!r}"
        )
    if not fit_sequences or not heldout_sequences:
        raise ValueError("fit_mapper needs fit and held-out sequences (neither may be empty)")
    src, tgt = ModelSpec.of(source, "source"), ModelSpec.of(target, "target")
    n_src = len(src.layers)
    k = n_src if layers_per_target is None else min(layers_per_target, n_src)
    train, val, tokens = _moments(source, src, target, tgt, fit_sequences, heldout_sequences, lags)
    sel = _Selector(train, val, tuple(sorted(float(a) for a in alphas)))
    src_at, tgt_at = _offsets(src), _offsets(tgt)
    width = src_at[-1].stop  # one lag's columns: every source layer's features

    def columns(key: tuple) -> np.ndarray:  # lag-major, then source layer (the w row order)
        return np.concatenate(
            [
                np.arange(src_at[j].start, src_at[j].stop) + li * width
                for li in range(len(lags))
                for j in key
            ]
        )

    fits: dict[int, tuple] = {}  # target layer -> (unfactorised fit, source layers, columns)
    for i, ls in enumerate(tgt.layers):
        cols = np.arange(tgt_at[i].start, tgt_at[i].stop)
        nk = _keys(ls)
        if k == n_src:  # every source layer: nothing to select
            key = tuple(range(n_src))
            best = (sel.fit(columns(key), key, cols, nk), key, columns(key))
        else:
            chosen: list[int] = []
            best = None
            while len(chosen) < k:
                trials = []
                for j in range(n_src):
                    if j in chosen:
                        continue
                    key = tuple(sorted([*chosen, j]))
                    trials.append((sel.fit(columns(key), key, cols, nk), key, columns(key)))
                res, key, idx = max(trials, key=lambda t: t[0]["score"])
                if best is not None and res["score"] < best[0]["score"] + MIN_GAIN:
                    break
                best, chosen = (res, key, idx), list(key)
        fits[i] = best
    members: dict[tuple, list[int]] = {}  # source layers -> the target layers reading them
    for i, (_, key, _) in fits.items():
        members.setdefault(key, []).append(i)
    layers: dict[int, LayerMap] = {}
    info: list[dict[str, Any]] = [{} for _ in tgt.layers]
    groups: list[dict[str, Any]] = []
    dtype = WEIGHT_DTYPES[weights_dtype]
    for g, (key, group) in enumerate(members.items()):
        idx = fits[group[0]][2]
        parts = [
            (fits[i][0], np.arange(tgt_at[i].start, tgt_at[i].stop), _keys(tgt.layers[i]))
            for i in group
        ]
        u, v, sse = _factorise(sel, idx, parts, rank, rank_tol, dtype)
        groups.append(
            {"sources": list(key), "lags": list(lags), "rank": int(u.shape[1]), "layers": group}
        )
        mu, at = mx.array(u.astype(np.float32)), 0
        proj = sel.mx[idx] @ u  # the regressors' mean through u: (r,)
        for i, (res, cols, _) in zip(group, parts):
            vi, si = v[:, at : at + cols.size], sse[at : at + cols.size]
            at += cols.size
            b = sel.my[cols] - proj @ vi
            layers[i] = LayerMap(
                key, lags, g, mu, mx.array(vi.astype(np.float32)), mx.array(b.astype(np.float32))
            )
            info[i] = _layer_info(g, res, si, sel.sst[cols], tgt.layers[i], sel.alphas)
    calib = {**(calibration or {}), "tokens": tokens, "alphas": list(sel.alphas)}
    calib["rank"] = "auto" if rank is None else rank
    calib["rank_tol"] = rank_tol
    return Mapper(src, tgt, info, groups, calib, layers=layers, weights_dtype=weights_dtype)


def _keys(ls) -> int:
    """How many of a layer's output columns are keys (they come first)."""
    return ls.kv_heads * ls.key_dim


def _layer_info(g: int, res: dict, sse: np.ndarray, sst: np.ndarray, ls, alphas) -> dict:
    """The manifest's record of one target layer: its group, alpha (and whether it is at an
    end of the grid), held-out R² of the factorised map (all heads and per head; ``sse`` its
    held-out SSE per column) and of the unfactorised one (``res``)."""
    h, dk, dv = ls.kv_heads, ls.key_dim, ls.value_dim
    per_head = []
    for x in range(h):
        kc = slice(x * dk, (x + 1) * dk)
        vc = slice(h * dk + x * dv, h * dk + (x + 1) * dv)
        per_head.append(
            [
                float(1 - sse[kc].sum() / max(sst[kc].sum(), 1e-30)),
                float(1 - sse[vc].sum() / max(sst[vc].sum(), 1e-30)),
            ]
        )
    nk = h * dk
    return {
        "group": g,
        "alpha": res["alpha"],
        "alpha_at_edge": len(alphas) > 1 and res["alpha"] in (alphas[0], alphas[-1]),
        "r2_key": float(1 - sse[:nk].sum() / max(sst[:nk].sum(), 1e-30)),
        "r2_value": float(1 - sse[nk:].sum() / max(sst[nk:].sum(), 1e-30)),
        "r2_key_full": float(res["r2"][0]),
        "r2_value_full": float(res["r2"][1]),
        "r2_heads": per_head,
    }
