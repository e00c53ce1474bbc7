"""RocketKV's second stage, timed per decode step and layer (velox-rocketkv).

One layer's cache of the reference model's KV shape (2 KV heads, 4 query heads, head dim 128,
fp16) is filled with ``--context`` tokens of model-like keys and values in 512-token chunks
(routed, so SnapKV++ cuts it to ``--budget``), then ``--steps`` decode steps each store one
token and attend one query. Per step and layer, the median wall time of:

* ``rocketkv``: the whole step (store, page summaries brought up to date, approximate scores,
  top-k, gather, exact attention over the top-k);
* ``rocketkv, every kept token``: the same cache with the second stage off (``ratio=None`` at
  the same budget: more tokens kept, since no summaries share the budget);
* ``streamingllm``: velox-streamingllm at the same budget (the speed target's reference);
* ``selection``: :func:`velox_rocketkv.select_tokens` alone on the cache's summaries;
* ``exact attention over every kept token``: velox-core's ``attend`` over the rocketkv cache's
  segments (what a step would cost without the selection).

With ``--model-steps N`` it then measures whole decode steps of the reference model
(``shared/reference-model``, float32 compute and float16 caches, as ``velox bench`` on a CPU):
each spec of ``--specs`` prefills the same ``--context`` tokens of held-out text in 512-token
chunks (routed), then, in ``--rounds`` rounds that take the specs in turn (so that a load on the
machine falls on every spec alike), greedily decodes ``N`` tokens from a copy of its prefilled
caches; it prints each spec's decode tokens/s (the median of its rounds) and its ratio to the
first spec's.

    python3 benchmarks/rocketkv_decode.py --context 8192 --budget 1024 --steps 300 \
        --model-steps 64 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import mlx.core as mx

from velox_core import routed
from velox_core.cache.attention import attend
from velox_rocketkv import RocketKVCache, select_tokens
from velox_streamingllm import StreamingLLMCache
from velox_testing import kv_data

HEADS, QUERY_HEADS, DIM = 2, 4, 128
SCALE = DIM**-0.5


def filled(cache, context: int):
    k, v = kv_data(t=context, h=HEADS, d=DIM, seed=0)
    for s in range(0, context, 512):
        cache.update_and_fetch(k[:, :, s : s + 512], v[:, :, s : s + 512])
    mx.eval([a for s in cache._stores() for a in s.arrays()])
    return cache


def timed(fn, steps: int) -> float:
    """Median microseconds of ``fn()`` evaluated, over ``steps`` calls after 10 warm-ups."""
    for _ in range(10):
        mx.eval(fn())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def step_fn(cache, seed: int):
    """A decode step: store one token, attend one query."""
    k, v = kv_data(t=1, h=HEADS, d=DIM, seed=seed)
    q = mx.random.normal((1, QUERY_HEADS, 1, DIM), key=mx.random.key(seed)).astype(mx.float16)

    def run():
        cache.update_and_fetch(k, v)
        return cache.attend(q, SCALE)

    return run


def model_rates(args) -> list[dict]:
    """Decode tokens/s of each spec on the reference model, rounds interleaved."""
    from velox_cli.bench import load_model
    from velox_cli.data import load_text
    from velox_cli.evaluate import prefill
    from velox_cli.specs import build_caches, parse

    model, tok, store, _ = load_model(None)
    ids: list[int] = []
    for text in load_text(None):
        ids += tok.encode(text)
        if len(ids) >= args.context:
            break
    ids = ids[: args.context]
    specs = [s.format(budget=args.budget) for s in args.specs]
    filled = {}
    with routed(model):
        for spec in specs:
            caches = build_caches(parse(spec), model, store)
            filled[spec] = (caches, prefill(model, caches, ids, chunk=512))
        times: dict[str, list[float]] = {s: [] for s in specs}
        for _ in range(args.rounds):
            for spec in specs:
                caches, logits = filled[spec]
                caches = copy.deepcopy(caches)
                y = mx.argmax(logits, axis=-1)[:, None]
                mx.eval(y)
                t0 = time.perf_counter()
                for _ in range(args.model_steps):
                    y = mx.argmax(model(y, cache=caches)[:, -1], axis=-1)[:, None]
                    mx.eval(y)
                times[spec].append(args.model_steps / (time.perf_counter() - t0))
    base = statistics.median(times[specs[0]])
    return [
        {"spec": s, "tok_s": statistics.median(t), "vs_first": base / statistics.median(t)}
        for s, t in times.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model-steps", type=int, default=0, help="decode steps per round (0: none)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--specs",
        nargs="+",
        default=[
            "streamingllm:budget={budget}",
            "rocketkv:budget={budget}",
            "rocketkv:budget={budget},ratio=None",
            "snapkv:budget={budget}",
        ],
        help="specs of the model run ({budget}: --budget); the first is the reference",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    with routed():
        rocket = filled(RocketKVCache(budget=args.budget, every=None), args.context)
        full = filled(RocketKVCache(budget=args.budget, every=None, ratio=None), args.context)
        stream = filled(StreamingLLMCache(budget=args.budget), args.context)
        for name, cache in (
            ("rocketkv", rocket),
            ("rocketkv, every kept token (ratio=None)", full),
            ("streamingllm", stream),
        ):
            us = timed(step_fn(cache, 1), args.steps)
            rows.append({"what": name, "us": us, "kept": cache.size()})
        pol = rocket.policy
        body = rocket.segments()[0]
        kt = pol.pages.refresh(body, mx.float16)
        q = mx.random.normal((1, HEADS, QUERY_HEADS // HEADS, DIM), key=mx.random.key(2))
        n, k = body.tokens, pol.sparse.top_k(pol.body_budget(rocket))
        ch = pol.sparse.channel_count(DIM)
        us = timed(lambda: select_tokens(q, kt, n, pol.pages.page, ch, k, SCALE), args.steps)
        rows.append({"what": f"selection alone (top {k} of {n}, {ch} channels)", "us": us})
        q4 = q.reshape(1, QUERY_HEADS, 1, DIM).astype(mx.float16)
        us = timed(lambda: attend(q4, rocket.segments(), SCALE), args.steps)
        rows.append({"what": f"exact attention over every kept token ({n})", "us": us})
    print(
        f"context {args.context}, budget {args.budget}: kept tokens {rocket.size()} (rocketkv), "
        f"{full.size()} (ratio=None), {stream.size()} (streamingllm); "
        f"{pol.sparse_steps} sparse steps"
    )
    print(f"{'per decode step and layer':<60} {'median us':>10}")
    for r in rows:
        print(f"{r['what']:<60} {r['us']:>10.0f}")
    rates = model_rates(args) if args.model_steps else []
    if rates:
        print(f"reference model, {args.model_steps} decode steps x {args.rounds} rounds:")
        print(f"{'spec':<44} {'decode tok/s':>12} {'first / this':>13}")
        for r in rates:
            print(f"{r['spec']:<44} {r['tok_s']:>12.1f} {r['vs_first']:>12.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "model": rates}, f, indent=1)


if __name__ == "__main__":
    main()
