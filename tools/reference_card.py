"""Measure the reference model's card: held-out perplexity and long-range recall.

    python tools/reference_card.py [--model shared/reference-model] [--trials 10]

Prints Markdown tables (for docs/reference-model.md) and writes out/reference-card.json.
Perplexity: non-overlapping windows of the held-out split (standard-library files never seen
in training), fp16 cache. Recall: the bench's synthetic prompts (``NAME = 12345`` at a depth
of a held-out code context, ``assert NAME ==`` at its end), greedy answer, exact match.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def perplexity(model, stream: np.ndarray, length: int, span: int) -> float:
    """Mean over the first ``span`` tokens, cut into non-overlapping windows of ``length``."""
    import mlx.nn as nn

    nll, count = 0.0, 0
    for i in range(span // length):
        s = i * length
        if s + length + 1 > len(stream):
            break
        x = mx.array(stream[s : s + length + 1].astype(np.int32))[None]
        logits = model(x[:, :-1]).astype(mx.float32)
        nll += float(nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum").item())
        count += length
    return math.exp(nll / count)


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT / "packages" / "velox-cli" / "src"))
    from velox_cli.bench import load_model
    from velox_cli.data import load_text, recall_prompts, token_stream
    from velox_cli.evaluate import retrieval
    from velox_cli.specs import Spec, build_caches

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "shared" / "reference-model"))
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--span", type=int, default=65536, help="held-out tokens for perplexity")
    ap.add_argument("--no-recall", action="store_true")
    a = ap.parse_args(argv)
    model, tok, store, path = load_model(a.model)
    stream = token_stream(tok, load_text(None))
    ppl = {n: perplexity(model, stream, n, a.span) for n in (2048, 8192)}
    lengths, depths = [1024, 4096, 8192], [0.1, 0.5, 0.9]
    recall = {}
    for n in [] if a.no_recall else lengths:
        for d in depths:
            prompts = recall_prompts(tok, stream, [n], [d], a.trials, seed=4321)
            acc, _ = retrieval(
                model, tok, lambda: build_caches(Spec("fp16", "fp16"), model, store), prompts
            )
            recall[f"{n}@{d}"] = acc
    print(f"| window | held-out perplexity (first {a.span:,} tokens) |\n|---|---|")
    for n, v in ppl.items():
        print(f"| {n:,} | {v:.3f} |")
    if a.no_recall:
        return 0
    print("\n| context | " + " | ".join(f"depth {d}" for d in depths) + " |")
    print("|---|" + "---|" * len(depths))
    for n in lengths:
        print(f"| {n:,} | " + " | ".join(f"{recall[f'{n}@{d}']:.2f}" for d in depths) + " |")
    out = ROOT / "out"
    out.mkdir(exist_ok=True)
    (out / "reference-card.json").write_text(
        json.dumps(
            {"model": path, "perplexity": ppl, "recall": recall, "trials": a.trials}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
