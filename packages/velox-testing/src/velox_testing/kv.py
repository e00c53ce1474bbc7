"""Keys and values shaped like a real model's, fed to caches, and the comparisons of
attention partials, logits and greedy tokens that :class:`velox_testing.CacheConformance`
and the method packages' tests share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from velox_core import load_cache, make, make_cache, routed, save_cache

__all__ = [
    "assert_attends_without_decoding",
    "assert_codes_head_dims",
    "assert_exact_ends",
    "assert_partials_close",
    "assert_partials_equivalent",
    "assert_reloads_alike",
    "assert_rows_decode_alone",
    "assert_scores_and_mix_decoded",
    "coded_segment",
    "coded_segments",
    "decode_logits",
    "feed",
    "greedy_agreement",
    "kv_caches_after",
    "kv_data",
    "kv_like",
    "random_prompt",
    "rel_error",
    "softmax_reference",
]


def _key_law(rng: np.random.Generator, d: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`kv_data`'s key channels, drawn from ``rng``: a scale per channel (a few outlier
    channels 6x larger) and a mean (a shared direction), each ``(d,)``."""
    scale = np.exp(rng.normal(0, 0.5, size=d))
    scale[rng.choice(d, size=max(1, d // 32), replace=False)] *= 6.0
    return scale, rng.normal(0, 1.0, size=d)


def kv_data(
    b: int = 1, h: int = 2, t: int = 256, d: int = 128, seed: int = 0, dtype: mx.Dtype = mx.float16
) -> tuple[mx.array, mx.array]:
    """Keys and values shaped like a real model's: channel-wise scales, a few outlier
    channels in the keys, and a shared direction (so attention is not uniform)."""
    rng = np.random.default_rng(seed)
    scale, mean = _key_law(rng, d)
    k = rng.normal(0, 1, size=(b, h, t, d)) * scale + mean
    v = rng.normal(0, 1, size=(b, h, t, d))
    return mx.array(k.astype(np.float32)).astype(dtype), mx.array(v.astype(np.float32)).astype(
        dtype
    )


def kv_like(t: int, seed: int = 0, noise_seed: int = 1000, h: int = 2, d: int = 128) -> mx.array:
    """Keys of the law of ``kv_data(seed=seed)`` (its channel scales, outlier channels and
    mean) with independent noise: new tokens of the same "model", to fit an artifact on
    without fitting it on the test tokens themselves.

    Shapes: returns float32 ``(1, h, t, d)``.
    """
    scale, mean = _key_law(np.random.default_rng(seed), d)
    noise = np.random.default_rng(noise_seed).normal(0, 1, size=(1, h, t, d))
    return mx.array((noise * scale + mean).astype(np.float32))


def softmax_reference(x: np.ndarray) -> np.ndarray:
    """The softmax of ``x`` over its last axis in NumPy (shifted by the max), for the tests'
    transcriptions of the papers' rules."""
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rel_error(a: mx.array, b: mx.array) -> float:
    """``||a - b|| / ||b||`` in float32."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.sqrt(mx.sum((a - b) ** 2) / mx.sum(b * b)).item())


def assert_partials_close(got, ref, rel: float) -> None:
    """A fused kernel's partial ``(o, m, l)`` against the reference's: same shapes, each
    array within ``rel`` of the reference's largest magnitude (at least 1)."""
    assert got is not None, "the kernel path declined (returned None)"
    for g, r in zip(got, ref):
        g, r = np.asarray(g), np.asarray(r)
        assert g.shape == r.shape, (g.shape, r.shape)
        assert np.abs(g - r).max() <= rel * max(1.0, np.abs(r).max())


def assert_partials_equivalent(got, ref, rel: float, lazy_bits: float = 8.0) -> None:
    """A kernel's partial ``(o, m, l)`` whose running max is lazy (up to ``lazy_bits`` log2
    units below the true max, as the tensor-core kernels keep it) against the reference's:
    ``m`` within that band, and ``o``, ``l`` moved to the reference's ``m`` within ``rel`` of
    the reference's largest magnitude (at least 1). Any ``m`` gives the same merged softmax."""
    assert got is not None, "the kernel path declined (returned None)"
    (go, gm, gl), (ro, rm, rl) = (tuple(np.asarray(a) for a in x) for x in (got, ref))
    assert go.shape == ro.shape and gm.shape == rm.shape and gl.shape == rl.shape
    band = lazy_bits * math.log(2) + 1e-4 * max(1.0, np.abs(rm).max())
    assert np.all(gm <= rm + 1e-4 * max(1.0, np.abs(rm).max())) and np.all(gm >= rm - band)
    f = np.exp(gm - rm)
    for g, r in ((go * f, ro), (gl * f, rl)):
        assert np.abs(g - r).max() <= rel * max(1.0, np.abs(r).max())


def assert_codes_head_dims(spec: str, rel: float, dims: Sequence[int] = (80, 96, 112)) -> None:
    """A cache made from ``spec`` (``velox_core.make``) stores ``kv_data(t=300, d=d)`` for
    each head dim ``d`` of ``dims`` and gives its keys back within ``rel`` (:func:`rel_error`)."""
    for d in dims:
        k, v = kv_data(t=300, d=d)
        c = make(spec)
        c.update_and_fetch(k, v)
        assert rel_error(c.keys_and_values()[0], k) < rel, d


def assert_scores_and_mix_decoded(
    key_codec, keys, value_codec, values, seed: int, weights_seed: int = 1, tol: float = 1e-5
):
    """A codec pair's scores and mix read from the codes equal those of the decoded tokens:
    6 random queries a head (``mx.random.key(seed)``) scored against ``keys``, and sharp
    random softmax weights (``mx.random.key(weights_seed)``) mixing ``values``, each within
    ``tol`` (:func:`rel_error`). Returns the decoded ``(keys, values)``, for the caller's
    further checks.

    Shapes:
        keys, values: ``Packed`` records of ``(B, H, T, D)`` vectors.
    """
    kk, vv = key_codec.decode(keys), value_codec.decode(values)
    b, h, t, d = kk.shape
    q = mx.random.normal((b, h, 6, d), key=mx.random.key(seed))
    w = mx.softmax(mx.random.normal((b, h, 6, t), key=mx.random.key(weights_seed)) * 3, axis=-1)
    assert rel_error(key_codec.scores(q, keys), q @ mx.swapaxes(kk, -1, -2)) < tol
    assert rel_error(value_codec.mix(w, values), w @ vv) < tol
    return kk, vv


def decode_logits(model, caches, tokens, prompt: mx.array | None = None) -> mx.array:
    """The model's last-position logits: after ``prompt`` ``(1, T)`` if given, then after each
    decode step of ``tokens`` (ints or scalar arrays), float32 ``(steps, vocab)``."""
    out = [] if prompt is None else [model(prompt, cache=caches)[:, -1]]
    for t in tokens:
        out.append(model(mx.array(t).reshape(1, 1), cache=caches)[:, -1])
    return mx.concatenate(out, axis=0).astype(mx.float32)


def greedy_agreement(model, prompt: mx.array, spec, steps: int = 32, tie: float = 0.1):
    """Greedy tokens of ``model`` with fp16 caches, and with ``spec`` caches on the same path.

    The velox run is teacher-forced along the fp16 greedy path, so each step's choice is
    compared on the same history. A random-weight model has near-ties in its logits, where
    any rounding (even 8-bit codes) may pick the other token: ``ties[i]`` marks steps whose
    fp16 top-2 logit margin is below ``tie``.

    Returns:
        ``(ref_tokens, velox_tokens, ties)``, lists of length ``steps``.
    """
    from mlx_lm.models.cache import make_prompt_cache

    def run(caches, force=None):
        toks, margins = [], []
        logits = model(prompt, cache=caches)[:, -1]
        for i in range(steps):
            top = mx.sort(logits[0].astype(mx.float32))
            margins.append(float((top[-1] - top[-2]).item()))
            toks.append(int(mx.argmax(logits, -1).item()))
            y = mx.array([toks[-1] if force is None else force[i]])
            logits = model(y[:, None], cache=caches)[:, -1]
        return toks, margins

    ref, margins = run(make_prompt_cache(model))
    with routed(model):
        got, _ = run(make_cache(model, spec), force=ref)
    return ref, got, [m < tie for m in margins]


def feed(caches, k: mx.array, v: mx.array, chunks: int | Sequence[int] = (100, 1, 60, 1, 1)):
    """Store ``k, v`` in a cache, or in each of a list of caches, one chunk per update: chunks
    of ``chunks`` tokens, or of the sizes ``chunks`` lists taken in turn (again from the first
    when they run out) until every token is stored. By default uneven chunks: a prefill,
    decode steps, another chunk... Returns ``caches``.

    Shapes:
        k, v ``(B, H, T, D)``.
    """
    sizes = (chunks,) if isinstance(chunks, int) else tuple(chunks)
    targets = caches if isinstance(caches, (list, tuple)) else [caches]
    t, start, i = k.shape[2], 0, 0
    while start < t:
        n = min(sizes[i % len(sizes)], t - start)
        for c in targets:
            c.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
        start, i = start + n, i + 1
    return caches


def coded_segments(cache) -> list:
    """The segments of ``cache`` that its first tier's codecs hold (not its fp16 sinks and
    window), in order."""
    return [s for s in cache.segments() if s.key_codec is cache.tiers[0].key_codec]


def assert_exact_ends(cache, body_error: float, t: int = 700, chunk: int = 7) -> tuple:
    """``cache``, given ``t`` tokens of :func:`kv_data` in updates of ``chunk``, holds three
    segments: its fp16 sinks and window, whose tokens are those given bit for bit, around a
    coded body whose keys are within ``body_error`` of those given (relative error; not
    exact). Returns the segments ``(sinks, body, window)``."""
    k, v = kv_data(t=t)
    feed(cache, k, v, chunk)
    sinks, body, window = cache.segments()
    kk, vv = cache.keys_and_values()
    start, end = sinks.tokens, sinks.tokens + body.tokens
    for got, given in ((kk, k), (vv, v)):
        assert mx.array_equal(got[:, :, :start], given[:, :, :start]).item()
        assert mx.array_equal(got[:, :, end:], given[:, :, end:]).item()
    assert 0 < rel_error(kk[:, :, start:end], k[:, :, start:end]) < body_error
    return sinks, body, window


def assert_reloads_alike(cache, path, t: int = 600):
    """``cache``, given ``t`` tokens of :func:`kv_data` (:func:`feed`'s chunks), saved to the
    file ``path`` and loaded back: the loaded cache has the same class and config, its coded
    segments (:func:`coded_segments`) hold the same arrays, names and values, and a query
    attends to both alike (``atol`` 1e-4). Returns the loaded cache."""
    feed(cache, *kv_data(t=t))
    save_cache(path, [cache])
    (loaded,) = load_cache(path)
    assert type(loaded) is type(cache) and loaded.config() == cache.config()
    pairs = list(zip(coded_segments(cache), coded_segments(loaded)))
    assert pairs and len(pairs) == len(coded_segments(cache)) == len(coded_segments(loaded))
    for a, b in pairs:
        for side in ("keys", "values"):
            x, y = getattr(a, side).data, getattr(b, side).data
            assert set(x) == set(y), side
            for name in x:
                assert mx.array_equal(x[name], y[name]).item(), (side, name)
    d = cache.keys_and_values()[0].shape[-1]
    q = mx.random.normal((1, 4, 1, d), key=mx.random.key(0)).astype(mx.float16)
    assert mx.allclose(cache.attend(q, scale=0.1), loaded.attend(q, scale=0.1), atol=1e-4).item()
    return loaded


def coded_segment(cache, t: int = 128):
    """The first coded segment of ``cache`` (:func:`coded_segments`) once it has stored ``t``
    tokens of :func:`kv_data` in one update (a cache with no fp16 sinks or window codes them
    all)."""
    k, v = kv_data(t=t)
    cache.update_and_fetch(k, v)
    return coded_segments(cache)[0]


def assert_rows_decode_alone(model, spec, prompt: mx.array, tokens=(4, 9)) -> None:
    """A batch prefilled together decodes each row as that row alone: ``model`` (routed) with
    ``spec`` caches takes ``prompt`` ``(2, T)`` in one call and one decode step of ``tokens``
    (one per row); each row's logits are within 1e-3 of its own single-row run's."""
    with routed(model):
        caches = make_cache(model, spec)
        model(prompt, cache=caches)
        both = model(mx.array([[t] for t in tokens]), cache=caches)[:, -1]
        for i, tok in enumerate(tokens):
            one = make_cache(model, spec)
            model(prompt[i : i + 1], cache=one)
            row = model(mx.array([[tok]]), cache=one)[:, -1]
            assert rel_error(both[i : i + 1], row) < 1e-3, i


def assert_attends_without_decoding(cache, monkeypatch) -> None:
    """``cache`` (a standalone cache of 2 KV heads of 128 channels) holds ``kv_data(t=300)``
    and attends one query of 4 heads; with its first tier's codecs' ``decode`` and
    ``decode_as`` made to fail the test (left so for the rest of it), the same query attends
    to the same output: attention reads the codes, no stored token is decoded."""
    import pytest

    k, v = kv_data(t=300)
    cache.update_and_fetch(k, v)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(3)).astype(mx.float16)
    want = cache.attend(q, scale=0.09)
    for codec in (cache.tiers[0].key_codec, cache.tiers[0].value_codec):
        monkeypatch.setattr(codec, "decode", lambda *a: pytest.fail("decoded"))
        monkeypatch.setattr(codec, "decode_as", lambda *a: pytest.fail("decoded"))
    assert mx.array_equal(cache.attend(q, scale=0.09), want)


def random_prompt(tokens: int = 200, seed: int = 5, batch: int = 1) -> mx.array:
    """``(batch, tokens)`` random token ids below 512 (the tiny models' vocabulary)."""
    return mx.array(np.random.default_rng(seed).integers(0, 512, (batch, tokens)))


def kv_caches_after(model, prompt: mx.array, dtype=mx.float16) -> list:
    """mlx-lm ``KVCache`` layers of ``model`` after ``prompt``, their keys and values stored
    in ``dtype``."""
    from mlx_lm.models.cache import KVCache

    caches = [KVCache() for _ in model.layers]
    model(prompt, cache=caches)
    for c in caches:
        k, v = c.keys_and_values()
        c.state = (k.astype(dtype), v.astype(dtype), c.offset)
    return caches
