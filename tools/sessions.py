"""Run nox's default sessions (lint, one ``tests`` session per package, integration, build)
with the package sessions side by side: the repository's test command.

    python3 -m pip install -q nox uv && python3 tools/sessions.py [--jobs N] [--only SUBSTR]

The package sessions are many short ones, each mostly one process (installing, importing MLX,
compiling the kernel emulator's programs with one ``g++`` at a time), so ``--jobs`` of them
(default: the machine's cores, at least 2) run at once; lint runs first, integration and build
after them, each alone (integration spreads its tests over the cores itself). Each session's
output goes to ``.nox/logs/<session>.log``; a failed session's log tail is printed. Exits 1 if
any session failed, after all have run. Equivalent to ``python3 -m nox`` (which runs the same
sessions one at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / ".nox" / "logs"


def default_sessions() -> list[str]:
    """The sessions ``nox`` runs with no arguments, in its order."""
    out = subprocess.run(
        [sys.executable, "-m", "nox", "-l", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [s["session"] for s in json.loads(out)]


def run_session(name: str) -> tuple[str, int, float]:
    """Run one session, its output into its log; returns (name, exit code, seconds)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") + ".log")
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, "-m", "nox", "-s", name],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            check=False,
        ).returncode
    took = time.monotonic() - t0
    print(f"{'ok  ' if rc == 0 else 'FAIL'} {took:7.0f} s  {name}", flush=True)
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        print("\n".join(f"    | {line}" for line in tail), flush=True)
    return name, rc, took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=max(2, os.cpu_count() or 2))
    p.add_argument("--only", default=None, help="run the sessions whose name holds this")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    names = default_sessions()
    if args.only:
        names = [n for n in names if args.only in n]
        if not names:
            p.error(f"no default session's name holds {args.only!r}")
    side = [n for n in names if n.startswith("tests(")]
    first = [n for n in names if n == "lint"]
    last = [n for n in names if n not in side and n not in first]
    t0 = time.monotonic()
    results = [run_session(n) for n in first]
    # the longest sessions first (the emulator's), so the short ones fill in beside them
    slow = ("velox-qjl", "velox-core", "velox-rabitq", "velox-cli", "velox-commvq")
    side.sort(key=lambda n: not any(f"'{s}'" in n for s in slow))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results += list(pool.map(run_session, side))
    results += [run_session(n) for n in last]
    failed = [n for n, rc, _ in results if rc != 0]
    wall = time.monotonic() - t0
    print(f"{len(results) - len(failed)} of {len(results)} sessions passed in {wall:.0f} s")
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
