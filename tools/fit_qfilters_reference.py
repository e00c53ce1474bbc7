"""Fit the Q-Filters artifact of the reference model.

    python tools/fit_qfilters_reference.py [--tokens 4096] [--out FILE]

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split), listed in ``shared/reference-model/corpus.json`` and read from the local Python
standard library; a file whose SHA-256 differs from the manifest is skipped. Files are taken
in a seeded order, each tokenized as in training (no special tokens, followed by
``<|endoftext|>``) and cut to its first ``--per-file`` tokens (so the calibration spans
several files), until ``--tokens`` tokens are gathered; they are cut into sequences of
2,048 tokens (the first training phase's length). The model runs on the CPU in float32.

Writes ``shared/artifacts/qfilters-reference-model.safetensors`` (one (2, 128) float32 array
per layer, a few KB), which ``velox_qfilters`` finds when ``$VELOX_ARTIFACTS`` lists
``shared/artifacts``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reference_calibration import ARTIFACTS, calibration_ids, load_reference, source

OUT = ARTIFACTS / "qfilters-reference-model.safetensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens")
    parser.add_argument("--per-file", type=int, default=512, help="tokens per file at most")
    parser.add_argument("--samples", type=int, default=3000, help="queries sampled per head")
    parser.add_argument("--seed", type=int, default=0, help="seed of the file order and sample")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    from velox_qfilters import fit_filters, save_filters

    model, tokenizer = load_reference()
    ids, used = calibration_ids(tokenizer, args.tokens, args.per_file, args.seed)
    filters = fit_filters(
        model,
        ids,
        max_tokens=args.tokens,
        seq_len=2048,
        samples=args.samples,
        seed=args.seed,
        source=source(used),
    )
    path = save_filters(filters, args.out)
    print(
        f"{len(filters.layers)} layers, fingerprint {filters.fingerprint}, "
        f"{filters.calibration['tokens']} tokens from {len(used)} train files -> {path}"
    )


if __name__ == "__main__":
    main()
