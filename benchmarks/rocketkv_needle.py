"""Where RocketKV loses a long-context answer: per layer, are the asked needle's tokens kept by
its first stage and attended by its second (velox-rocketkv)?

On ``velox eval``'s prompts (``--task``, ``--length``, ``--prompts``; the question inside the
compressed prompt, each policy cutting once at its end), fp16 answers greedily first; then
each spec of ``--specs`` (``velox eval``'s specs: a ``budget=P%`` is a share of the prompt)
prefills the prompt, answers greedily (scored as the suite scores) and is teacher-forced along
fp16's answer. At each step that predicts a token of the asked value, in every RocketKV
layer, it counts the value's tokens (in the haystack) that the layer

* ``kept``: still holds after the first stage's cut (SnapKV++);
* ``attended``: attends in the step: the ``topk`` tokens the approximate scores pick (every
  kept token where the second stage is off, ``ratio=None``);
* ``exact``: would attend with the exact top-k: the same number of tokens of highest exact
  attention weight (averaged over the query heads of the KV head);

and ``head w``, the largest exact attention weight one query head puts on those tokens. The
table averages them over the prompts fp16 answers, per spec and layer, beside each spec's
accuracy and top-1 agreement with fp16 along its answer:

    python3 benchmarks/rocketkv_needle.py --model gemma3 --length 2048 --prompts 4 \\
        --specs rocketkv:budget=25%,kernel=15 rocketkv:budget=25%,kernel=15,channels=1.0
"""

from __future__ import annotations

import argparse
import copy
import types

import mlx.core as mx
import numpy as np
from _common import write_json

from velox_core import routed
from velox_rocketkv import RocketKVPolicy, select_tokens


def token_span(tok, ids: list[int], text: str) -> tuple[int, int] | None:
    """``[a, b)``: the fewest tokens of ``ids`` whose text holds the first ``text``, or None."""
    if text not in tok.decode(ids):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:  # the shortest prefix holding it
        m = (lo + hi) // 2
        lo, hi = (lo, m) if text in tok.decode(ids[:m]) else (m + 1, hi)
    end, lo, hi = lo, 0, lo - 1
    while lo < hi:  # the latest start still holding it
        m = (lo + hi + 1) // 2
        lo, hi = (m, hi) if text in tok.decode(ids[m:end]) else (lo, m - 1)
    return lo, end


