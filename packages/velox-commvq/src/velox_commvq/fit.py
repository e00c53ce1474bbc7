"""Fitting a model's CommVQ codebooks on its own pre-RoPE keys.

CommVQ (arXiv 2506.18879, https://arxiv.org/abs/2506.18879) fits its key codebooks offline, per
layer and KV head, on keys collected from the model over calibration text (the authors'
``collect_kv.py`` and ``quantize_key_cache.py``). Here :func:`fit_codebooks` runs the model on
the calibration tokens (cut into sequences of ``seq_len`` tokens, each from position 0), takes
every attention layer's post-RoPE keys, un-rotates them at their positions with the layer's
RoPE, divides each by its per-token, per-head L2 norm, samples ``samples`` tokens and fits each
head's residual quantizer by EM (:func:`velox_commvq.em.fit_residual`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core.artifacts import Calibration
from velox_core.ops.rope import find_rope, rope_spec
from velox_core.validation import check_float, check_int

from .artifact import Codebooks
from .em import fit_residual
from .pairs import angles, rotate_pairs, to_pairs
from .vq import Geometry

__all__ = ["fit_codebooks", "pre_rope_units"]


def pre_rope_units(keys: mx.array, spec, start: int = 0) -> mx.array:
    """Normalized pre-RoPE channel pairs of post-RoPE keys at positions ``start, start+1...``.

    Shapes:
        keys ``(B, H, T, D)``; returns float32 ``(B, H, T, D/2, 2)``, each token's pairs of
        unit L2 norm per head.
    """
    t, d = keys.shape[2], keys.shape[3]
    cos, sin = angles(mx.arange(start, start + t), spec, d)
    z = rotate_pairs(to_pairs(keys, spec), cos, sin, inverse=True)
    n = mx.sqrt(mx.sum(z * z, axis=(-2, -1), keepdims=True))
    return z / mx.maximum(n, 1e-12)


def fit_codebooks(
    model: Any,
    tokenizer_or_token_ids: Any,
    text: str | list[str] | None = None,
    *,
    max_tokens: int | None = 16384,
    seq_len: int = 2048,
    samples: int = 4096,
    pairs: int = 4,
    entries: int = 16,
    stages: int = 2,
    iters: int = 16,
    temperature: tuple[float, float] = (0.3, 3e-3),
    seed: int = 0,
    chunk: int = 512,
    source: str | None = None,
) -> Codebooks:
    """Fit the CommVQ key codebooks of ``model`` on calibration text.

    Args:
        seq_len: tokens per calibration sequence, each run from position 0.
        samples: tokens sampled (uniformly, without replacement) to fit each head.
        pairs: RoPE pairs sharing one code per stage (``G``; must divide ``D/2``).
        entries: entries of each of a stage's two codebooks (``K``, a power of two).
        stages: residual stages; ``stages * log2(K) / G`` bits per coordinate at most (the
            defaults: 2 stages of 1 bit, so 1-bit caches use the first, 2-bit both).
        iters, temperature: EM iterations and relative temperatures (:mod:`velox_commvq.em`).
        seed: seed of the token sample and of the EM initialization.
        model, tokenizer_or_token_ids, text, max_tokens, chunk, source: the model (run as it
            is: cast it first to fit in another dtype) and its calibration
            (:class:`velox_core.artifacts.Calibration`).

    Returns:
        :class:`~velox_commvq.artifact.Codebooks` for every attention layer with a velox cache.
    """
    cal = Calibration.of(
        tokenizer_or_token_ids, text, "fit_codebooks", max_tokens, seq_len, chunk, source
    )
    ids = cal.ids
    for name, v in (("samples", samples), ("iters", iters)):
        check_int(name, v, minimum=1)
    check_int("seed", seed, minimum=0)
    check_int("entries", entries, minimum=2, maximum=256)
    if entries & (entries - 1):
        raise ValueError(f"entries must be a power of two, got {entries}")
    geometry = Geometry(
        check_int("pairs", pairs, minimum=1), entries, check_int("stages", stages, minimum=1)
    )
    t0, t1 = (check_float("temperature", t, minimum=0.0, open_min=True) for t in temperature)
    keys: dict[int, list[mx.array]] = {}
    specs: dict[int, Any] = {}
    for _, caches in cal.prefilled(model):
        for i, cache in caches:
            spec = specs.setdefault(i, rope_spec(find_rope(model, i, "commvq"), "commvq"))
            u = pre_rope_units(cache.keys_and_values()[0], spec)[0]  # (H, T, P, 2)
            keys.setdefault(i, []).append(u)
            mx.eval(keys[i][-1])
    if not keys:
        raise ValueError("fit_codebooks: no attention layer was observed (no velox-cached layers?)")
    rng = np.random.default_rng(seed)
    layers, errors = {}, {}
    for i, parts in sorted(keys.items()):
        u = mx.concatenate(parts, axis=1)  # (H, N, P, 2)
        if u.shape[2] % pairs:
            raise ValueError(f"pairs={pairs} must divide the {u.shape[2]} channel pairs of a head")
        rows = mx.array(np.sort(rng.choice(u.shape[1], min(samples, u.shape[1]), replace=False)))
        books = [
            fit_residual(u[h, rows], geometry, iters, (t0, t1), seed + h) for h in range(u.shape[0])
        ]
        layers[i] = (mx.stack([x[0] for x in books]), mx.stack([x[1] for x in books]))
        errors[str(i)] = [round(float(np.mean(e)), 6) for e in zip(*(x[2] for x in books))]
        mx.eval(layers[i])
    provenance = cal.fitted(
        model,
        samples=int(min(samples, ids.size)),
        iters=iters,
        temperature=[t0, t1],
        seed=seed,
        stage_errors=errors,
    )
    return Codebooks(layers, {i: specs[i].layout for i in layers}, pairs, **provenance)
