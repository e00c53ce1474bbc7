"""Shared helpers of the CommVQ tests: fitted and synthetic artifacts."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from velox_commvq import (
    Codebooks,
    Geometry,
    RopeSpec,
    fingerprint,
    fit_codebooks,
    fit_residual,
    pre_rope_units,
    save_codebooks,
)
from velox_testing import conformance_model, fitted_artifact, kv_like, scratch_dir

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = ROOT / "shared" / "reference-model"
REFERENCE_ARTIFACT = ROOT / "shared" / "artifacts" / "commvq-reference-model.safetensors"
BASE = 10000.0
SMALL = {"pairs": 2, "entries": 4, "stages": 2}
_TMP = scratch_dir("velox-commvq-tests-")


def conformance_codebooks() -> str:
    """Codebooks fitted on :func:`conformance_model`'s keys (2,048 random tokens), as a path:
    a small geometry (2 stages of 4+4 entries per 2 pairs, 1 bit each) that fits in seconds."""
    options = {"seq_len": 1024, "samples": 2048, "iters": 8, **SMALL}
    return fitted_artifact(fit_codebooks, save_codebooks, _TMP, "conformance", 2048, **options)


@lru_cache(maxsize=1)
def kv_codebooks() -> str:
    """Codebooks fitted on keys of ``kv_data``'s law (:func:`kv_like`, not the test tokens
    themselves), taken as post-RoPE keys at positions 0 to 2047 as the conformance suite feeds
    them, for both layers of :func:`conformance_model` under its fingerprint: what the
    standalone tests feed a cache is what these codebooks were fitted on, as a model's keys
    are for its own codebooks."""
    model = conformance_model()
    spec = RopeSpec.from_base(BASE, 128)
    keys = [pre_rope_units(kv_like(2048, noise_seed=1000 + s), spec)[0] for s in range(2)]
    u = mx.concatenate(keys, axis=1)  # (H, N, P, 2)
    geo = Geometry(**SMALL)
    books = [fit_residual(u[h], geo, iters=8, seed=h) for h in range(u.shape[0])]
    ab = (mx.stack([x[0] for x in books]), mx.stack([x[1] for x in books]))
    out = Codebooks(
        {0: ab, 1: ab}, {0: [128, 0], 1: [128, 0]}, geo.pairs, fingerprint=fingerprint(model)
    )
    return str(save_codebooks(out, _TMP / "kv-data.safetensors"))


def synthetic(
    name: str,
    heads: int = 2,
    dim: int = 128,
    stages: int = 4,
    entries: int = 16,
    pairs: int = 8,
    layout: tuple[int, int] | None = None,
    fp: str = "synthetic",
    seed: int = 0,
) -> str:
    """An artifact of random codebooks for layer 0 (for the mathematics, not for quality)."""
    shape = (heads, stages, dim // 2, entries, 2)
    a = 0.1 * mx.random.normal(shape, key=mx.random.key(seed))
    b = 0.1 * mx.random.normal(shape, key=mx.random.key(seed + 1))
    books = Codebooks(
        {0: (a, b)}, {0: list(layout or (dim, 0))}, pairs, fingerprint=fp, model={"test": True}
    )
    return str(save_codebooks(books, _TMP / f"{name}.safetensors"))


def tmp_path(name: str) -> Path:
    return _TMP / name
