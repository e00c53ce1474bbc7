"""``python -m velox_transfer``: fit a mapper between two models, apply it, measure it.

    python -m velox_transfer fit --source SRC --target TGT --out DIR [--data FILE]
        [--every 5] [--tokens 131072] [--heldout-tokens 16384] [--seq-len 2048]
        [--layers-per-target N (default: all)] [--lags 0,1,2,3]
        [--alphas 1e-6,1e-5,...,10,100] [--rank N (default: chosen on held-out rows)]
        [--rank-tol 0.01] [--weights-dtype float16] [--dtype float32]
    python -m velox_transfer apply --source SRC --target TGT --mapper DIR
        (--prompt TEXT | --prompt-file FILE) [--cache fp16|SPEC] [--max-tokens 32]
    python -m velox_transfer eval --source SRC --target TGT --mapper DIR [--data FILE]
        [--prefixes 256,1024,2048] [--continuation 32] [--samples 4] [--tails 16,64,256]
        [--cache fp16|SPEC] [--json FILE]

Models are mlx-lm paths (``mlx_lm.load``) sharing one tokenizer (the source's is used).
``--data`` defaults to ``shared/data/heldout.jsonl.gz``; ``fit`` calibrates on documents
``eval`` never evaluates on (:mod:`velox_transfer.data`). ``velox transfer ...`` runs this.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from velox_core import environment

DTYPES = ("auto", "float32", "float16", "bfloat16")


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _default_data() -> Path:
    roots = environment.paths("VELOX_SHARED")
    here = Path.cwd().resolve()
    roots += [p / "shared" for p in (here, *here.parents)]
    for r in roots:
        p = r / "data" / "heldout.jsonl.gz"
        if p.is_file():
            return p
    raise SystemExit("--data: shared/data/heldout.jsonl.gz not found; pass --data FILE")


def _load(path: str, dtype: str):
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(path)
    if dtype != "auto":
        model.set_dtype(getattr(mx, dtype))
    return model, tokenizer


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", required=True, help="the source model (its cache is mapped)")
    p.add_argument("--target", required=True, help="the target model (it decodes)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype of both")


def _fit(args: argparse.Namespace) -> int:
    from .data import documents, sequences, split, token_stream
    from .fit import fit_mapper

    data = Path(args.data) if args.data else _default_data()
    docs, digest = documents(data)
    parts = split(len(docs), args.every)
    source, tok = _load(args.source, args.dtype)
    target, _ = _load(args.target, args.dtype)
    fit_seqs = sequences(
        token_stream(tok, [docs[d] for d in parts["fit"]]), args.seq_len, args.tokens
    )
    held_stream = token_stream(tok, [docs[d] for d in parts["heldout"]])
    held_seqs = sequences(held_stream, min(args.seq_len, len(held_stream)), args.heldout_tokens)
    calibration = {
        "data": data.name,
        "data_sha256": digest,
        "every": args.every,
        "docs": {"fit": parts["fit"], "heldout": parts["heldout"]},
        "seq_len": args.seq_len,
        "source_path": args.source,
        "target_path": args.target,
    }
    t0 = time.perf_counter()
    mapper = fit_mapper(
        source,
        target,
        fit_seqs,
        held_seqs,
        layers_per_target=args.layers_per_target,
        lags=args.lags,
        alphas=args.alphas,
        rank=args.rank,
        rank_tol=args.rank_tol,
        weights_dtype=args.weights_dtype,
        calibration=calibration,
    )
    out = mapper.save(args.out)
    tokens = mapper.calibration["tokens"]
    print(
        f"mapper {args.source} -> {args.target}: fitted on {tokens['fit']} tokens, held out "
        f"{tokens['heldout']}, in {time.perf_counter() - t0:.1f} s -> {out} "
        f"({mapper.nbytes():,} bytes of {mapper.weights_dtype} weights)"
    )
    print("\n".join(mapper.describe()))
    return 0


def _apply(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from velox_core import generate

    from .apply import transfer_cache
    from .mapper import load_mapper

    if (args.prompt is None) == (args.prompt_file is None):
        raise SystemExit("give exactly one of --prompt and --prompt-file")
    text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    source, tok = _load(args.source, args.dtype)
    target, _ = _load(args.target, args.dtype)
    mapper = load_mapper(args.mapper, source=source, target=target)
    ids = tok.encode(text)
    if len(ids) < 2:
        raise SystemExit("the prompt must have at least two tokens")
    src = [KVCache() for _ in mapper.source.layers]
    source(mx.array([ids])[:, :-1], cache=src)
    mx.eval([c.keys for c in src], [c.values for c in src])
    t0 = time.perf_counter()
    caches = transfer_cache(src, mapper, args.cache, model=target)
    sec = time.perf_counter() - t0
    print(f"mapped {len(ids) - 1} tokens into the target's {args.cache} caches in {sec:.3f} s")
    out = generate(target, tok, ids[-1:], cache=caches, max_tokens=args.max_tokens)
    print(out)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .data import documents, split, token_stream
    from .evaluate import evaluate, format_table
    from .mapper import load_mapper

    data = Path(args.data) if args.data else _default_data()
    docs, digest = documents(data)
    source, tok = _load(args.source, args.dtype)
    target, _ = _load(args.target, args.dtype)
    mapper = load_mapper(args.mapper, source=source, target=target)
    cal = mapper.calibration
    every = int(cal.get("every", args.every))
    ids = split(len(docs), every)["eval"]
    if cal.get("data_sha256") == digest:
        used = set(cal["docs"]["fit"]) | set(cal["docs"]["heldout"])
        if used & set(ids):
            raise SystemExit(
                f"the mapper was calibrated on evaluation documents {sorted(used & set(ids))}"
            )
    else:
        print(f"note: {data.name} is not the mapper's calibration file; no overlap check")
        ids = list(range(len(docs)))
    stream = token_stream(tok, [docs[d] for d in ids])
    print(f"evaluating on {len(ids)} documents ({len(stream)} tokens) of {data.name}")
    rows = evaluate(
        source,
        target,
        mapper,
        stream,
        args.prefixes,
        continuation=args.continuation,
        samples=args.samples,
        tails=args.tails,
        cache=args.cache,
    )
    print(format_table(rows))
    print(f"\nmapper: {mapper.nbytes():,} bytes of {mapper.weights_dtype} weights")
    print("\nheld-out R² of the mapped keys and values (content space), per target layer:")
    print("\n".join(mapper.describe()))
    if args.json:
        payload = {
            "rows": [r.to_json() for r in rows],
            "layers": mapper.info,
            "groups": mapper.groups,
            "mapper_bytes": mapper.nbytes(),
            "cache": args.cache,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line (``velox transfer`` calls this); returns the exit status."""
    from .fit import ALPHAS, LAGS, RANK_TOL

    ap = argparse.ArgumentParser(prog="velox transfer", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit a mapper from the source's caches to the target's")
    _common(f)
    f.add_argument("--out", required=True, help="the mapper's directory")
    f.add_argument("--data", help="JSONL (or text) calibration data")
    f.add_argument("--every", type=int, default=5, help="1 document in EVERY is for eval")
    f.add_argument("--tokens", type=int, default=131072, help="fit tokens")
    f.add_argument("--heldout-tokens", type=int, default=16384, help="held-out tokens")
    f.add_argument("--seq-len", type=int, default=2048, help="calibration sequence length")
    f.add_argument(
        "--layers-per-target",
        type=int,
        default=None,
        help="most source layers per target layer, chosen greedily (default: all of them)",
    )
    f.add_argument(
        "--lags",
        type=_ints,
        default=LAGS,
        help="source positions back from each target position used as regressors",
    )
    f.add_argument("--alphas", type=_floats, default=ALPHAS, help="ridge strengths")
    f.add_argument(
        "--rank",
        type=int,
        default=None,
        help="rank of the factorised maps (default: the smallest within --rank-tol)",
    )
    f.add_argument(
        "--rank-tol",
        type=float,
        default=RANK_TOL,
        help="held-out error the factorisation may add, relative to the unfactorised maps'",
    )
    f.add_argument(
        "--weights-dtype",
        choices=("float16", "bfloat16", "float32"),
        default="float16",
        help="storage dtype of the mapper's weights (applying computes in float32)",
    )
    a = sub.add_parser("apply", help="map a prompt's source cache and decode with the target")
    _common(a)
    a.add_argument("--mapper", required=True)
    a.add_argument("--prompt")
    a.add_argument("--prompt-file")
    a.add_argument("--cache", default="fp16", help="fp16 or a velox method spec")
    a.add_argument("--max-tokens", type=int, default=32)
    e = sub.add_parser("eval", help="KL and top-1 against the target's own prefill")
    _common(e)
    e.add_argument("--mapper", required=True)
    e.add_argument("--data")
    e.add_argument("--every", type=int, default=5)
    e.add_argument("--prefixes", type=_ints, default=(256, 1024, 2048))
    e.add_argument("--continuation", type=int, default=32)
    e.add_argument("--samples", type=int, default=4)
    e.add_argument("--tails", type=_ints, default=(16, 64, 256))
    e.add_argument("--cache", default="fp16", help="fp16 or a velox method spec")
    e.add_argument("--json", help="write the rows and layer records here")
    args = ap.parse_args(argv)
    run = {"fit": _fit, "apply": _apply, "eval": _eval}[args.cmd]
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"velox transfer {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
