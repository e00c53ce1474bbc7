"""``python -m velox_palu``: fit a model's Palu bases, or show an artifact.

    python -m velox_palu fit --model PATH --text FILE [FILE ...] [--out FILE]
        [--tokens 16384] [--seq-len 2048] [--heads-per-group G] [--no-fisher]
        [--dtype float32]
    python -m velox_palu show FILE

``fit`` loads the model with ``mlx_lm.load``, tokenizes the text files with the model's own
tokenizer (each file followed by the EOS token) and writes the artifact to ``--out``
(default: ``~/.cache/velox/palu-<fingerprint>.safetensors``, where caches find it).
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
    import numpy as np

    from .artifact import save_bases
    from .fit import fit_palu

    model, tokenizer = mlx_lm.load(args.model)
    if args.dtype != "auto":
        model.set_dtype(getattr(mx, args.dtype))
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for name in args.text:
        p = Path(name)
        if not p.is_file():
            raise SystemExit(f"--text {name}: no such file")
        ids.extend(tokenizer.encode(p.read_text(encoding="utf-8", errors="replace")))
        ids.extend([] if eos is None else [int(eos)])
    if len(ids) < 2:
        raise SystemExit("the calibration text holds fewer than 2 tokens")
    art = fit_palu(
        model,
        np.asarray(ids[: args.tokens], dtype=np.int64),
        heads_per_group=args.heads_per_group,
        seq_len=args.seq_len,
        fisher=not args.no_fisher,
        source=", ".join(Path(t).name for t in args.text),
    )
    out = args.out or Path("~/.cache/velox") / f"palu-{art.fingerprint}.safetensors"
    path = save_bases(art, out)
    print(
        f"Palu bases for {args.model} ({len(art.layers)} layers, {art.heads_per_group} KV heads "
        f"per group, fingerprint {art.fingerprint}) from {art.calibration['tokens']} tokens "
        f"-> {path}"
    )
    return 0


def _show(args: argparse.Namespace) -> int:
    from .artifact import load_bases

    b = load_bases(args.file)
    info = {
        "fingerprint": b.fingerprint,
        "model": b.model,
        "heads_per_group": b.heads_per_group,
        "calibration": b.calibration,
        "layers": {
            i: {s: list(b.bases[(i, s)][0].shape) for s in ("key", "value")} for i in b.layers
        },
        "fisher": b.fisher,
        "layouts": b.layouts,
    }
    print(json.dumps(info, indent=1))
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line, for ``python -m velox_palu`` (and ``velox fit palu``)."""
    p = argparse.ArgumentParser(prog="python -m velox_palu", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit the Palu bases of a model on calibration text")
    fit.add_argument("--model", required=True, help="mlx-lm model path or repository")
    fit.add_argument("--text", required=True, nargs="+", help="calibration text file(s)")
    fit.add_argument("--out", help="artifact to write (.safetensors)")
    fit.add_argument("--tokens", type=int, default=16384, help="calibration tokens at most")
    fit.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence")
    fit.add_argument(
        "--heads-per-group", type=int, default=None, help="KV heads per group (default 4)"
    )
    fit.add_argument(
        "--no-fisher", action="store_true", help="skip the Fisher information (uniform ranks)"
    )
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
    """``fit`` alone: what ``velox fit palu ARGS`` runs (``python -m velox_palu fit ARGS``)."""
    return main(["fit", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
