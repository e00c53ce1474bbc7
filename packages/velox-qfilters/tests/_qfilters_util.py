"""Shared helpers of the Q-Filters tests: fitted artifacts, attention statistics."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from velox_core import RetentionPolicy, VeloxCache, make_cache, routed
from velox_qfilters import Filters, fit_filters, save_filters
from velox_testing import fitted_artifact, scratch_dir

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = ROOT / "shared" / "reference-model"
REFERENCE_ARTIFACT = ROOT / "shared" / "artifacts" / "qfilters-reference-model.safetensors"
_TMP = scratch_dir("velox-qfilters-tests-")


def conformance_filters() -> str:
    """Q-Filters fitted for :func:`conformance_model` (1,024 random tokens), as a path."""
    return fitted_artifact(
        fit_filters, save_filters, _TMP, "conformance", seq_len=512, samples=1024
    )


def artifact(filters: mx.array, name: str, fp: str = "synthetic", layers: int = 1) -> str:
    """An artifact holding ``filters`` (H_kv, D) for layers ``0..layers-1``."""
    f = Filters(
        {i: filters.astype(mx.float32) for i in range(layers)}, fingerprint=fp, model={"test": True}
    )
    return str(save_filters(f, _TMP / f"{name}.safetensors"))


class QueryRecorder(RetentionPolicy):
    """Keeps every query a layer's attention sees (to measure attention afterwards)."""

    name = "qfilters-test-recorder"

    def __init__(self, store: dict, layer: int):
        super().__init__()
        self.store, self.layer = store, layer

    def observe(self, view, queries, scale):
        self.store.setdefault(self.layer, []).append(queries[0].astype(mx.float32))


def keys_and_queries(model, ids: np.ndarray):
    """Per layer, post-RoPE keys ``(H_kv, T, D)`` and queries ``(Hq, T, D)`` of ``ids``."""
    store: dict = {}
    caches = make_cache(model, lambda i: VeloxCache(policy=QueryRecorder(store, i)))
    with routed(model):
        model(mx.array(ids)[None], cache=caches)
    out = []
    for i, c in enumerate(caches):
        k, _ = c.keys_and_values()
        out.append((k[0].astype(mx.float32), mx.concatenate(store[i], axis=1)))
    return out


def received_attention(k: mx.array, q: mx.array, last: int) -> np.ndarray:
    """Mean attention each of the first ``T - last`` keys receives from the ``last`` queries.

    Shapes: ``k (T, D)``, ``q (r, T, D)`` (the query heads sharing the KV head); returns
    ``(T - last,)``.
    """
    t, d = k.shape
    logits = q[:, -last:] @ k.T / np.sqrt(d)  # (r, last, T)
    causal = mx.arange(t)[None, :] <= mx.arange(t - last, t)[:, None]
    a = mx.softmax(mx.where(causal, logits, -mx.inf), axis=-1)
    return np.array(mx.mean(a[:, :, : t - last], axis=(0, 1)))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])
