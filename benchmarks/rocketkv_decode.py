"""RocketKV's second stage, timed per decode step and layer (velox-rocketkv).

One layer's cache of the reference model's KV shape (2 KV heads, 4 query heads, head dim 128,
fp16) is filled with ``--context`` tokens of model-like keys and values in 512-token chunks
and one more token (routed, so SnapKV++ cuts it to ``--budget``), then ``--steps`` decode steps
each store one token and attend one query. Per step and layer, the median and the least wall
time of (taken in turn, so that a load on the machine falls on each alike):

* ``rocketkv``: the whole step (store, page summaries brought up to date, approximate scores,
  top-k, gather, exact attention over the top-k);
* ``rocketkv, every kept token``: the same cache with the second stage off (``ratio=None`` at
  the same budget: more tokens kept, since no summaries share the budget);
* ``streamingllm``: velox-streamingllm at the same budget (the speed target's reference);
* ``selection``: :func:`velox_rocketkv.select_tokens` alone on the cache's summaries once the
  prompt is cut;
* ``exact attention over every kept token``: velox-core's ``attend`` over the rocketkv cache's
  body once the prompt is cut (what a step would cost without the selection).

With ``--model-steps N`` it then measures whole decode steps of the reference model
(``shared/reference-model``, float32 compute and float16 caches, as ``velox bench`` on a CPU):
each spec of ``--specs`` prefills the same ``--context`` tokens of held-out text in 512-token
chunks (routed) and decodes one token (the step that makes the cut the prompt's last chunk
owes), then, in ``--rounds`` rounds that take the specs in turn (so that a load on the machine
falls on every spec alike), greedily decodes ``N`` tokens from a copy of those caches. It
prints each spec's decode tokens/s, the median of its rounds and the best (the round least
slowed by other work on the machine), each with the first spec's over it.

    python3 benchmarks/rocketkv_decode.py --context 8192 --budget 1024 --steps 300 \
        --model-steps 32 --rounds 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import mlx.core as mx
from _common import write_json

from velox_core import routed
from velox_core.cache.attention import attend
from velox_rocketkv import RocketKVCache, select_tokens
from velox_streamingllm import StreamingLLMCache
from velox_testing import kv_data

HEADS, QUERY_HEADS, DIM = 2, 4, 128
SCALE = DIM**-0.5


def filled(cache, context: int):
    """``cache`` after ``context`` tokens in 512-token chunks and one more token (the update
    that makes the cut the last chunk owes)."""
    k, v = kv_data(t=context + 1, h=HEADS, d=DIM, seed=0)
    for s in range(0, context, 512):
        cache.update_and_fetch(k[:, :, s : s + 512], v[:, :, s : s + 512])
    cache.update_and_fetch(k[:, :, context:], v[:, :, context:])
    mx.eval([a for s in cache.named_stores().values() for a in s.arrays()])
    return cache


def timed(fns: dict, steps: int) -> dict[str, tuple[float, float]]:
    """Per function, the median and the least microseconds of one call evaluated, over
    ``steps`` calls after 10 warm-ups; the functions are called in turn, so that a load on the
    machine falls on each alike."""
    for _ in range(10):
        for fn in fns.values():
            mx.eval(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - t0)
    return {n: (1e6 * statistics.median(t), 1e6 * min(t)) for n, t in times.items()}


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
            logits = prefill(model, caches, ids, chunk=512)
            # the first decode step makes the cut the last chunk owes (and RocketKV's page
            # summaries): once per spec, outside the timed rounds
            logits = model(mx.argmax(logits, axis=-1)[:, None], cache=caches)[:, -1]
            mx.eval(logits, [c.state for c in caches])
            filled[spec] = (caches, logits)
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
    base, best = statistics.median(times[specs[0]]), max(times[specs[0]])
    return [
        {
            "spec": s,
            "tok_s": statistics.median(t),
            "best_tok_s": max(t),
            "vs_first": base / statistics.median(t),
            "best_vs_first": best / max(t),
            "rounds": t,
        }
        for s, t in times.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model-steps", type=int, default=0, help="decode steps per round (0: none)")
    ap.add_argument("--rounds", type=int, default=8)
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
    with routed():
        rocket = filled(RocketKVCache(budget=args.budget, every=None), args.context)
        full = filled(RocketKVCache(budget=args.budget, every=None, ratio=None), args.context)
        stream = filled(StreamingLLMCache(budget=args.budget), args.context)
        pol = rocket.policy
        body = rocket.segments()[0]
        kt = pol.pages.refresh(body, mx.float16)
        q = mx.random.normal((1, HEADS, QUERY_HEADS // HEADS, DIM), key=mx.random.key(2))
        n, k = body.tokens, pol.sparse.top_k(pol.body_budget(rocket.policy_view))
        ch = pol.sparse.channel_count(DIM)
        q4 = q.reshape(1, QUERY_HEADS, 1, DIM).astype(mx.float16)
        fns = {
            "rocketkv (store, summaries, selection, attention)": step_fn(rocket, 1),
            "rocketkv, every kept token (ratio=None)": step_fn(full, 1),
            "streamingllm": step_fn(stream, 1),
            f"selection alone (top {k} of {n}, {ch} channels)": lambda: select_tokens(
                q, kt, n, pol.pages.page, ch, k, SCALE
            ),
            f"exact attention over every kept token ({n})": lambda: attend(q4, [body], SCALE),
        }
        rows = [
            {"what": w, "us": m, "least_us": lo} for w, (m, lo) in timed(fns, args.steps).items()
        ]
    print(
        f"context {args.context}, budget {args.budget}: kept tokens {rocket.size()} (rocketkv), "
        f"{full.size()} (ratio=None), {stream.size()} (streamingllm); "
        f"{pol.sparse_steps} sparse steps"
    )
    print(f"{'per decode step and layer':<60} {'median us':>10} {'least us':>9}")
    for r in rows:
        print(f"{r['what']:<60} {r['us']:>10.0f} {r['least_us']:>9.0f}")
    rates = model_rates(args) if args.model_steps else []
    if rates:
        print(f"reference model, {args.model_steps} decode steps x {args.rounds} rounds:")
        head = f"{'spec':<40} {'median tok/s':>12} {'first / this':>12}"
        print(f"{head} {'best':>7} {'first / this':>12}")
        for r in rates:
            print(
                f"{r['spec']:<40} {r['tok_s']:>12.1f} {r['vs_first']:>11.2f}x "
                f"{r['best_tok_s']:>7.1f} {r['best_vs_first']:>11.2f}x"
            )
    write_json(args.json, {"args": vars(args), "rows": rows, "model": rates})


if __name__ == "__main__":
    main()
