"""OSCAR's decode attention on the CPU: what the rotations cost beside the affine codes.

OSCAR (velox-oscar) stores keys and values as velox_core.Uniform's per-token 2-bit codes in a
rotated basis; a decode step rotates the query once (``q R_K``), scores the codes with
``mx.quantized_matmul``, mixes the value codes the same way and rotates the ``(M, D)`` output
back (``o R_V^T``). This script times one decode step's attention (``VeloxCache.attend`` of
one query token, all stored tokens coded: no sinks, no window) for

* ``oscar``: OSCAR's codes and rotations (the reference model's artifact, layer 0);
* ``oscar-hadamard``: the same codes in the Sylvester Hadamard basis (``mx.hadamard_transform``
  on the query and the output instead of two ``(D, D)`` products);
* ``uniform2``: the same 2-bit per-token codes without a rotation (what the rotations add);
* ``kivi2``: KIVI's 2-bit keys per channel (groups of 128 tokens) and values per token;
* ``fp16``: ``mx.fast.scaled_dot_product_attention`` over float16 keys and values,

and one 256-token chunk's encode (``update_and_fetch`` into a cache holding the context: the
rotation, the clip's top-k and the quantization). Each time is the median of ``--repeats``
runs after a warm-up; the machine's other load moves them, so compare rows of one run.

    python benchmarks/oscar_decode.py --contexts 4096 16384 --json docs/data/oscar-cpu-decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from velox_core import VeloxCache, make
from velox_testing import kv_data

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "shared" / "artifacts" / "oscar-reference-model.safetensors"
H_Q, H_KV, D = 16, 4, 128
CHUNK = 256

# (spec, its parameters beside it): every token past the window coded at once
SPECS = {
    "oscar": ("oscar:bits=2,sinks=0,window=0,layer=0", {"artifact": str(ARTIFACT), "flush": 1}),
    "oscar-hadamard": (
        "oscar:bits=2,sinks=0,window=0,rotation=hadamard,key_clip=0.96,value_clip=0.92",
        {"flush": 1},
    ),
    "uniform2": ("uniform:bits=2,group=128", {"flush": 1}),
    "kivi2": ("kivi:bits=2,group=128,window=0", {"flush": 128}),
}


def _median_ms(fn, repeats: int) -> float:
    mx.eval(fn())  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _filled(spec: str, params: dict, k: mx.array, v: mx.array) -> VeloxCache:
    c = make(spec, **params)
    for s in range(0, k.shape[2], 2048):
        c.update_and_fetch(k[:, :, s : s + 2048], v[:, :, s : s + 2048])
    mx.eval(c.state)
    return c


def run(contexts: list[int], repeats: int) -> list[dict]:
    rows = []
    q = mx.random.normal((1, H_Q, 1, D), key=mx.random.key(0)).astype(mx.float16)
    scale = D**-0.5
    for t in contexts:
        k, v = kv_data(h=H_KV, t=t + CHUNK, d=D, dtype=mx.float16)
        mx.eval(k, v)
        kc, vc = k[:, :, :t], v[:, :, :t]
        new_k, new_v = k[:, :, t:], v[:, :, t:]

        def fp16(kc=kc, vc=vc):
            return mx.fast.scaled_dot_product_attention(q, kc, vc, scale=scale)

        rows.append({"cache": "fp16", "context": t, "attend_ms": _median_ms(fp16, repeats)})
        for name, (spec, params) in SPECS.items():
            c = _filled(spec, params, kc, vc)
            ms = _median_ms(lambda c=c: c.attend(q, scale=scale), repeats)
            t0 = c.tiers[0]

            def encode(t0=t0, nk=new_k, nv=new_v):  # the codecs set up: only the coding timed
                return [
                    t0.key_codec.encode(nk).data["codes"],
                    t0.value_codec.encode(nv).data["codes"],
                ]

            enc = _median_ms(encode, repeats)
            rows.append(
                {
                    "cache": name,
                    "spec": spec,
                    "context": t,
                    "attend_ms": ms,
                    "encode_256_ms": enc,
                    "nbytes": c.nbytes,
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    mx.set_default_device(mx.cpu)
    rows = run(args.contexts, args.repeats)
    print(f"{'cache':16} {'context':>8} {'attend ms':>10} {'encode 256 ms':>14} {'MiB':>8}")
    for r in rows:
        enc = f"{r['encode_256_ms']:.2f}" if "encode_256_ms" in r else "-"
        mib = f"{r['nbytes'] / 2**20:.2f}" if "nbytes" in r else "-"
        print(f"{r['cache']:16} {r['context']:>8} {r['attend_ms']:>10.3f} {enc:>14} {mib:>8}")
    if args.json:
        out = {
            "machine": platform.processor() or platform.machine(),
            "shape": {"query_heads": H_Q, "kv_heads": H_KV, "head_dim": D},
            "repeats": args.repeats,
            "rows": rows,
        }
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
