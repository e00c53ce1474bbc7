"""Fit the Palu artifact of the reference model.

    python tools/fit_palu_reference.py [--tokens 16384] [--out FILE]

Calibration text: files of the TRAIN split of the reference corpus (never the held-out
split), as for the Q-Filters and CommVQ artifacts (``tools/fit_qfilters_reference.py``: listed
in ``shared/reference-model/corpus.json``, read from the local Python standard library,
checked against their SHA-256, taken in a seeded order, each tokenized as in training and cut
to its first ``--per-file`` tokens) until ``--tokens`` tokens are gathered; they are cut into
sequences of 2,048 tokens. The model runs on the CPU in float32. Every layer's key and value
bases (one group of its 2 KV heads) come from the Gram matrices of all calibration tokens'
pre-RoPE keys and values; the Fisher information of its projections from the gradients of the
next-token loss over the same sequences.

Writes ``shared/artifacts/palu-reference-model.safetensors`` (float16 bases, about 1.6 MB),
which ``velox_palu`` finds when ``$VELOX_ARTIFACTS`` lists ``shared/artifacts`` (``velox
bench`` adds it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from reference_calibration import ARTIFACTS, calibration_ids, load_reference, source

OUT = ARTIFACTS / "palu-reference-model.safetensors"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="calibration tokens")
    parser.add_argument("--per-file", type=int, default=1024, help="tokens per file at most")
    parser.add_argument("--seed", type=int, default=0, help="seed of the file order")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    from velox_palu import fit_palu, save_bases

    model, tokenizer = load_reference()
    ids, used = calibration_ids(tokenizer, args.tokens, args.per_file, args.seed)
    art = fit_palu(
        model,
        ids,
        seq_len=2048,
        source=source(used),
    )
    path = save_bases(art, args.out)
    print(
        f"{len(art.layers)} layers, fingerprint {art.fingerprint}, "
        f"{art.calibration['tokens']} tokens from {len(used)} train files -> {path} "
        f"({path.stat().st_size / 1024:.0f} KB); Fisher {art.fisher}"
    )


if __name__ == "__main__":
    main()
