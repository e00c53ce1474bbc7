"""The reference model's corpus: the .py files of the CPython 3.11 standard library.

    python tools/reference_corpus.py build [--stdlib DIR] [--out out/corpus]

Builds, deterministically:

* the file list: every ``*.py`` under the standard library directory except ``site-packages``,
  ``_sysconfigdata*`` (machine specific), files over 1 MB (generated tables) and files that
  are not valid UTF-8; sorted by relative path;
* the split: a file is held out when the first byte of SHA-1(relative path) is below 10
  (about 4% of files), so the split never depends on the file order or count;
* a byte-level BPE tokenizer (8,192 tokens) trained on the training split, written in
  mlx-lm's format (``tokenizer.json``, ``tokenizer_config.json``, ...);
* the token streams (uint16) of both splits, each file followed by ``<|endoftext|>``.

The manifest (``shared/reference-model/corpus.json``) lists every file with its SHA-256 and
split; ``build`` refuses a standard library that differs from it, so the corpus is the same
wherever it is built (the GPU machine runs another Python: carry the tokens there). The held-out
text itself ships in ``shared/data/heldout.jsonl.gz`` for evaluation on any machine.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "shared" / "reference-model"
MANIFEST = MODEL_DIR / "corpus.json"
HELDOUT = ROOT / "shared" / "data" / "heldout.jsonl.gz"
VOCAB = 8192
EOT = "<|endoftext|>"
MAX_BYTES = 1_000_000


def stdlib_files(stdlib: Path) -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's Python files, sorted."""
    out = []
    for p in sorted(stdlib.rglob("*.py")):
        rel = p.relative_to(stdlib).as_posix()
        if rel.startswith("site-packages/") or Path(rel).name.startswith("_sysconfigdata"):
            continue
        raw = p.read_bytes()
        if len(raw) > MAX_BYTES:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append((rel, text))
    return out


def held_out(rel: str) -> bool:
    return hashlib.sha1(rel.encode()).digest()[0] < 10


def manifest(files: list[tuple[str, str]], version: str) -> dict:
    return {
        "python": version,
        "rule": (
            "stdlib *.py, no site-packages/_sysconfigdata*/>1MB/non-UTF-8; "
            "held out if sha1(path)[0] < 10"
        ),
        "files": [
            {
                "path": rel,
                "sha256": hashlib.sha256(text.encode()).hexdigest(),
                "split": "heldout" if held_out(rel) else "train",
            }
            for rel, text in files
        ],
    }


def train_tokenizer(texts: list[str], out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOT],
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOT, bos_token=EOT, unk_token=EOT, model_max_length=65536
    )
    fast.save_pretrained(str(out_dir))


def encode(tok, texts: list[str]) -> np.ndarray:
    eot = tok.convert_tokens_to_ids(EOT)
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    out = []
    for seq in ids:
        out.extend(seq)
        out.append(eot)
    return np.asarray(out, dtype=np.uint16)


def build(stdlib: Path, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    files = stdlib_files(stdlib)
    version = ".".join(map(str, sys.version_info[:3]))
    man = manifest(files, version)
    if MANIFEST.exists():
        want = json.loads(MANIFEST.read_text())
        if want["files"] != man["files"]:
            have = {f["path"]: f["sha256"] for f in man["files"]}
            need = {f["path"]: f["sha256"] for f in want["files"]}
            diff = sorted(p for p in need.keys() | have.keys() if need.get(p) != have.get(p))
            raise SystemExit(
                f"{stdlib} differs from the manifest in {len(diff)} files (e.g. {diff[:3]}); "
                f"use the Python {want['python']} standard library (--stdlib)"
            )
    else:
        MODEL_DIR.mkdir(parents=True, exist_ok=True)
        MANIFEST.write_text(json.dumps(man, indent=1) + "\n")
    train = [t for r, t in files if not held_out(r)]
    test = [(r, t) for r, t in files if held_out(r)]
    if not (MODEL_DIR / "tokenizer.json").exists():
        train_tokenizer(train, MODEL_DIR)
    tok = PreTrainedTokenizerFast.from_pretrained(str(MODEL_DIR))
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "train.npy", encode(tok, train))
    np.save(out / "heldout.npy", encode(tok, [t for _, t in test]))
    HELDOUT.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(HELDOUT, "wb", mtime=0) as f:
        for rel, text in test:
            f.write((json.dumps({"path": rel, "text": text}) + "\n").encode())
    n_train, n_test = np.load(out / "train.npy").size, np.load(out / "heldout.npy").size
    print(
        f"{len(files)} files: {len(train)} train ({n_train:,} tokens), "
        f"{len(test)} held out ({n_test:,} tokens) -> {out}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="file list, split, tokenizer and token streams")
    b.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    b.add_argument("--out", type=Path, default=ROOT / "out" / "corpus")
    args = ap.parse_args(argv)
    build(args.stdlib, args.out)


if __name__ == "__main__":
    main()