def probe(rows: list, layer: int, needle: np.ndarray, steps: range, on: dict):
    """A ``decode_segments`` that counts the needle's tokens kept, attended and in the exact
    top-k at the steps (cache offsets) ``steps``, then attends as the policy does."""

    def decode_segments(self, view, queries, scale):
        segs = RocketKVPolicy.decode_segments(self, view, queries, scale)
        if not on["on"] or view.offset not in steps:
            return segs
        body = view.segments()[1 if view.sink_count() else 0]
        pos = view.body_positions()  # per KV head, (B, T)
        keys = body.key_codec.decode(body.keys).astype(mx.float32)  # (B, H, T, D)
        b, hq, _, d = queries.shape
        h = keys.shape[1]
        q = queries.reshape(b, h, hq // h, d).astype(mx.float32)
        w = mx.softmax((q @ mx.swapaxes(keys, -1, -2)) * scale, axis=-1)  # (B, H, R, T)
        n = keys.shape[2]
        if segs is None:  # every kept token attended
            k, idx = n, mx.broadcast_to(mx.arange(n), (b, h, n))
        else:
            k = segs[1 if view.sink_count() else 0].tokens
            kt = self.pages.refresh(body, view.dtype or queries.dtype)
            ch = self.sparse.channel_count(d)
            idx = select_tokens(q, kt, n, self.pages.page, ch, k, scale)
        top = mx.argpartition(-mx.mean(w, axis=2), kth=k - 1, axis=-1)[..., :k]
        w = np.array(w)
        for head in range(h):
            inn = np.isin(np.array(pos[head]), needle)  # (B, T)
            for row in range(b):
                rows.append(
                    {
                        "layer": layer,
                        "kept": int(inn[row].sum()),
                        "attended": int(inn[row][np.array(idx[row, head])].sum()),
                        "exact": int(inn[row][np.array(top[row, head])].sum()),
                        "head_w": float(w[row, head][:, inn[row]].sum(axis=-1).max()),
                    }
                )
        return segs

    return decode_segments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--task", default="multikey:keys=2")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--specs", nargs="+", default=["rocketkv:budget=25%"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from velox_cli.bench import load_model
    from velox_cli.evaluate import greedy
    from velox_cli.longctx.run import prompt_caches, resolve_spec
    from velox_cli.longctx.tasks import make_prompts
    from velox_cli.scoring import teacher_force
    from velox_cli.specs import build_caches, parse

    model, tok, store, _ = load_model(args.model)
    prompts = make_prompts(tok, args.task, args.length, args.prompts)
    out: dict = {s: {"score": [], "top1": [], "rows": []} for s in args.specs}
    on = {"on": False}
    for p in prompts:
        with routed(model):
            caches = build_caches(parse("fp16"), model, store)
            logits = prompt_caches(model, caches, p, "inside", args.chunk)
            ref = greedy(model, caches, logits, p.max_new)
        value = token_span(tok, p.context, p.answers[0])
        answered = token_span(tok, ref, p.answers[0])
        if value is None or answered is None or answered[0] == 0:
            continue  # fp16 does not answer (or answers from the prompt's logits alone)
        needle = np.arange(*value)
        steps = range(p.tokens + answered[0], p.tokens + answered[1])  # offsets predicting it
        for spec in args.specs:
            caches = build_caches(parse(resolve_spec(spec, p.tokens)), model, store)
            rows = out[spec]["rows"]
            for layer, c in enumerate(caches):
                if isinstance(getattr(c, "policy", None), RocketKVPolicy):
                    c.policy.decode_segments = types.MethodType(
                        probe(rows, layer, needle, steps, on), c.policy
                    )
            with routed(model):
                logits = prompt_caches(model, caches, p, "inside", args.chunk)
                ans = greedy(model, copy.deepcopy(caches), logits, p.max_new)  # unprobed copy
                on["on"] = True
                lp = teacher_force(model, caches, logits, ref)
                on["on"] = False
            out[spec]["score"].append(p.score(tok.decode(ans)))
            out[spec]["top1"].append(float(np.mean(np.argmax(lp, axis=-1) == np.asarray(ref))))
    prompts_used = len(next(iter(out.values()))["score"])
    if not prompts_used:
        raise SystemExit(f"fp16 answers none of the {len(prompts)} prompts: nothing to follow")
    print(f"{args.task} @ {args.length}, {prompts_used} prompts fp16 answers; per value step:")
    ws = max(len(s) for s in args.specs)
    print(
        f"{'spec':<{ws}} {'score':>5} {'top-1':>5} {'layer':>5} {'kept':>5} "
        f"{'attended':>8} {'exact':>5} {'head w':>6}"
    )
    table = []
    for spec, r in out.items():
        layers = sorted({x["layer"] for x in r["rows"]})
        for i, layer in enumerate(layers):
            mine = [x for x in r["rows"] if x["layer"] == layer]
            row = {
                "spec": spec,
                "score": float(np.mean(r["score"])),
                "top1": float(np.mean(r["top1"])),
                "layer": layer,
                **{
                    k: float(np.mean([x[k] for x in mine]))
                    for k in ("kept", "attended", "exact", "head_w")
                },
            }
            table.append(row)
            lead = f"{spec:<{ws}} {row['score']:>5.2f} {row['top1']:>5.2f}"
            lead = lead if i == 0 else " " * len(lead)
            print(
                f"{lead} {layer:>5} {row['kept']:>5.1f} {row['attended']:>8.1f} "
                f"{row['exact']:>5.1f} {row['head_w']:>6.2f}"
            )
    write_json(args.json, {"args": vars(args), "rows": table})


if __name__ == "__main__":
    main()
