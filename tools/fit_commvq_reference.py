"""Fit the CommVQ artifact of the reference model.

    python tools/fit_commvq_reference.py [--tokens 16384] [--samples 4096] [--iters 16] [--out FILE]

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split), as for the Q-Filters artifact (``tools/fit_qfilters_reference.py``: listed in
``shared/reference-model/corpus.json``, read from the local Python standard library, checked
against their SHA-256, taken in a seeded order, each tokenized as in training and cut to its
first ``--per-file`` tokens) until ``--tokens`` tokens are gathered; they are cut into
sequences of 2,048 tokens. The model runs on the CPU in float32. Each KV head's codebooks are
fitted by EM on ``--samples`` of its tokens: 2 residual stages of 16+16 entries per 4 RoPE
pairs (1 bit per coordinate each), so 1-bit caches use the first stage and 2-bit caches both.

Writes ``shared/artifacts/commvq-reference-model.safetensors`` (float16 codebooks, about
200 KB), which ``velox_commvq`` finds when ``$VELOX_ARTIFACTS`` lists ``shared/artifacts``
(``velox bench`` adds it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reference_calibration import ARTIFACTS, calibration_ids, load_reference, source

OUT = ARTIFACTS / "commvq-reference-model.safetensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="calibration tokens")
    parser.add_argument("--per-file", type=int, default=1024, help="tokens per file at most")
    parser.add_argument("--samples", type=int, default=4096, help="tokens sampled per head")
    parser.add_argument("--iters", type=int, default=16, help="EM iterations per stage")
    parser.add_argument("--seed", type=int, default=0, help="seed of the file order and fit")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    from velox_commvq import fit_codebooks, save_codebooks

    model, tokenizer = load_reference()
    ids, used = calibration_ids(tokenizer, args.tokens, args.per_file, args.seed)
    books = fit_codebooks(
        model,
        ids,
        max_tokens=args.tokens,
        seq_len=2048,
        samples=args.samples,
        iters=args.iters,
        seed=args.seed,
        source=source(used),
    )
    path = save_codebooks(books, args.out)
    print(
        f"{len(books.layers)} layers, fingerprint {books.fingerprint}, "
        f"{books.calibration['tokens']} tokens from {len(used)} train files -> {path} "
        f"({path.stat().st_size / 1024:.0f} KB)"
    )


if __name__ == "__main__":
    main()
