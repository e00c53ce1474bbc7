"""Write text of the reference corpus's TRAIN split as ``.jsonl.gz``, one ``{"text", "path"}``
line per file, for commands that take ``--data`` (``velox allocate`` calibrates on it while
``velox bench`` evaluates on the held-out split).

    python tools/reference_train_text.py OUT.jsonl.gz [--chars 400000] [--seed 0]

The files are those the reference model's artifacts are fitted on
(``tools/reference_calibration.py``: listed in ``shared/reference-model/corpus.json``, read
from the local Python standard library, checked against their SHA-256, never a held-out
file), whole, in the seeded order the fits use, until ``--chars`` characters are written.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from reference_calibration import calibration_files, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the .jsonl.gz file to write")
    parser.add_argument("--chars", type=int, default=400_000, help="characters at least")
    parser.add_argument("--seed", type=int, default=0, help="seed of the file order")
    args = parser.parse_args()
    if args.chars < 1:
        parser.error(f"--chars must be positive, got {args.chars}")
    done, files = 0, 0
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        for rel, text in calibration_files(args.seed):
            if done >= args.chars:
                break
            if held_out(rel):  # calibration_files never returns one; checked again here
                raise SystemExit(f"a held-out file was selected: {rel}")
            f.write(json.dumps({"text": text, "path": rel}) + "\n")
            done, files = done + len(text), files + 1
    if done < args.chars:
        raise SystemExit(f"only {done} characters of train files found (need {args.chars})")
    print(f"{files} train files, {done:,} characters -> {args.out}")


if __name__ == "__main__":
    main()
