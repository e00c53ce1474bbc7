"""Shared helpers of the Palu tests: fitted and synthetic artifacts."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from velox_core.artifacts import fingerprint
from velox_core.ops.rope import RopeSpec
from velox_core.ops.rope import fast_rotate as rope_at
from velox_palu import PaluBases, bases_from_gram, fit_palu, group_gram, save_bases
from velox_testing import conformance_model, fitted_artifact, kv_data, kv_like, scratch_dir

BASE = 10000.0
_TMP = scratch_dir("velox-palu-tests-")


def model_artifact() -> str:
    """Bases and Fisher weights fitted on :func:`conformance_model` (1,024 random tokens)."""
    return fitted_artifact(fit_palu, save_bases, _TMP, seq_len=512)


@lru_cache(maxsize=1)
def kv_artifact() -> str:
    """Bases fitted on tokens of ``kv_data``'s law (other seeds' noise, not the test tokens),
    taken as post-RoPE keys at positions 0..T-1 as the conformance suite feeds them, for both
    layers of :func:`conformance_model` under its fingerprint (so make_cache accepts it)."""
    spec = RopeSpec.from_base(BASE, 128)
    kg, vg, n = 0, 0, 0
    for s in range(2):
        k = kv_like(2048, seed=0, noise_seed=100 + s)  # kv_data's channel law, other noise
        _, v = kv_data(t=2048, seed=100 + s)
        pre = rope_at(k, mx.zeros((1,), mx.int32), spec, inverse=True)
        kg, vg, n = kg + group_gram(pre, 2), vg + group_gram(v.astype(mx.float32), 2), n + 2048
    kb, vb = bases_from_gram(np.array(kg), n), bases_from_gram(np.array(vg), n)
    art = PaluBases(
        {(i, s): b for i in (0, 1) for s, b in (("key", kb), ("value", vb))},
        {},
        2,
        {0: [128, 0], 1: [128, 0]},
        {0: [1.0, 1.0], 1: [1.0, 1.0]},
        fingerprint=fingerprint(conformance_model()),
    )
    return str(save_bases(art, _TMP / "kv.safetensors"))


def tmp(name: str) -> Path:
    return _TMP / name
