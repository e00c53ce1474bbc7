"""CPU benchmarks (pytest-benchmark): one decode step's attention and one token's encode.

    nox -s bench            # or: pytest benchmarks --benchmark-only

Every case times against fp16 ``mx.fast.scaled_dot_product_attention`` in the same run (the
``fp16`` row of each group); results go to out/bench.json. Absolute speed belongs to the GPU
script (benchmarks/gpu_attention.py); these rows track the reference paths on the CPU, where
MLX computes float16 slowly (the fp16 and mlx-q4 rows take float16 queries, velox's attend
computes in float32 from the codes), so the ratios here say nothing about a GPU.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

from velox_core import UniformCache, VeloxCache
from velox_testing import kv_data

CONTEXTS = (4096, 16384)
H_Q, H_KV, D = 16, 4, 128


def _filled(cache, k, v):
    for s in range(0, k.shape[2], 2048):
        cache.update_and_fetch(k[:, :, s : s + 2048], v[:, :, s : s + 2048])
    mx.eval(cache.state)
    return cache


@pytest.fixture(scope="module", params=CONTEXTS, ids=lambda t: f"T{t}")
def kv(request):
    k, v = kv_data(h=H_KV, t=request.param, d=D, dtype=mx.float16)
    mx.eval(k, v)
    return k, v


def _bench(benchmark, fn):
    fn()  # warm up
    benchmark(lambda: mx.eval(fn()))


@pytest.mark.benchmark(group="decode-attention")
@pytest.mark.parametrize(
    "name", ["fp16", "mlx-q4", "velox-uniform4", "velox-uniform2", "velox-lossless"]
)
def test_decode_attention(benchmark, kv, name):
    k, v = kv
    q = mx.random.normal((1, H_Q, 1, D)).astype(mx.float16)
    scale = D**-0.5
    if name == "fp16":
        fn = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
    elif name == "mlx-q4":
        c = _filled(QuantizedKVCache(group_size=64, bits=4), k, v)
        kq, vq = c.keys_and_values()
        fn = lambda: quantized_scaled_dot_product_attention(  # noqa: E731
            q, kq, vq, scale=scale, mask=None, group_size=64, bits=4
        )
    else:
        cache = {
            "velox-uniform4": lambda: UniformCache(bits=4),
            "velox-uniform2": lambda: UniformCache(bits=2),
            "velox-lossless": VeloxCache,
        }[name]()
        c = _filled(cache, k, v)
        fn = lambda: c.attend(q, scale)  # noqa: E731
    _bench(benchmark, fn)


@pytest.mark.benchmark(group="encode-one-token")
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_encode_one_token(benchmark, bits):
    from velox_core import Uniform

    codec = Uniform(bits)
    x = mx.random.normal((1, H_KV, 1, D)).astype(mx.float16)
    _bench(benchmark, lambda: codec.encode(x).arrays())


@pytest.mark.benchmark(group="decode-step-host")
@pytest.mark.parametrize(
    "name", ["fp16", "velox-uniform4", "velox-turboquant4", "velox-turboquant3.5"]
)
def test_decode_step_host_time(benchmark, kv, name):
    """Host time of one layer's decode step as a GPU runs it: the cache update of one token
    and the attention call built (not evaluated) on the CUDA code path, velox's kernel calls
    stubbed (``host_profile.stubbed_kernels``: zeroed outputs of the shapes they ask for), the
    cache routed as under ``velox_core.routed``. The fp16 row stubs SDPA the same way (one
    zeroed output: on a GPU it is one fused primitive, on the CPU a graph of many ops), so
    both sides count their caches' bookkeeping and the building of their calls. A small
    model's decode step is this time (see docs/performance.md, What is left); each round's
    graph is evaluated before the next."""
    from host_profile import stubbed_kernels
    from mlx_lm.models.cache import KVCache

    import velox_core

    k, v = kv
    q = mx.random.normal((1, H_Q, 1, D)).astype(mx.float16)
    k1 = mx.random.normal((1, H_KV, 1, D)).astype(mx.float16)
    mx.eval(q, k1)
    scale = D**-0.5
    if name == "fp16":
        cache = KVCache()
        cache.update_and_fetch(k, v)

        def step():
            kk, vv = cache.update_and_fetch(k1, k1)
            return [kk, vv, mx.zeros(q.shape, q.dtype)]  # SDPA stubbed: one output

    else:
        if name.startswith("velox-turboquant"):
            from velox_turboquant import TurboQuantCache

            bits = name.removeprefix("velox-turboquant")
            bits = float(bits) if "." in bits else int(bits)
            cache = _filled(TurboQuantCache(bits=bits), k, v)
        else:
            cache = _filled(UniformCache(bits=4), k, v)
        cache.fetch_decoded = False  # as make_cache sets it for mlx-lm's llama-like models

        def step():
            cache.update_and_fetch(k1, k1)
            return cache.attend(q, scale)

    out = []

    def settle():  # untimed: evaluate the last round's graph and the cache
        mx.eval(out, [a for a in getattr(cache, "state", []) if isinstance(a, mx.array)])
        out.clear()

    with stubbed_kernels(name != "fp16"), velox_core.routed():
        for _ in range(5):
            out.append(step())
            settle()
        benchmark.pedantic(lambda: out.append(step()), setup=settle, rounds=300, iterations=1)
