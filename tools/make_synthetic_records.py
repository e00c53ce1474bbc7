"""Generate ``shared/data/synthetic-records.jsonl.gz``: text no pretrained model has seen.

    python tools/make_synthetic_records.py [--docs 4] [--records 420] [--seed 0] [--out FILE]

The held-out set ``shared/data/heldout.jsonl.gz`` is CPython standard-library code, which a
pretrained model such as SmolLM2 may well have memorised. This set is made here from a seeded
generator: each document is a ledger of shuffled records whose names, places and codes are
random syllable strings and random digits, with retrieval questions about earlier records of
the same document between them::

    #4127 | name: Ovrelan Quisdo | place: Brantevik | item: tarnel | qty: 38 | code: QX-4471-B
    ...
    Q: code of #4127? A: QX-4471-B

A question's answer was stated once, between 10 and 120 records earlier (about 54 tokens a
record in SmolLM2's tokenizer: 500 to 6,500 tokens back), so predicting it needs the cache to
keep that record. ``velox bench --data shared/data/synthetic-records.jsonl.gz`` evaluates on it (one
JSON line ``{"text": ...}`` per document, each followed by the EOS token). The output is
byte-for-byte reproducible (fixed seed, gzip mtime 0).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "shared" / "data" / "synthetic-records.jsonl.gz"

_ONSETS = ("b", "br", "d", "dr", "f", "g", "gl", "k", "kr", "l", "m", "n", "p", "qu", "r", "s")
_ONSETS += ("st", "t", "th", "tr", "v", "vr", "z", "")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou", "y")
_CODAS = ("", "", "n", "r", "l", "s", "th", "k", "m", "x", "nd", "rv", "sk")
_FIELDS = ("name", "place", "item", "qty", "code")


def word(rng: random.Random, syllables: int) -> str:
    """A pronounceable random string of ``syllables`` syllables, capitalised."""
    s = "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    )
    return s.capitalize()


def code(rng: random.Random) -> str:
    """A code like ``QX-4471-B``: two letters, four digits, one letter."""
    up = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    return f"{rng.choice(up)}{rng.choice(up)}-{rng.randint(1000, 9999)}-{rng.choice(up)}"


def record(rng: random.Random, ident: int) -> dict[str, str]:
    """One record's fields (``id`` a four-digit number unique within its document)."""
    return {
        "id": f"#{ident:04d}",
        "name": f"{word(rng, rng.randint(2, 3))} {word(rng, 2)}",
        "place": word(rng, rng.randint(2, 3)) + rng.choice(("port", "vik", "holm", "ford", "")),
        "item": word(rng, rng.randint(1, 2)).lower(),
        "qty": str(rng.randint(2, 999)),
        "code": code(rng),
    }


def document(rng: random.Random, records: int, lo: int = 10, hi: int = 120) -> str:
    """A ledger of ``records`` shuffled records with a question every 3 to 8 records, each
    about a record stated between ``lo`` and ``hi`` records earlier."""
    ids = rng.sample(range(1000, 10000), records)
    lines: list[str] = []
    seen: list[dict[str, str]] = []
    gap = rng.randint(3, 8)
    for ident in ids:
        r = record(rng, ident)
        seen.append(r)
        lines.append(" | ".join([r["id"], *(f"{k}: {r[k]}" for k in _FIELDS)]))
        gap -= 1
        if gap == 0 and len(seen) > lo:
            back = rng.randint(lo, min(hi, len(seen) - 1))
            old = seen[-1 - back]
            field = rng.choice(_FIELDS)
            lines.append(f"Q: {field} of {old['id']}? A: {old[field]}")
            gap = rng.randint(3, 8)
        elif gap == 0:
            gap = rng.randint(3, 8)
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=4, help="documents (ledgers)")
    p.add_argument("--records", type=int, default=420, help="records per document")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    if a.docs < 1 or a.records < 50:
        raise SystemExit("--docs must be >= 1 and --records >= 50")
    rng = random.Random(a.seed)
    docs = [document(rng, a.records) for _ in range(a.docs)]
    body = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
        f.write(body)
    print(
        f"{a.out}: {a.docs} documents, {len(body):,} bytes of text, "
        f"{a.out.stat().st_size:,} bytes gzipped"
    )


if __name__ == "__main__":
    main()
