"""Caches on a GPU: the kernel path against the reference path (``-m gpu``; skipped where
MLX runs on the CPU). Also runs as a script on a machine without pytest:
``python3 tests/test_gpu_caches.py``.

Each cache is filled chunk by chunk (a prefill), then decodes one token at a time past a
flush of its window into the codes: every step's attention with kernels (the decode plan
made once per coded segment, reused between flushes) matches the same cache attended with
kernels off. A prefill chunk's attention (the stored tokens decoded to the model's dtype,
then fused SDPA) matches attention over the float32 decoded cache.
"""

from __future__ import annotations

import math
import sys

import mlx.core as mx
import pytest

from velox_core import UniformCache
from velox_core.kernels import backend

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(backend() == "cpu", reason="MLX runs on the CPU here")


def _makers():
    out = {
        "uniform4": lambda: UniformCache(bits=4),
        "uniform4-sinks-window": lambda: UniformCache(bits=4, sinks=4, window=16),
        "uniform2-g32": lambda: UniformCache(bits=2, group=32),
    }
    try:
        from velox_kivi import KIVICache

        out["kivi2"] = lambda: KIVICache(bits=2)
    except ImportError:
        pass
    try:
        from velox_turboquant import TurboQuantCache

        out["turboquant4"] = lambda: TurboQuantCache(bits=4)
        out["turboquant3.5"] = lambda: TurboQuantCache(bits=3.5)
    except ImportError:
        pass
    return out


MAKERS = _makers()


def _kernels(on: bool):
    from velox_core.kernels.config import configure

    configure(enabled=on)


def _data(t: int, dtype):
    k1, k2 = mx.random.split(mx.random.key(7), 2)
    k = mx.random.normal((1, 8, t, 128), key=k1).astype(dtype)
    v = mx.random.normal((1, 8, t, 128), key=k2).astype(dtype)
    return k, v


def _rel(got, ref) -> float:
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return (mx.max(mx.abs(got - ref)) / mx.max(mx.abs(ref))).item()


def _worst_decode_step(cache, k: mx.array, v: mx.array, t: int) -> float:
    """Fill ``cache`` with the first ``t`` tokens in chunks (a prefill), then decode the rest
    one token at a time; returns the worst :func:`_rel` of a step's attention with kernels
    against kernels off."""
    dt = k.dtype
    _kernels(True)
    for i in range(0, t, 2048):
        cache.update_and_fetch(k[:, :, i : min(t, i + 2048)], v[:, :, i : min(t, i + 2048)])
    worst = 0.0
    try:
        for s in range(k.shape[2] - t):
            _kernels(True)
            cache.update_and_fetch(k[:, :, t + s : t + s + 1], v[:, :, t + s : t + s + 1])
            q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(1000 + s)).astype(dt)
            got = cache.attend(q, 1 / math.sqrt(128))
            _kernels(False)
            ref = cache.attend(q, 1 / math.sqrt(128))
            worst = max(worst, _rel(got, ref))
    finally:
        _kernels(True)
    return worst


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_decode_steps_past_a_flush_match_the_reference(name, dtype):
    dt = getattr(mx, dtype)
    # 70 steps: past a flush of 64 tokens (or a fractional width's block)
    worst = _worst_decode_step(MAKERS[name](), *_data(5070, dt), 5000)
    tol = 2e-3 if dt == mx.float16 else 1e-2
    assert math.isfinite(worst) and worst <= tol, (name, dtype, worst)


@needs_gpu
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_prefill_chunk_attention_matches_the_decoded_cache(name):
    dt = mx.bfloat16
    t, lq = 3000, 512
    k, v = _data(t, dt)
    cache = MAKERS[name]()
    cache.update_and_fetch(k[:, :, : t - lq], v[:, :, : t - lq])
    cache.update_and_fetch(k[:, :, t - lq :], v[:, :, t - lq :])
    q = mx.random.normal((1, 32, lq, 128), key=mx.random.key(3)).astype(dt)
    got = cache.attend(q, 1 / math.sqrt(128), mask="causal")
    kk, vv = (x.astype(mx.float32) for x in cache.keys_and_values())
    ref = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), kk, vv, scale=1 / math.sqrt(128), mask="causal"
    )
    assert _rel(got, ref) <= 2e-2, (name, _rel(got, ref))


