"""Calibration tokens for the reference model's per-model artifacts.

Files of the TRAIN split of the reference corpus (never the held-out split), listed in
``shared/reference-model/corpus.json`` and read from the local Python standard library; a
file whose SHA-256 differs from the manifest is skipped. Files are taken in a seeded order,
each tokenized as in training (no special tokens, followed by ``<|endoftext|>``) and cut to
its first ``per_file`` tokens (so the calibration spans several files), until ``tokens``
tokens are gathered. The model is loaded on the CPU in float32.

``tools/fit_reference.py METHOD`` fits a method's artifact on them.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "shared" / "reference-model"
ARTIFACTS = ROOT / "shared" / "artifacts"
EOT = "<|endoftext|>"
SEQ_LEN = 2048  # tokens per calibration sequence (the first training phase's length)


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


def load_reference():
    """The reference model and tokenizer, on the CPU in float32."""
    import mlx.core as mx
    import mlx_lm

    mx.set_default_device(mx.cpu)
    model, tokenizer = mlx_lm.load(str(MODEL_DIR))
    model.set_dtype(mx.float32)
    return model, tokenizer


def calibration_ids(tokenizer, tokens: int, per_file: int, seed: int) -> tuple[np.ndarray, list]:
    """``tokens`` calibration token ids and the files they came from (``SystemExit`` if the
    local library holds too few, or if a held-out file were selected)."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    used: list[str] = []
    for rel, text in calibration_files(seed):
        if len(ids) >= tokens:
            break
        ids.extend([*tokenizer.encode(text, add_special_tokens=False), eot][:per_file])
        used.append(rel)
    if len(ids) < tokens:
        raise SystemExit(f"only {len(ids)} calibration tokens found (need {tokens})")
    if any(held_out(p) for p in used):
        raise SystemExit("a held-out file was selected for calibration")
    return np.asarray(ids[:tokens]), used


def source(used: list[str]) -> str:
    return "reference corpus, train split: " + ", ".join(used)
