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
import sys
from pathlib import Path

from velox_core.artifacts_cli import ArtifactCommand, default_out


def _options(fit: argparse.ArgumentParser) -> None:
    fit.add_argument(
        "--heads-per-group", type=int, default=None, help="KV heads per group (default 4)"
    )
    fit.add_argument(
        "--no-fisher", action="store_true", help="skip the Fisher information (uniform ranks)"
    )


def _fit(args: argparse.Namespace, model, tokenizer, texts: list[str]) -> str:
    import numpy as np

    from .artifact import save_bases
    from .fit import fit_palu

    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for text in texts:  # each file followed by the EOS token
        ids.extend(tokenizer.encode(text))
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
    path = save_bases(art, default_out("palu", art.fingerprint, args.out))
    return (
        f"Palu bases for {args.model} ({len(art.layers)} layers, {art.heads_per_group} KV heads "
        f"per group, fingerprint {art.fingerprint}) from {art.calibration['tokens']} tokens "
        f"-> {path}"
    )


def _show(path: str) -> dict:
    from .artifact import load_bases

    b = load_bases(path)
    return {
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


COMMAND = ArtifactCommand("palu", "the Palu bases", _options, _fit, _show, doc=__doc__)
parser, main, fit_main = COMMAND.parser, COMMAND.main, COMMAND.fit_main

if __name__ == "__main__":
    sys.exit(main())
