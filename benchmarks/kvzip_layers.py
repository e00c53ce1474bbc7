"""Which of a model's KVzip layers lose the answer, and whether the asked needle's sentence
brings it back: KVzip's own scores, kept sets changed one thing at a time.

For each prompt of the long-context suite (question after the context, as ``velox eval``) the
context is prefilled into ``kvzip:budget=P%`` caches and scored once by
:func:`velox_kvzip.compress` (on a copy); then the question is prefilled and answered
greedily over caches cut in several ways, all from those scores:

- ``fp16``: nothing cut;
- ``kvzip``: as :func:`velox_kvzip.compress` cuts (the spec's ``heads``, ``global`` by
  default: one ranking over every KVzip layer's pairs);
- ``kvzip heads=layer``: each KVzip layer keeps its own best ``P%``;
- ``only layer L``: layer ``L`` keeps its best ``P%``, every other layer everything;
- ``kvzip + needle`` and ``kvzip heads=layer + needle``: the same kept sets, plus the tokens
  of the sentence that holds the asked needle (a few dozen tokens per layer), in every
  KVzip layer.

A cut that loses the answer where ``+ needle`` keeps it has dropped the needle's sentence:
the scores, not the budget or the layers' share of it, decide. Prints one row per variant
(accuracy over the prompts, tokens kept per KVzip layer) and writes every answer with
``--json``.

    python benchmarks/kvzip_layers.py --model gemma3 --lengths 2048 --prompts 4
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def needle_sentence(tokenizer, prompt) -> list[int]:
    """Context positions of the sentence holding the first answer (from the sentence's start
    after the previous ``.`` or line break to the character after the answer)."""
    pieces = [tokenizer.decode([t]) for t in prompt.context]
    text = "".join(pieces)
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - np.array([len(p) for p in pieces])
    at = text.find(prompt.answers[0])
    if at < 0:
        return []
    first = max(text.rfind(". ", 0, at), text.rfind("\n", 0, at)) + 1
    last = at + len(prompt.answers[0]) + 1
    return [int(i) for i in np.flatnonzero((starts < last) & (ends > first))]


def cut(caches: list, layers: list[int], keep: dict[int, list[np.ndarray] | None], n: int):
    """A copy of the prefilled ``caches`` whose KVzip layers keep the given context positions
    per KV head (None: everything), as :func:`velox_kvzip.compress` leaves them."""
    out = copy.deepcopy(caches)
    for i in layers:
        c = out[i]
        if keep[i] is None:
            c.policy.done(n)
            continue
        pos = np.array(c.policy_view.body_positions()[0][0])
        idx = [np.flatnonzero(np.isin(pos, k)).astype(np.int32) for k in keep[i]]
        if len({len(x) for x in idx}) == 1:
            c.evict(mx.array(np.stack(idx)[None]))
        else:
            c.evict([mx.array(x) for x in idx])
        c.policy.done(c.protected() + max(len(x) for x in idx))
    return out


def answer(model, tokenizer, caches: list, prompt, chunk: int, eos: set[int]) -> str:
    """The question prefilled over ``caches`` (held whole, as ``velox eval`` holds it) and the
    greedy answer."""
    from velox_cli.evaluate import greedy, prefill
    from velox_core import routed

    with routed(model):
        logits = prefill(model, caches, prompt.question, chunk)
        for c in caches:
            policy = getattr(c, "policy", None)
            if policy is not None and policy.budget is not None:
                policy.hold_stored()
                policy.budget += len(prompt.question)
        ids = greedy(model, caches, logits, prompt.max_new)
    for j, t in enumerate(ids):
        if t in eos:
            ids = ids[:j]
            break
    return tokenizer.decode(ids)


def run_prompt(model, tokenizer, store, prompt, spec: str, chunk: int, eos: set[int]):
    """Every variant's answer on one prompt: ``{variant: (answer, kept per KVzip layer)}``."""
    from velox_cli.evaluate import prefill
    from velox_cli.longctx.run import budget_tokens, resolve_spec
    from velox_cli.specs import build_caches, parse
    from velox_core import routed
    from velox_kvzip import compress

    n = len(prompt.context)
    caches = build_caches(parse(resolve_spec(spec, budget_tokens(prompt, "after"))), model, store)
    with routed(model):
        prefill(model, caches, prompt.context, chunk)
    scored = copy.deepcopy(caches)
    with routed(model):
        report = compress(model, scored, prompt.context, tokenizer)
    layers = [i for i, c in enumerate(caches) if getattr(c, "policy", None) is not None]
    layers = [i for i in layers if hasattr(caches[i].policy, "begin")]
    scores = {i: np.array(s[0]) for i, s in zip(layers, report.scores)}  # (H, n)
    sinks = caches[layers[0]].sinks
    body = {i: max(caches[i].policy.kept(n) - sinks, 0) for i in layers}

    def kept_now(c) -> list[np.ndarray]:
        return [np.array(p[0]) for p in c.policy_view.body_positions()]

    def best(i: int) -> list[np.ndarray]:
        s = scores[i][:, sinks:]
        return [np.sort(np.argsort(-row, kind="stable")[: body[i]] + sinks) for row in s]

    sentence = np.array(needle_sentence(tokenizer, prompt), dtype=np.int64)
    sentence = sentence[sentence >= sinks]
    own = {i: kept_now(scored[i]) for i in layers}
    layer = {i: best(i) for i in layers}
    plus = lambda ks: [np.union1d(k, sentence) for k in ks]  # noqa: E731
    variants: dict[str, dict[int, list[np.ndarray] | None]] = {
        "fp16": dict.fromkeys(layers),
        "kvzip": own,
        "kvzip heads=layer": layer,
    }
    for i in layers:
        variants[f"only layer {i}"] = {j: (layer[j] if j == i else None) for j in layers}
    variants["kvzip + needle"] = {i: plus(own[i]) for i in layers}
    variants["kvzip heads=layer + needle"] = {i: plus(layer[i]) for i in layers}
    out = {}
    for name, keep in variants.items():
        if name == "kvzip":
            cs = copy.deepcopy(scored)
        else:
            cs = cut(caches, layers, keep, n)
        kept = [
            n if keep[i] is None else sinks + float(np.mean([len(k) for k in keep[i]]))
            for i in layers
        ]
        text = answer(model, tokenizer, cs, prompt, chunk, eos)
        out[name] = {"answer": text, "score": prompt.score(text), "kept": kept}
    return layers, [int(x) for x in sentence], out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--task", default="multikey:keys=2")
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--spec", default="kvzip:budget=25%")
    ap.add_argument("--haystack", default="prose")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk")
    ap.add_argument("--json", help="write every answer here")
    a = ap.parse_args(argv)

    from velox_cli.bench import load_model
    from velox_cli.longctx.tasks import make_prompts

    t0 = time.perf_counter()
    model, tokenizer, store, path = load_model(a.model)
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    rows = []
    for length in a.lengths:
        prompts = make_prompts(
            tokenizer, a.task, length, a.prompts, haystack=a.haystack, seed=a.seed
        )
        for k, p in enumerate(prompts):
            t = time.perf_counter()
            layers, sentence, got = run_prompt(model, tokenizer, store, p, a.spec, a.chunk, eos)
            rows.append(
                {
                    "length": length,
                    "index": k,
                    "depth": p.depth,
                    "context": len(p.context),
                    "answers": p.answers,
                    "sentence": sentence,
                    "layers": layers,
                    "variants": got,
                }
            )
            _log(
                f"{a.task} @ {length} #{k} (depth {p.depth:.2f}, {time.perf_counter() - t:.0f} s): "
                + ", ".join(f"{name} {v['score']:g}" for name, v in got.items())
            )
    names = list(rows[0]["variants"])
    layers = rows[0]["layers"]
    print(
        f"\n{a.model}, {a.spec}, {a.task}, {a.haystack} haystack, question after, "
        f"{len(rows)} prompts at {', '.join(map(str, a.lengths))} tokens"
    )
    print(f"\n| kept sets | accuracy | kept per KV head, layers {', '.join(map(str, layers))} |")
    print("|---|---|---|")
    for name in names:
        acc = 100 * float(np.mean([r["variants"][name]["score"] for r in rows]))
        kept = np.mean([r["variants"][name]["kept"] for r in rows], axis=0)
        context = float(np.mean([r["context"] for r in rows]))
        each = " / ".join("all" if abs(x - context) < 0.5 else f"{x:.0f}" for x in kept)
        print(f"| {name} | {acc:.1f} | {each} |")
    sent = float(np.mean([len(r["sentence"]) for r in rows]))
    print(f"\nneedle sentence: {sent:.1f} tokens on average; {time.perf_counter() - t0:.0f} s")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        info = {
            "model": a.model,
            "path": str(path),
            "spec": a.spec,
            "task": a.task,
            "haystack": a.haystack,
            "seed": a.seed,
            "lengths": a.lengths,
            "prompts": a.prompts,
            "question": "after",
        }
        Path(a.json).write_text(json.dumps({"settings": info, "rows": rows}, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
