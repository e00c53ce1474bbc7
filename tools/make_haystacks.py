"""Make the long-context suite's haystacks (velox-cli's ``longctx/haystack/*.txt.gz``).

The suite hides its needles in text that ships with the project, so every machine (whatever
its Python) builds the same prompts from the same seed:

- ``prose.txt.gz``: the prose paragraphs of CPython's own documentation topics
  (``pydoc_data.topics``, PSF license), code samples and tables left out;
- ``code.txt.gz``: a fixed list of pure-Python standard-library modules, whole files.

    python3 tools/make_haystacks.py   # rewrites both files (run with CPython 3.11)
"""

from __future__ import annotations

import gzip
import re
import sys
import sysconfig
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / ("packages/velox-cli/src/velox_cli/longctx/haystack")
CODE_MODULES = (
    "argparse.py",
    "textwrap.py",
    "dataclasses.py",
    "fractions.py",
    "difflib.py",
    "configparser.py",
    "shlex.py",
    "string.py",
    "calendar.py",
    "heapq.py",
    "bisect.py",
    "statistics.py",
    "csv.py",
    "pprint.py",
    "gettext.py",
    "fnmatch.py",
    "glob.py",
    "shutil.py",
    "tempfile.py",
    "contextlib.py",
    "functools.py",
    "operator.py",
    "queue.py",
    "sched.py",
)


def _prose_paragraph(p: str) -> bool:
    lines = p.splitlines()
    if not lines or any(line.startswith((" ", "\t")) for line in lines):
        return False  # code samples, grammar rules and tables are indented
    text = " ".join(lines)
    letters = sum(ch.isalpha() or ch == " " for ch in text)
    return len(text) > 80 and letters / len(text) > 0.85 and text.rstrip().endswith(".")


def prose() -> str:
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for p in re.split(r"\n\s*\n", topics[name]):
            if _prose_paragraph(p):
                out.append(" ".join(line.strip() for line in p.splitlines()))
    return "\n\n".join(out) + "\n"


def code() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "".join((lib / m).read_text(encoding="utf-8") + "\n\n" for m in CODE_MODULES)


def main() -> int:
    if sys.version_info[:2] != (3, 11):
        print("warning: the shipped haystacks were made with CPython 3.11", file=sys.stderr)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in (("prose", prose()), ("code", code())):
        path = OUT / f"{name}.txt.gz"
        with gzip.GzipFile(path, "wb", mtime=0) as f:  # byte-identical on every run
            f.write(text.encode("utf-8"))
        print(f"{path}: {len(text):,} characters, {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
