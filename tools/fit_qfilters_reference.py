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
import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "shared" / "reference-model"
OUT = ROOT / "shared" / "artifacts" / "qfilters-reference-model.safetensors"
EOT = "<|endoftext|>"


def held_out(rel: str) -> bool:
    """The corpus split rule (tools/reference_corpus.py)."""
    return hashlib.sha1(rel.encode()).digest()[0] < 10


def calibration_files(seed: int) -> list[tuple[str, str]]:
    """(path, text) of the train-split files present locally with the manifest's SHA-256."""
    manifest = json.loads((MODEL_DIR / "corpus.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train = [f for f in manifest["files"] if f["split"] == "train" and not held_out(f["path"])]
    order = np.random.default_rng(seed).permutation(len(train))
    out = []
    for i in order:
        f = train[i]
        p = stdlib / f["path"]
        if not p.is_file():
            continue
        text = p.read_bytes().decode("utf-8", errors="replace")
        if hashlib.sha256(text.encode()).hexdigest() == f["sha256"]:
            out.append((f["path"], text))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens")
    parser.add_argument("--per-file", type=int, default=512, help="tokens per file at most")
    parser.add_argument("--samples", type=int, default=3000, help="queries sampled per head")
    parser.add_argument("--seed", type=int, default=0, help="seed of the file order and sample")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    import mlx.core as mx
    import mlx_lm

    from velox_qfilters import fit_filters, save_filters

    mx.set_default_device(mx.cpu)
    model, tokenizer = mlx_lm.load(str(MODEL_DIR))
    model.set_dtype(mx.float32)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    used: list[str] = []
    for rel, text in calibration_files(args.seed):
        if len(ids) >= args.tokens:
            break
        ids.extend([*tokenizer.encode(text, add_special_tokens=False), eot][: args.per_file])
        used.append(rel)
    if len(ids) < args.tokens:
        raise SystemExit(f"only {len(ids)} calibration tokens found (need {args.tokens})")
    assert not any(held_out(p) for p in used)
    filters = fit_filters(
        model,
        np.asarray(ids[: args.tokens]),
        max_tokens=args.tokens,
        seq_len=2048,
        samples=args.samples,
        seed=args.seed,
        source="reference corpus, train split: " + ", ".join(used),
    )
    path = save_filters(filters, args.out)
    print(
        f"{len(filters.layers)} layers, fingerprint {filters.fingerprint}, "
        f"{filters.calibration['tokens']} tokens from {len(used)} train files -> {path}"
    )


if __name__ == "__main__":
    main()