def _rabitq_makers():
    try:
        from velox_rabitq import RaBitQCache
    except ImportError:
        return {}
    return {
        "rabitq4": lambda: RaBitQCache(bits=4),
        "rabitq2": lambda: RaBitQCache(bits=2),
        "rabitq1-centroid32-sinks": lambda: RaBitQCache(
            key_bits=1, value_bits=4, centroid=32, sinks=4
        ),
        "rabitq4-centroid0-window": lambda: RaBitQCache(bits=4, centroid=0, window=16),
    }


RABITQ = _rabitq_makers()


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(RABITQ))
def test_rabitq_decode_takes_the_kernel_path_and_matches_the_reference(name, dtype):
    """RaBitQ keys on velox-core's decode kernels (``velox_rabitq.kernels``: affine codes of
    one group a token, one split per centroid block with the block's ``q . c`` added to its
    max): every decode plan past a flush is the kernel path, and each step matches the
    reference (the codec's score estimator, kernels off). The keys share an offset, so the
    centroid term counts. The kernel's scale and zero are rounded to the record's dtype, which
    the reference does not do: hence the looser bound than the other caches'."""

    dt = getattr(mx, dtype)
    k, v = _data(5140, dt)  # 140 steps: past a flush of a 128-token centroid block
    k = k + (2.0 * mx.random.normal((1, 8, 1, 128), key=mx.random.key(8))).astype(dt)
    from velox_core.cache import planned

    plans, real = [], planned.plan_segment

    def spy(*args, **kwargs):
        run = real(*args, **kwargs)
        plans.append(run is not None)
        return run

    planned.plan_segment = spy
    try:
        worst = _worst_decode_step(RABITQ[name](), k, v, 5000)
    finally:
        planned.plan_segment = real
    assert len(plans) >= 2 and all(plans), (name, dtype, plans)  # a plan per flush, all taken
    tol = 5e-3 if dt == mx.float16 else 3e-2
    assert math.isfinite(worst) and worst <= tol, (name, dtype, worst)


def _commvq_codebooks(path, heads: int) -> str:
    """Random codebooks for layer 0 (4 pairs a code, 16 entries, 2 stages: 2 bits a
    coordinate), saved as an artifact."""
    from velox_commvq import Codebooks, save_codebooks

    shape = (heads, 2, 64, 16, 2)
    a = 0.1 * mx.random.normal(shape, key=mx.random.key(0))
    b = 0.1 * mx.random.normal(shape, key=mx.random.key(1))
    books = Codebooks({0: (a, b)}, {0: [128, 0]}, 4, fingerprint="synthetic", model={"test": True})
    return str(save_codebooks(books, path / f"commvq-h{heads}.safetensors"))


COMMVQ_CASES = [(2, 403), (8, 1024), (8, 2048), (8, 5070)]


@needs_gpu
@pytest.mark.parametrize("heads,t", COMMVQ_CASES)
def test_commvq_kernel_and_reference_match_the_cpu(tmp_path, heads, t):
    """CommVQ keys (``velox_commvq``): the table-code decode kernel and the reference path
    (the code-domain scores as MLX ops, run on the GPU) each equal the reference path run on
    the CPU. Heads x tokens up to 40,560: where a gather over a table broadcast along the
    tokens went wrong on MLX's CUDA backend."""
    pytest.importorskip("velox_commvq")
    from velox_commvq import CommVQKeys
    from velox_commvq.kernels import kernel_tables
    from velox_core import Uniform
    from velox_core.cache.attention import Segment, kernel_sides, partial
    from velox_core.kernels import decode as dk

    c = CommVQKeys(bits=2, codebooks=_commvq_codebooks(tmp_path, heads), layer=0, rope_base=1e4)
    k = mx.random.normal((1, heads, t, 128), key=mx.random.key(1))
    keys = c.encode(k, mx.arange(t).astype(mx.int32))
    vc = Uniform(4, 64)
    values = vc.encode(mx.random.normal((1, heads, t, 128), key=mx.random.key(2)))
    q = mx.random.normal((1, heads, 4, 128), key=mx.random.key(3)) * 0.2
    gpu = partial(q, Segment(c, keys, vc, values))
    with mx.stream(mx.cpu):
        cpu = partial(q, Segment(c, keys, vc, values))
        mx.eval(cpu)
    sides = kernel_sides(c, keys, vc, values, q.shape)
    assert sides is not None  # the kernel takes CommVQ records by default
    got = dk.decode_attention(q, sides[0].record, sides[1].record, q_sketch=kernel_tables(c, q))
    # the GPU reference's float32 matmuls may round as TF32 does: a looser bound than the kernel's
    for name, part, tol in (("kernel", got, 1e-4), ("gpu reference", gpu, 5e-3)):
        for g, r in zip(part, cpu):
            assert _rel(g, r) <= tol, (name, heads, t, _rel(g, r))


