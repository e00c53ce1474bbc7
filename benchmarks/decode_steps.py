"""The intervals between decoded tokens, step by step: where a decode loop's slow steps are.

A rate over many steps hides what a user's loop does step by step: most steps take one time
and a few take several times longer (a flush of the window into the codes, a buffer's growth,
MLX's CUDA backend building a graph it has not seen, or clearing its graph cache). This
script fills each cache with ``--context`` tokens through an e2e.py model (chunked prefill
under ``velox_core.routed``), decodes ``--steps`` tokens through mlx-lm's own
``generate_step``, and prints per cache the rate, the median, mean and largest interval and
the steps over ``--slow`` times the median; ``--sync`` also runs a synchronous loop (build a
step's graph, then evaluate it) and prints, for the steps that change the cache's stores, the
host time of building and the time of evaluating.

    python3 benchmarks/decode_steps.py --shape llama3-8b --weights 4bit --context 32768 \
        --caches fp16,uniform:bits=4,kivi:bits=2 --steps 256 --sync --json out/steps.json

MLX's CUDA backend keeps ``MLX_CUDA_GRAPH_CACHE_SIZE`` (default 100) executable graphs and
drops them all when it holds more; run the command with that variable set to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from velox_cli.specs import split_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_json
from e2e import SHAPES, build_model, decode_generate_step, make_caches, prefill


def tier_tokens(caches: list) -> tuple:
    """Tokens of each layer's coded tiers and window buffer capacity (what a flush or a growth
    changes); empty for caches without them."""
    out = []
    for c in caches:
        stored = getattr(c, "stored", None)
        if stored is None:
            continue
        out.append((tuple(t[0].tokens for t in stored.coded), stored.window[0].capacity))
    return tuple(out)


def sync_steps(model, caches, tok: mx.array, steps: int) -> list[dict[str, Any]]:
    """A synchronous loop: per step, ms building its graph and ms evaluating it, and whether
    the step changed the stores (a flush or a growth)."""
    rows = []
    for i in range(steps):
        before = tier_tokens(caches)
        t0 = time.perf_counter()
        y = mx.argmax(model(tok, cache=caches)[:, -1, :], axis=-1)[:, None]
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        tok = y
        rows.append(
            {
                "step": i,
                "build_ms": (t1 - t0) * 1e3,
                "eval_ms": (t2 - t1) * 1e3,
                "upkeep": tier_tokens(caches) != before,
            }
        )
    return rows


def run(model, spec: str, args) -> dict[str, Any]:
    import velox_core

    vocab = SHAPES[args.shape]["vocab_size"]
    prompt = mx.random.randint(0, vocab, (1, args.context), key=mx.random.key(1))
    caches = make_caches(model, spec)
    row: dict[str, Any] = {"cache": spec, "context": args.context}
    with velox_core.routed(model):
        row["prefill_s"], _ = prefill(model, caches, prompt, args.chunk)
        decode_generate_step(model, caches, prompt[:, -1:], 16)  # warm-up
        rate, _, times = decode_generate_step(model, caches, prompt[:, -1:], args.steps)
        ms = [t * 1e3 for t in times]
        med = statistics.median(ms)
        row.update(
            decode_tok_s=rate,
            step_ms_median=med,
            step_ms_mean=statistics.mean(ms),
            step_ms_max=max(ms),
            slow_steps=[[i, round(t, 2)] for i, t in enumerate(ms) if t > args.slow * med],
        )
        if args.sync:
            rows = sync_steps(model, caches, prompt[:, -1:], args.sync_steps)
            plain = [r for r in rows if not r["upkeep"]]
            row["sync_build_ms_median"] = statistics.median(r["build_ms"] for r in plain)
            row["sync_eval_ms_median"] = statistics.median(r["eval_ms"] for r in plain)
            row["sync_upkeep_steps"] = [r for r in rows if r["upkeep"]]
    del caches
    mx.clear_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--weights", default="4bit")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--caches", default="fp16,uniform:bits=4,kivi:bits=2")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--slow", type=float, default=1.8, help="slow: over this times the median")
    p.add_argument("--sync", action="store_true", help="also the synchronous build/eval loop")
    p.add_argument("--sync-steps", type=int, default=140)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    model = build_model(args.shape, args.weights)
    graphs = os.environ.get("MLX_CUDA_GRAPH_CACHE_SIZE", "default")
    rows = []
    for spec in split_specs(args.caches):
        row = run(model, spec, args)
        row.update(shape=args.shape, weights=args.weights, mlx_cuda_graph_cache_size=graphs)
        rows.append(row)
        slow = row["slow_steps"]
        print(
            f"{spec:20s} prefill {row['prefill_s']:.2f} s, {row['decode_tok_s']:.1f} tok/s, "
            f"step ms median {row['step_ms_median']:.2f} mean {row['step_ms_mean']:.2f} "
            f"max {row['step_ms_max']:.1f}; {len(slow)} slow: {slow[:10]}",
            flush=True,
        )
        for r in row.get("sync_upkeep_steps", [])[:6]:
            print(
                f"    upkeep step {r['step']}: build {r['build_ms']:.1f} ms, eval "
                f"{r['eval_ms']:.1f} ms (other steps: {row['sync_build_ms_median']:.2f}, "
                f"{row['sync_eval_ms_median']:.2f})",
                flush=True,
            )
    base = next((r["decode_tok_s"] for r in rows if r["cache"] == "fp16"), None)
    if base:
        print("x fp16:", {r["cache"]: round(r["decode_tok_s"] / base, 3) for r in rows})
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
