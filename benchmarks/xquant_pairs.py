"""How alike the codes of adjacent layers are: what XQuant's cross-layer pairs rely on.

XQuant (arXiv 2510.11236, velox-xquant) stores no codes for the higher layer ``l`` of a pair
``(l - 1, l)``: it reconstructs layer ``l``'s keys and values from layer ``l - 1``'s codes with
its own calibrated scales and zero-points. That works as far as the two layers' codes agree.
For each pair this script prefills a text into mlx-lm's fp16 cache, codes every layer's keys
(per channel) and values (per token) as velox-xquant does, and prints per pair and side:

- ``agree``: the share of entries whose two codes are equal;
- ``chance``: the share two independent codes with the same per-level frequencies would
  agree on (``sum_c p_{l-1}(c) p_l(c)``);
- ``own``: the relative error of layer ``l``'s reconstruction from its own codes;
- ``paired``: the relative error from layer ``l - 1``'s codes with layer ``l``'s scales (what
  the pair stores); 1.0 is the error of reconstructing every entry as 0.

    python benchmarks/xquant_pairs.py --model shared/reference-model
    python benchmarks/xquant_pairs.py --model smollm2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import KVCache

from velox_core import Packed
from velox_core.ops import unpack
from velox_xquant import XQuantCodes, default_eta

ROOT = Path(__file__).resolve().parents[1]


def _text(tokens: int, tokenizer) -> list[int]:
    """The held-out text velox bench evaluates on (its documents joined), ``tokens`` ids."""
    from velox_cli.data import load_text

    ids = tokenizer.encode("\n\n".join(load_text(None)))
    if len(ids) < tokens:
        raise SystemExit(f"the held-out text holds {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens]


def _rel(a: mx.array, b: mx.array) -> float:
    return float((mx.linalg.norm(a - b) / mx.linalg.norm(b)).item())


def pair_rows(model, ids: list[int], bits: int, group: int) -> list[dict]:
    caches = [KVCache() for _ in model.layers]
    model(mx.array([ids]), cache=caches)
    rows = []
    for layer in range(1, len(caches), 2):
        for side, axis in (("keys", "channel"), ("values", "token")):
            lo, up = (getattr(caches[i], side) for i in (layer - 1, layer))
            t = lo.shape[2] // group * group
            lo, up = lo[:, :, :t], up[:, :, :t]
            codec = XQuantCodes(bits, group, axis, eta=default_eta(bits))
            pl, pu = codec.encode(lo), codec.encode(up)
            d = up.shape[-1]
            ql, qu = (np.array(unpack(p.data["codes"], bits, d)).ravel() for p in (pl, pu))
            fl, fu = (np.bincount(q, minlength=1 << bits) / q.size for q in (ql, qu))
            mixed = Packed(
                {**pu.data, "codes": pl.data["codes"]}, pu.tokens, pu.block, pu.per_block
            )
            rows.append(
                {
                    "pair": [layer - 1, layer],
                    "side": side,
                    "agree": float(np.mean(ql == qu)),
                    "chance": float(np.sum(fl * fu)),
                    "own": _rel(codec.decode(pu), up.astype(mx.float32)),
                    "paired": _rel(codec.decode(mixed), up.astype(mx.float32)),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=str(ROOT / "shared" / "reference-model"),
        help="an mlx-lm directory, a .gguf file or a name (smollm2)",
    )
    ap.add_argument("--tokens", type=int, default=1024, help="tokens prefilled (default 1024)")
    ap.add_argument("--bits", type=int, default=2, help="code width (default 2)")
    ap.add_argument("--group", type=int, default=32, help="group size (default 32)")
    ap.add_argument("--json", help="write the rows as JSON")
    args = ap.parse_args(argv)
    from velox_cli.models import resolve

    model, tokenizer = mlx_lm.load(str(resolve(args.model)))
    rows = pair_rows(model, _text(args.tokens, tokenizer), args.bits, args.group)
    print(f"{args.model}: {args.tokens} tokens, {args.bits}-bit codes in groups of {args.group}")
    print(f"{'pair':>8} {'side':>7} {'agree':>6} {'chance':>7} {'own':>6} {'paired':>7}")
    for r in rows:
        pair = f"{r['pair'][0]},{r['pair'][1]}"
        print(
            f"{pair:>8} {r['side']:>7} {r['agree']:6.3f} {r['chance']:7.3f} "
            f"{r['own']:6.3f} {r['paired']:7.3f}"
        )
    for side in ("keys", "values"):
        sel = [r for r in rows if r["side"] == side]
        mean = {k: np.mean([r[k] for r in sel]) for k in ("agree", "chance", "own", "paired")}
        print(
            f"{'mean':>8} {side:>7} {mean['agree']:6.3f} {mean['chance']:7.3f} "
            f"{mean['own']:6.3f} {mean['paired']:7.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
