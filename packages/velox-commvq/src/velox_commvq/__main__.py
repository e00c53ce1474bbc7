"""``python -m velox_commvq``: fit a model's CommVQ codebooks, or show an artifact.

    python -m velox_commvq fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 16384] [--seq-len 2048] [--samples 4096] [--pairs 4] [--entries 16]
        [--stages 2] [--iters 16] [--seed 0] [--dtype float32]
    python -m velox_commvq show FILE

``fit`` loads the model with ``mlx_lm.load``, tokenizes the text files with the model's own
tokenizer (each file followed by the EOS token) and writes the artifact to ``--out``
(default: ``~/.cache/velox/commvq-<fingerprint>.safetensors``, where caches find it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DTYPES = ("auto", "float32", "float16", "bfloat16")


def _fit(args: argparse.Namespace) -> int:
    import mlx.core as mx
    import mlx_lm

    from .artifact import save_codebooks
    from .fit import fit_codebooks

    texts = []
    for name in args.text:
        p = Path(name)
        if not p.is_file():
            raise SystemExit(f"--text {name}: no such file")
        texts.append(p.read_text(encoding="utf-8", errors="replace"))
    model, tokenizer = mlx_lm.load(args.model)
    if args.dtype != "auto":
        model.set_dtype(getattr(mx, args.dtype))
    books = fit_codebooks(
        model,
        tokenizer,
        texts,
        max_tokens=args.tokens,
        seq_len=args.seq_len,
        samples=args.samples,
        pairs=args.pairs,
        entries=args.entries,
        stages=args.stages,
        iters=args.iters,
        seed=args.seed,
        source=", ".join(Path(t).name for t in args.text),
    )
    out = args.out or Path("~/.cache/velox") / f"commvq-{books.fingerprint}.safetensors"
    path = save_codebooks(books, out)
    g = books.geometry
    print(
        f"CommVQ codebooks for {args.model} ({len(books.layers)} layers, {g.stages} stages of "
        f"{g.entries}+{g.entries} entries per {g.pairs} pairs, fingerprint {books.fingerprint}) "
        f"from {books.calibration['tokens']} tokens -> {path}"
    )
    return 0


def _show(args: argparse.Namespace) -> int:
    from .artifact import load_codebooks

    b = load_codebooks(args.file)
    g = b.geometry
    info = {
        "fingerprint": b.fingerprint,
        "model": b.model,
        "geometry": {"pairs": g.pairs, "entries": g.entries, "stages": g.stages},
        "calibration": b.calibration,
        "layers": {i: list(a.shape) for i, (a, _) in sorted(b.layers.items())},
        "layouts": b.layouts,
    }
    print(json.dumps(info, indent=1))
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line, for ``python -m velox_commvq`` (and a ``velox fit commvq``)."""
    p = argparse.ArgumentParser(prog="python -m velox_commvq", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit the CommVQ key codebooks of a model on calibration text")
    fit.add_argument("--model", required=True, help="mlx-lm model path or repository")
    fit.add_argument("--text", required=True, nargs="+", help="calibration text file(s)")
    fit.add_argument("--out", help="artifact to write (.safetensors)")
    fit.add_argument("--tokens", type=int, default=16384, help="calibration tokens at most")
    fit.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence")
    fit.add_argument("--samples", type=int, default=4096, help="tokens sampled per head")
    fit.add_argument("--pairs", type=int, default=4, help="RoPE pairs per code")
    fit.add_argument("--entries", type=int, default=16, help="entries per small codebook")
    fit.add_argument("--stages", type=int, default=2, help="residual stages (2: up to 2 bits)")
    fit.add_argument("--iters", type=int, default=16, help="EM iterations per stage")
    fit.add_argument("--seed", type=int, default=0, help="seed of the sample and initialization")
    fit.add_argument("--dtype", choices=DTYPES, default="auto", help="run the model in this dtype")
    fit.set_defaults(run=_fit)
    show = sub.add_parser("show", help="print what an artifact holds")
    show.add_argument("file")
    show.set_defaults(run=_show)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def fit_main(argv: list[str] | None = None) -> int:
    """``fit`` alone: what a ``velox fit commvq ARGS`` would run (``python -m velox_commvq fit
    ARGS``)."""
    return main(["fit", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
