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


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_decode_steps_past_a_flush_match_the_reference(name, dtype):
    dt = getattr(mx, dtype)
    t, steps = 5000, 70  # 70 steps: a flush of 64 tokens (or a fractional width's block)
    k, v = _data(t + steps, dt)
    cache = MAKERS[name]()
    _kernels(True)
    for i in range(0, t, 2048):
        cache.update_and_fetch(k[:, :, i : min(t, i + 2048)], v[:, :, i : min(t, i + 2048)])
    worst = 0.0
    try:
        for s in range(steps):
            _kernels(True)
            cache.update_and_fetch(k[:, :, t + s : t + s + 1], v[:, :, t + s : t + s + 1])
            q = mx.random.normal((1, 32, 1, 128), key=mx.random.key(1000 + s)).astype(dt)
            got = cache.attend(q, 1 / math.sqrt(128))
            _kernels(False)
            ref = cache.attend(q, 1 / math.sqrt(128))
            worst = max(worst, _rel(got, ref))
    finally:
        _kernels(True)
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


def main() -> int:
    """Run every case without pytest; print one line per case, return 1 on any failure."""
    failed = 0
    cases = [
        (test_decode_steps_past_a_flush_match_the_reference, (n, d))
        for n in sorted(MAKERS)
        for d in ("float16", "bfloat16")
    ]
    cases += [(test_prefill_chunk_attention_matches_the_decoded_cache, (n,)) for n in MAKERS]
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
