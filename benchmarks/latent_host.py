"""The host's share of one latent-attention layer's decode step: how long Python and MLX take
to build (not run) each piece, in microseconds, median and minimum over ``--calls`` calls.

A decode step of DeepSeek-V3's attention on a GPU is bound by the host (the device waits for
the next step's graph: ``benchmarks/e2e.py``'s ``wait_ms_per_step``), so what a cache adds to
the step is what it costs to build. Rows: mlx-lm's ``KVCache.update_and_fetch`` (fp16),
velox's ``LatentCache.update_and_fetch`` (``--bits``), one token's encode by velox's
``Uniform`` (its fused kernel on Metal and CUDA) and by ``mx.quantize``, and the
``LatentCache``'s routed attention call (the codes path, or its refusal where the codes path
is off). Each stores ``--context`` tokens first; one layer, DeepSeek-V3's widths (a
512-channel latent, a 64-channel RoPE key, 128 query heads), bfloat16.

    python benchmarks/latent_host.py [--context 32768] [--calls 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

LATENT, PE, HEADS = 512, 64, 128


def timed(build: Callable[..., object], inputs: Callable[[], tuple], calls: int) -> dict:
    """Microseconds to build ``build(*inputs())`` (each result evaluated after the clock)."""
    times = []
    for _ in range(calls):
        args = inputs()
        t0 = time.perf_counter()
        out = build(*args)
        times.append(time.perf_counter() - t0)
        mx.eval(out)
    return {"median_us": statistics.median(times) * 1e6, "min_us": min(times) * 1e6}


def token() -> tuple[mx.array, mx.array]:
    a = (
        mx.random.normal((1, 1, 1, LATENT)).astype(mx.bfloat16),
        mx.random.normal((1, 1, 1, PE)).astype(mx.bfloat16),
    )
    mx.eval(a)
    return a


def fill(cache, context: int) -> None:
    for start in range(0, context, 4096):
        n = min(4096, context - start)
        cache.update_and_fetch(
            mx.random.normal((1, 1, n, LATENT)).astype(mx.bfloat16),
            mx.random.normal((1, 1, n, PE)).astype(mx.bfloat16),
        )
        mx.eval([a for a in cache.state if isinstance(a, mx.array)])


def main(argv: list[str] | None = None) -> int:
    from mlx_lm.models.cache import KVCache

    from velox_core import LatentCache, Uniform

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.context < 1 or args.calls < 1:
        p.error("--context and --calls must be at least 1")

    rows: dict[str, dict] = {}
    fp16 = KVCache()
    fill(fp16, args.context)
    rows["KVCache.update_and_fetch"] = timed(fp16.update_and_fetch, token, args.calls)
    latent = LatentCache(bits=args.bits)
    fill(latent, args.context)
    rows["LatentCache.update_and_fetch"] = timed(latent.update_and_fetch, token, args.calls)
    codec = Uniform(args.bits, 64)
    rows["Uniform.encode (velox)"] = timed(lambda x, _: codec.encode(x).arrays(), token, args.calls)
    rows["mx.quantize"] = timed(
        lambda x, _: mx.quantize(x, group_size=64, bits=args.bits), token, args.calls
    )
    stored, _ = latent.update_and_fetch(*token())

    def query() -> tuple[mx.array, mx.array]:
        q = mx.random.normal((1, HEADS, 1, LATENT)).astype(mx.bfloat16)
        mask = mx.random.normal((1, HEADS, 1, latent.size())).astype(mx.bfloat16)
        mx.eval(q, mask)
        return q, mask

    def attend(q: mx.array, mask: mx.array) -> mx.array:
        out = latent.attend(q, stored, stored, 0.1, mask)
        return mx.array(0) if out is None else out

    rows["LatentCache.attend"] = timed(attend, query, args.calls)
    rows["LatentCache.attend"]["path"] = latent.decode_path
    device = str(mx.default_device())
    for name, r in rows.items():
        extra = f"  ({r['path']})" if "path" in r else ""
        print(f"{name:32s} {r['median_us']:8.1f} us median {r['min_us']:8.1f} min{extra}")
    if args.json is not None:
        out = {"device": device, "context": args.context, "bits": args.bits, "rows": rows}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
