"""What one kernel call costs besides its device work (GPU): MLX's dispatch of a custom kernel.

At batch 1 and short contexts a decode step's device work is a few microseconds, and what a
call costs is mostly dispatch: building the call's graph in Python (``build``) and MLX's
evaluation of it (``eval``: encoding each primitive, launching, waiting). This script
measures both per call, ``--calls`` independent calls evaluated together (as a model's
layers are), for:

* ``add``: a built-in MLX primitive on a small array (the floor);
* ``custom small`` / ``custom large``: a trivial custom kernel (one thread writes one value)
  whose source is a few lines, and the same kernel with the velox tensor-core decode
  kernel's length of comment appended (MLX hashes the full source on every evaluation);
* ``velox decode``, ``velox decode + merge``, ``velox joint_attention``: the velox 4-bit decode
  kernel alone, with its split merge kernel, and the whole call a cache's ``attend`` runs
  (its splits merged in the decode kernel, and with ``VELOX_DECODE_FUSE=0`` by the separate
  merge kernel) at batch 1, 8 KV heads, 32 query heads, head dim 128, 4,096 tokens (a few
  microseconds of device work);
* ``velox encode k`` / ``velox encode k+v``: the affine encode kernel for one token of one
  side, and for both sides as a cache update runs it;
* ``fp16 sdpa``: ``mx.fast.scaled_dot_product_attention`` at the same shape.

Run on the GPU machine from the repository root::

    source .gpu/wheels/activate && python3 benchmarks/gpu_dispatch.py

Writes ``$OUT/gpu_dispatch.json`` (``./out`` without ``$OUT``); under a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_attention import timeit_split  # the benchmarks' one timing rule


def measure(fn, calls: int, reps: int) -> tuple[float, float]:
    """Microseconds per call: building ``calls`` calls' graphs, and evaluating them (the
    benchmarks' one timing rule, ``gpu_attention.timeit_split``: medians of the whole and of
    the evaluation; building is their difference)."""
    whole, ev = timeit_split(fn, 3 * calls, reps, calls)
    return (whole - ev) * 1e6, ev * 1e6


def cases(tokens: int):
    from velox_core import Uniform
    from velox_core.cache.attention import Segment, joint_attention
    from velox_core.kernels import merge as kmerge
    from velox_core.kernels import mma as kmma
    from velox_core.kernels.build import KernelSpec

    small_src = "if (blockIdx.x * blockDim.x + threadIdx.x == 0) { out[0] = x[0] + 1.0f; }\n"
    body = KernelSpec(
        name="velox_decode_mma_probe",
        source="decode_attention_mma.cu",
        inputs=(),
        outputs=(),
        cuda_headers=("velox_mma.cuh",),
    )
    padding = len(body.body("cuda")) + len(body.header("cuda"))
    common = {"input_names": ["x"], "output_names": ["out"], "ensure_row_contiguous": True}
    small = mx.fast.cuda_kernel(name="vx_probe_small", source=small_src, **common)
    large = mx.fast.cuda_kernel(
        name="vx_probe_large",
        source=small_src + "// " + "x" * padding + "\n",
        **common,
    )
    x = mx.zeros((16,), mx.float32)

    def custom(kernel):
        return lambda: kernel(
            inputs=[x],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
        )[0]

    b, hk, hq, d = 1, 8, 32, 128
    scale = 1 / math.sqrt(d)
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    k = mx.random.normal((b, hk, tokens, d), key=k1).astype(mx.float16)
    v = mx.random.normal((b, hk, tokens, d), key=k2).astype(mx.float16)
    q = mx.random.normal((b, hq, 1, d), key=k3).astype(mx.float16)
    codec = Uniform(4)
    kp, vp = codec.encode(k), codec.encode(v)
    mx.eval(k, v, q, kp.data, vp.data)
    qg = q.reshape(b, hk, hq // hk, d)
    ks, vs = codec.kernel_codes(kp), codec.kernel_codes(vp)
    k_new = mx.random.normal((b, hk, 1, d), key=k1).astype(mx.float16)
    mx.eval(k_new)

    def decode_only():
        return kmma.plan_mma(qg.shape, qg.dtype, ks, vs, None, scale)(qg)[0]

    def decode_merge():
        o_part, ml_part, qk = kmma.plan_mma(qg.shape, qg.dtype, ks, vs, None, scale)(qg)
        rows, dim = o_part.shape[3:]
        merge = kmerge.plan_merge_fp16(b, hk, rows, dim, mx.float16, scale, None)
        return merge(o_part, ml_part, qk, [])[0]

    def attend_joint():
        return joint_attention(qg, [Segment(codec, kp, codec, vp)], mx.float16, scale)

    def attend_joint_unfused():
        os.environ["VELOX_DECODE_FUSE"] = "0"
        try:
            return attend_joint()
        finally:
            del os.environ["VELOX_DECODE_FUSE"]

    return [
        ("add", lambda: x + 1.0),
        ("custom small", custom(small)),
        (f"custom large ({padding} more characters)", custom(large)),
        ("fp16 sdpa", lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)),
        ("velox decode", decode_only),
        ("velox decode + merge", decode_merge),
        ("velox joint_attention (splits merged in the kernel)", attend_joint),
        ("velox joint_attention (separate merge kernel)", attend_joint_unfused),
        ("velox encode k", lambda: codec.encode(k_new).data["codes"]),
        (
            "velox encode k+v",
            lambda: [codec.encode(k_new).data["codes"], codec.encode(k_new).data["zero"]],
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=24, help="calls evaluated together")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    from velox_core.kernels import backend

    if backend() != "cuda":
        print("gpu_dispatch.py measures MLX's CUDA backend; run it on the GPU machine")
        return 2
    rows = []
    for name, fn in cases(args.tokens):
        build, ev = measure(fn, args.calls, args.reps)
        rows.append({"what": name, "build_us": build, "eval_us": ev})
        print(f"  {name:44s} build {build:7.1f} us   eval {ev:7.1f} us per call", flush=True)
    out = Path(os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_dispatch.json"
    device = {"mlx": mx.__version__, "calls": args.calls, "tokens": args.tokens}
    path.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