def _all_makers(tmp) -> dict:
    out = {**MAKERS, **RABITQ}
    try:
        from velox_commvq import CommVQCache
    except ImportError:
        return out
    books = _commvq_codebooks(tmp, 8)
    out["commvq2"] = lambda: CommVQCache(
        key_bits=2, value_bits=4, codebooks=books, layer=0, rope_base=1e4
    )
    return out


ALL_CACHES = sorted({*MAKERS, *RABITQ, "commvq2"})


@needs_gpu
@pytest.mark.parametrize("name", ALL_CACHES)
def test_decoded_cache_matches_the_cpu(tmp_path, name):
    """A cache filled on the GPU (its encode kernels, its decode as MLX ops on the GPU) holds
    what the same cache filled on the CPU holds (the reference encode and decode), at 8 KV
    heads x 8,192 tokens: no op of a codec's encode or decode goes wrong at that size on the
    GPU. A few codes may round the other way at ties (at most one level of a few entries)."""
    makers = _all_makers(tmp_path)
    if name not in makers:
        pytest.skip(f"{name}: its package is not installed")
    k, v = _data(8192, mx.float16)
    decoded = []
    for device in (mx.gpu, mx.cpu):
        old = mx.default_device()
        mx.set_default_device(device)
        try:
            cache = makers[name]()
            for i in range(0, 8192, 2048):
                cache.update_and_fetch(k[:, :, i : i + 2048], v[:, :, i : i + 2048])
            kk, vv = (x.astype(mx.float32) for x in cache.keys_and_values())
            mx.eval(kk, vv)
            decoded.append((kk, vv))
        finally:
            mx.set_default_device(old)
    for side, g, c in zip(("keys", "values"), *decoded):
        g, c = mx.array(g), mx.array(c)
        diff = mx.abs(g - c)
        mean = (mx.mean(diff) / mx.mean(mx.abs(c))).item()
        off = mx.mean((diff > 0.05 * mx.max(mx.abs(c))).astype(mx.float32)).item()
        assert mean <= 5e-3 and off <= 1e-3, (name, side, mean, off)


def _commvq_case(heads: int, t: int) -> None:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        test_commvq_kernel_and_reference_match_the_cpu(Path(d), heads, t)


def _decoded_case(name: str) -> None:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        test_decoded_cache_matches_the_cpu(Path(d), name)


def main() -> int:
    """Run every case without pytest; print one line per case, return 1 on any failure."""
    failed = 0
    cases = [
        (test_decode_steps_past_a_flush_match_the_reference, (n, d))
        for n in sorted(MAKERS)
        for d in ("float16", "bfloat16")
    ]
    cases += [(test_prefill_chunk_attention_matches_the_decoded_cache, (n,)) for n in MAKERS]
    cases += [
        (test_rabitq_decode_takes_the_kernel_path_and_matches_the_reference, (n, d))
        for n in sorted(RABITQ)
        for d in ("float16", "bfloat16")
    ]
    cases += [(_commvq_case, hc) for hc in COMMVQ_CASES]
    cases += [(_decoded_case, (n,)) for n in ALL_CACHES]
    for fn, args in cases:
        try:
            fn(*args)
            print("PASS", fn.__name__, *args, flush=True)
        except Exception as exc:  # report every case
            failed += 1
            print("FAIL", fn.__name__, *args, f"{type(exc).__name__}: {exc}", flush=True)
    print(f"{len(cases) - failed}/{len(cases)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    if backend() == "cpu":
        print("MLX runs on the CPU here: nothing to check")
        sys.exit(0)
    sys.exit(main())
