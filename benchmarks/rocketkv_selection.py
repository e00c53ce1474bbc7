"""How much attention RocketKV's approximate top-k keeps, against the exact top-k (velox-rocketkv).

On the reference model (``shared/reference-model``, float32 compute, float16 caches), each
setting of ``--specs`` prefills ``--context`` tokens of held-out text in 512-token chunks
(routed: SnapKV++ cuts to the budget), then decodes ``--steps`` held-out tokens (teacher
forced). At every decode step, layer and KV head it computes the exact attention weights of
the step's queries over the kept body tokens (averaged over the query heads of the KV head)
and prints, averaged over steps, layers and heads:

* ``approx``: the weight on the ``topk`` tokens the hybrid sparse selection picks (what the
  step attends);
* ``exact``: the weight on the ``topk`` tokens of highest weight (an oracle top-k);
* ``approx / exact``: their ratio, step by step.

    python3 benchmarks/rocketkv_selection.py --context 8192 --specs rocketkv:budget=1024
"""

from __future__ import annotations

import argparse
import types

import mlx.core as mx
import numpy as np
from _common import write_json

from velox_core import routed
from velox_rocketkv import RocketKVPolicy, select_tokens


def probe(stats: dict):
    """A ``decode_segments`` that records the weights the selection keeps, then selects."""

    def decode_segments(self, view, queries, scale):
        segs = RocketKVPolicy.decode_segments(self, view, queries, scale)
        if segs is None:
            return None
        body = segs[1 if view.sink_count() else 0]
        n = view.body_sizes()[0]
        whole = view.segments()[1 if view.sink_count() else 0]
        keys = whole.key_codec.decode(whole.keys).astype(mx.float32)  # (B, H, n, D)
        b, hq, _, d = queries.shape
        h = keys.shape[1]
        q = queries.reshape(b, h, hq // h, d).astype(mx.float32)
        w = mx.mean(mx.softmax((q @ mx.swapaxes(keys, -1, -2)) * scale, axis=-1), axis=2)
        k = body.tokens
        kt = self.pages.refresh(whole, view.dtype or queries.dtype)
        ch = self.sparse.channel_count(d)
        idx = select_tokens(q, kt, n, self.pages.page, ch, k, scale)
        approx = np.array(mx.sum(mx.take_along_axis(w, idx, axis=-1), axis=-1)).ravel()
        exact = np.array(mx.sum(mx.topk(w, k, axis=-1), axis=-1)).ravel()
        stats["approx"] += approx.tolist()
        stats["exact"] += exact.tolist()
        stats["shape"] = (n, k, ch, self.pages.page)
        return segs

    return decode_segments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--specs", nargs="+", default=["rocketkv:budget=1024"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from velox_cli.bench import load_model
    from velox_cli.data import load_text
    from velox_cli.evaluate import prefill
    from velox_cli.specs import build_caches, parse

    model, tok, store, _ = load_model(None)
    ids: list[int] = []
    for text in load_text(None):
        ids += tok.encode(text)
        if len(ids) >= args.context + args.steps:
            break
    rows = []
    for spec in args.specs:
        stats: dict = {"approx": [], "exact": []}
        caches = build_caches(parse(spec), model, store)
        for c in caches:
            c.policy.decode_segments = types.MethodType(probe(stats), c.policy)
        with routed(model):
            prefill(model, caches, ids[: args.context], chunk=512)
            for i in range(args.context, args.context + args.steps):
                mx.eval(model(mx.array([[ids[i]]]), cache=caches))
        a, e = np.array(stats["approx"]), np.array(stats["exact"])
        n, k, ch, page = stats["shape"]
        rows.append(
            {
                "spec": spec,
                "kept": n,
                "topk": k,
                "channels": ch,
                "page": page,
                "approx": float(a.mean()),
                "exact": float(e.mean()),
                "ratio": float((a / e).mean()),
            }
        )
    print(f"context {args.context}, {args.steps} decode steps; per step, layer and KV head:")
    head = f"{'spec':<40} {'kept':>5} {'topk':>5} {'ch':>4} {'page':>4}"
    print(f"{head} {'approx':>7} {'exact':>7} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['spec']:<40} {r['kept']:>5} {r['topk']:>5} {r['channels']:>4} {r['page']:>4} "
            f"{r['approx']:>7.3f} {r['exact']:>7.3f} {r['ratio']:>6.3f}"
        )
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
