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
import sys
from pathlib import Path

from velox_core.artifacts_cli import ArtifactCommand, default_out


def _options(fit: argparse.ArgumentParser) -> None:
    fit.add_argument("--samples", type=int, default=4096, help="tokens sampled per head")
    fit.add_argument("--pairs", type=int, default=4, help="RoPE pairs per code")
    fit.add_argument("--entries", type=int, default=16, help="entries per small codebook")
    fit.add_argument("--stages", type=int, default=2, help="residual stages (2: up to 2 bits)")
    fit.add_argument("--iters", type=int, default=16, help="EM iterations per stage")
    fit.add_argument("--seed", type=int, default=0, help="seed of the sample and initialization")


def _fit(args: argparse.Namespace, model, tokenizer, texts: list[str]) -> str:
    from .artifact import save_codebooks
    from .fit import fit_codebooks

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
    path = save_codebooks(books, default_out("commvq", books.fingerprint, args.out))
    g = books.geometry
    return (
        f"CommVQ codebooks for {args.model} ({len(books.layers)} layers, {g.stages} stages of "
        f"{g.entries}+{g.entries} entries per {g.pairs} pairs, fingerprint {books.fingerprint}) "
        f"from {books.calibration['tokens']} tokens -> {path}"
    )


def _show(path: str) -> dict:
    from .artifact import load_codebooks

    b = load_codebooks(path)
    g = b.geometry
    return {
        "fingerprint": b.fingerprint,
        "model": b.model,
        "geometry": {"pairs": g.pairs, "entries": g.entries, "stages": g.stages},
        "calibration": b.calibration,
        "layers": {i: list(a.shape) for i, (a, _) in sorted(b.layers.items())},
        "layouts": b.layouts,
    }


COMMAND = ArtifactCommand("commvq", "the CommVQ key codebooks", _options, _fit, _show, doc=__doc__)
parser, main, fit_main = COMMAND.parser, COMMAND.main, COMMAND.fit_main

if __name__ == "__main__":
    sys.exit(main())
