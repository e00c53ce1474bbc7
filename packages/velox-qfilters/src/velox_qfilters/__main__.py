"""``python -m velox_qfilters``: fit a model's Q-Filters, or show an artifact.

    python -m velox_qfilters fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 8192] [--seq-len 2048] [--samples 3000] [--seed 0] [--dtype float32]
    python -m velox_qfilters show FILE

``fit`` loads the model with ``mlx_lm.load``, tokenizes the text files with the model's own
tokenizer (each file followed by the EOS token) and writes the artifact to ``--out``
(default: ``~/.cache/velox/qfilters-<fingerprint>.safetensors``, where caches find it).
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

    from .artifact import save_filters
    from .fit import fit_filters

    texts = []
    for name in args.text:
        p = Path(name)
        if not p.is_file():
            raise SystemExit(f"--text {name}: no such file")
        texts.append(p.read_text(encoding="utf-8", errors="replace"))
    model, tokenizer = mlx_lm.load(args.model)
    if args.dtype != "auto":
        model.set_dtype(getattr(mx, args.dtype))
    filters = fit_filters(
        model,
        tokenizer,
        texts,
        max_tokens=args.tokens,
        seq_len=args.seq_len,
        samples=args.samples,
        seed=args.seed,
        source=", ".join(Path(t).name for t in args.text),
    )
    out = args.out or Path("~/.cache/velox") / f"qfilters-{filters.fingerprint}.safetensors"
    path = save_filters(filters, out)
    cal = filters.calibration
    print(
        f"Q-Filters for {args.model} ({len(filters.layers)} layers, fingerprint "
        f"{filters.fingerprint}) from {cal['tokens']} tokens, {cal['samples']} sampled queries "
        f"-> {path}"
    )
    return 0


def _show(args: argparse.Namespace) -> int:
    from .artifact import load_filters

    f = load_filters(args.file)
    shapes = {i: list(a.shape) for i, a in sorted(f.layers.items())}
    info = {"fingerprint": f.fingerprint, "model": f.model, "calibration": f.calibration}
    print(json.dumps({**info, "layers": shapes}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m velox_qfilters", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit the Q-Filters of a model on calibration text")
    fit.add_argument("--model", required=True, help="mlx-lm model path or repository")
    fit.add_argument("--text", required=True, nargs="+", help="calibration text file(s)")
    fit.add_argument("--out", help="artifact to write (.safetensors)")
    fit.add_argument("--tokens", type=int, default=8192, help="calibration tokens at most")
    fit.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence")
    fit.add_argument("--samples", type=int, default=3000, help="queries sampled for the SVD")
    fit.add_argument("--seed", type=int, default=0, help="seed of the query sample")
    fit.add_argument("--dtype", choices=DTYPES, default="auto", help="run the model in this dtype")
    fit.set_defaults(run=_fit)
    show = sub.add_parser("show", help="print what an artifact holds")
    show.add_argument("file")
    show.set_defaults(run=_show)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def fit_main(argv: list[str] | None = None) -> int:
    """``velox fit qfilters ARGS``: ``python -m velox_qfilters fit ARGS``."""
    return main(["fit", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
