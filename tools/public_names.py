"""Count the names in velox-core's ``__all__`` lists: its public face.

    python tools/public_names.py            # per-module counts, largest first, then the total
    python tools/public_names.py --max 200  # exit 1 if the total is over 200

Every module under ``packages/velox-core/src`` is imported and its ``__all__`` read as Python
sees it, so a list built at import time (``[*a, *b]``) counts with its real length. A module
without ``__all__`` counts 0; one with an empty list says that nothing in it is public.
A name should have one home: :func:`second_homes` lists names that several modules export
(the same object under the same name), which the counts would otherwise count twice.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "packages" / "velox-core" / "src"


def modules(src: Path = SRC) -> list[str]:
    """The dotted names of every module under ``src``, packages by their ``__init__``."""
    out = []
    for f in sorted(src.rglob("*.py")):
        parts = f.relative_to(src).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def public_names(src: Path = SRC) -> dict[str, list[str]]:
    """``{module: its __all__}`` for every module under ``src`` that defines ``__all__``."""
    out = {}
    for name in modules(src):
        listed = vars(importlib.import_module(name)).get("__all__")
        if listed is not None:
            out[name] = list(listed)
    return out


def second_homes(names: dict[str, list[str]]) -> dict[str, list[str]]:
    """``{name: modules}`` for each name that two or more modules export as the same object."""
    homes: dict[tuple[str, int], list[str]] = {}
    for module, listed in names.items():
        mod = importlib.import_module(module)
        for n in listed:
            homes.setdefault((n, id(getattr(mod, n))), []).append(module)
    return {n: ms for (n, _), ms in sorted(homes.items()) if len(ms) > 1}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max", type=int, default=None, help="fail above this many names")
    args = ap.parse_args(argv)
    names = public_names()
    total = sum(len(v) for v in names.values())
    for module, listed in sorted(names.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"{len(listed):4d}  {module}")
    print(f"{total:4d}  total in {len(names)} modules")
    for n, ms in second_homes(names).items():
        print(f"  {n} is exported by {', '.join(ms)}")
    if args.max is not None and total > args.max:
        print(f"over the limit: {total} > {args.max}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
