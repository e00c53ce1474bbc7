"""Calibration and evaluation text: disjoint sets of documents of one JSONL file.

Documents are the lines of a JSON-lines file (``{"text": ...}``, gzipped or not), as
``velox bench`` reads ``shared/data/heldout.jsonl.gz``, or a plain text file as one document.
Document ``d`` (0-based, in file order) is for evaluation when ``d % every == every - 1``,
and for calibration otherwise; calibration documents are split again the same way into fit
and held-out documents. The split is recorded in the mapper's manifest, and ``eval`` refuses
a mapper calibrated on the documents it would evaluate on.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np

from velox_core.artifacts import token_stream

__all__ = ["documents", "sequences", "split", "token_stream"]


def documents(path: str | Path) -> tuple[list[str], str]:
    """The documents of ``path`` and the SHA-256 of its bytes (to match splits later)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"--data: no such file {str(path)!r}")
    raw = p.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if p.name.endswith((".jsonl", ".jsonl.gz")):
        text = gzip.decompress(raw).decode() if p.suffix == ".gz" else raw.decode()
        docs = [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
    else:
        docs = [raw.decode("utf-8", errors="replace")]
    return docs, digest


def split(n: int, every: int) -> dict[str, list[int]]:
    """Document indices for ``fit``, ``heldout`` (both calibration) and ``eval``."""
    if every < 2:
        raise ValueError(
            f"every must be at least 2 (one document in every is evaluation), got {every}"
        )
    ev = [d for d in range(n) if d % every == every - 1]
    cal = [d for d in range(n) if d % every != every - 1]
    held = [d for k, d in enumerate(cal) if k % every == every - 1]
    fit = [d for k, d in enumerate(cal) if k % every != every - 1]
    return {"fit": fit, "heldout": held, "eval": ev}


def sequences(stream: np.ndarray, seq_len: int, max_tokens: int) -> list[np.ndarray]:
    """Consecutive ``seq_len``-token pieces of ``stream``, up to ``max_tokens`` in all."""
    count = min(len(stream) // seq_len, max(1, max_tokens // seq_len))
    if count == 0:
        raise ValueError(f"the text has {len(stream)} tokens, fewer than seq_len={seq_len}")
    return [stream[i * seq_len : (i + 1) * seq_len] for i in range(count)]
