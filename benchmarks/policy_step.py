"""One layer's decode step under each retention policy, against StreamingLLM's: host and
device time per step of ``update_and_fetch`` plus routed ``attend``, after a chunked prefill
of random keys and values (no model: the policy's own cost, not a model's).

    python benchmarks/policy_step.py --context 8192 --budget 1024 \\
        --methods streamingllm h2o tova keyformer cam morphkv morphkv:keep_weights=false

A method is a spec (``name`` or ``name:key=value,...``); ``--budget`` is its budget unless
the spec gives one.

Prints one row per method (milliseconds per step, median of ``--repeats`` timings of
``--steps`` steps, and the ratio to the first method's) and, with ``--profile``, the
functions of velox that take the host time of one method's steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import mlx.core as mx
from _common import write_json

from velox_core import routed
from velox_core.registry import make as make_spec
from velox_core.registry import parse_spec


def make(method: str, budget: int):
    """A cache of the spec ``method`` at ``budget`` tokens (unless the spec gives its own),
    for one layer (no model)."""
    _, params = parse_spec(method)
    cache = make_spec(method, **({} if "budget" in params else {"budget": budget}))
    cache.fetch_decoded = False  # routed attention reads the cache itself
    return cache


def step_ms(method: str, args, profile: bool = False) -> float:
    """Milliseconds per decode step of ``method`` (median over the repeats)."""
    cache = make(method, args.budget)
    key = mx.random.key(args.seed)
    shape = (1, args.kv_heads, args.context, args.head_dim)
    k = mx.random.normal(shape, key=key).astype(mx.float16)
    v = mx.random.normal(shape, key=mx.random.split(key)[0]).astype(mx.float16)
    hq = args.kv_heads * args.group
    q = mx.random.normal((1, hq, args.context, args.head_dim), key=mx.random.split(key)[1])
    q = q.astype(mx.float16)
    scale = args.head_dim**-0.5
    with routed():
        for i in range(0, args.context, args.chunk):
            j = min(i + args.chunk, args.context)
            cache.update_and_fetch(k[:, :, i:j], v[:, :, i:j])
            mx.eval(cache.attend(q[:, :, i:j], scale, mask="causal"))
        k1, q1 = k[:, :, -1:], q[:, :, -1:]

        def steps() -> float:
            t = time.perf_counter()
            for _ in range(args.steps):
                cache.update_and_fetch(k1, k1)
                mx.eval(cache.attend(q1, scale))
            return (time.perf_counter() - t) / args.steps * 1e3

        steps()  # warm: the first steps' cuts and allocations
        times = [steps() for _ in range(args.repeats)]
        if profile:
            pr = cProfile.Profile()
            pr.enable()
            steps()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats("velox", 15)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["streamingllm", "h2o", "tova"])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, help="a method whose steps to profile")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    step_ms(args.methods[0], args)  # warm the process (its first allocations), untimed
    for m in args.methods:
        ms = step_ms(m, args, profile=m == args.profile)
        rows.append(
            {"method": m, "step_ms": ms, "x_first": ms / rows[0]["step_ms"] if rows else 1.0}
        )
        print(f"{m:20s} {ms:8.3f} ms/step  {rows[-1]['x_first']:5.2f}x {args.methods[0]}")
        sys.stdout.flush()
    write_json(args.json, {"settings": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
