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
import sys
from pathlib import Path

from velox_core.artifacts_cli import ArtifactCommand, default_out


def _options(fit: argparse.ArgumentParser) -> None:
    fit.add_argument("--samples", type=int, default=3000, help="queries sampled for the SVD")
    fit.add_argument("--seed", type=int, default=0, help="seed of the query sample")


def _fit(args: argparse.Namespace, model, tokenizer, texts: list[str]) -> str:
    from .artifact import save_filters
    from .fit import fit_filters

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
    path = save_filters(filters, default_out("qfilters", filters.fingerprint, args.out))
    cal = filters.calibration
    return (
        f"Q-Filters for {args.model} ({len(filters.layers)} layers, fingerprint "
        f"{filters.fingerprint}) from {cal['tokens']} tokens, {cal['samples']} sampled queries "
        f"-> {path}"
    )


def _show(path: str) -> dict:
    from .artifact import load_filters

    f = load_filters(path)
    shapes = {i: list(a.shape) for i, a in sorted(f.layers.items())}
    return {
        "fingerprint": f.fingerprint,
        "model": f.model,
        "calibration": f.calibration,
        "layers": shapes,
    }


COMMAND = ArtifactCommand(
    "qfilters", "the Q-Filters", _options, _fit, _show, tokens=8192, doc=__doc__
)
parser, main, fit_main = COMMAND.parser, COMMAND.main, COMMAND.fit_main

if __name__ == "__main__":
    sys.exit(main())
