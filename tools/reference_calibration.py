"""Calibration tokens for the reference model's per-model artifacts (Q-Filters, CommVQ, Palu).

Files of the TRAIN split of the reference corpus (never the held-out split), listed in
``shared/reference-model/corpus.json`` and read from the local Python standard library; a
file whose SHA-256 differs from the manifest is skipped. Files are taken in a seeded order,
each tokenized as in training (no special tokens, followed by ``<|endoftext|>``) and cut to
its first ``per_file`` tokens (so the calibration spans several files), until ``tokens``
tokens are gathered. The model is loaded on the CPU in float32.

:func:`fit_reference` is the whole command line of ``tools/fit_<method>_reference.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from velox_core.artifacts_cli import Option

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


def fit_reference(
    doc: str,
    method: str,
    fit: Callable[..., Any],
    save: Callable[[Any, Path], Path],
    *,
    tokens: int,
    per_file: int,
    options: tuple[Option, ...] = (),
    seeded: bool = False,
    note: Callable[[Any], str] = lambda _: "",
) -> None:
    """Fit and write one method's artifact of the reference model.

    Parses ``--tokens``, ``--per-file``, ``--seed``, ``--out`` (default
    ``shared/artifacts/<method>-reference-model.safetensors``) and the method's own
    ``options``; runs ``fit(model, ids, max_tokens=, seq_len=, source=, **options)`` on the
    calibration tokens (``seq_len`` :data:`SEQ_LEN`; ``seed=`` too where ``seeded``), writes
    the artifact with ``save`` and prints one line (``note(artifact)`` appended).
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=tokens, help="calibration tokens")
    parser.add_argument("--per-file", type=int, default=per_file, help="tokens per file at most")
    parser.add_argument("--seed", type=int, default=0, help="seed of the file order (and fit)")
    out = ARTIFACTS / f"{method}-reference-model.safetensors"
    parser.add_argument("--out", type=Path, default=out)
    for option in options:
        option.add(parser)
    args = parser.parse_args()
    model, tokenizer = load_reference()
    ids, used = calibration_ids(tokenizer, args.tokens, args.per_file, args.seed)
    own = {o.name: getattr(args, o.name) for o in options} | ({"seed": args.seed} if seeded else {})
    art = fit(model, ids, max_tokens=args.tokens, seq_len=SEQ_LEN, source=source(used), **own)
    path = save(art, args.out)
    print(
        f"{len(art.layers)} layers, fingerprint {art.fingerprint}, "
        f"{art.calibration['tokens']} tokens from {len(used)} train files -> {path} "
        f"({path.stat().st_size / 1024:.0f} KB){note(art)}"
    )
