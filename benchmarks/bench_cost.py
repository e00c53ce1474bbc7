"""What ``velox bench`` costs on a model: CPU seconds per spec, and the wall time it takes.

    python benchmarks/bench_cost.py [--model M] [--all | --methods SPEC ...] [--cores 2]
                                    [--json OUT]

Runs ``velox_cli.bench.run_bench`` in this process, one spec after another (``jobs=1``), at
``velox bench``'s default settings (2,048 tokens, one sample of 32 decode steps, three recall
prompts), and reads this process's CPU time (user + system) as each spec finishes: the fp16
reference run, then each spec's row. CPU seconds depend little on what else runs on the
machine, where wall time does. The estimate of ``velox bench``'s wall time on ``--cores``
idle cores: the reference run, then the specs shared by one worker process per core (each
worker loading the model once), the slowest spec a lower bound:
``reference + max(sum(specs) / cores, max(spec)) + cores x load``.

Default specs: ``velox bench``'s quick subset; ``--all`` the full grid.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

from _common import write_json


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    from velox_cli.bench import BenchSettings, run_bench
    from velox_cli.specs import default_specs, parse, quick_specs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="as velox bench takes it (default: the reference model)")
    p.add_argument("--all", action="store_true", help="the full grid (default: quick subset)")
    p.add_argument("--methods", nargs="+", metavar="SPEC", help="these specs instead")
    p.add_argument("--cores", type=int, default=2, help="cores of the estimate (default 2)")
    p.add_argument("--json", help="write the per-spec seconds and the estimate here")
    a = p.parse_args(argv)
    specs = (
        [parse(t) for t in a.methods]
        if a.methods
        else (default_specs() if a.all else quick_specs())
    )
    t0, w0 = cpu_seconds(), time.time()
    texts = {x.text for x in specs}
    marks: dict[str, float] = {}  # "load": the model loaded; SPEC: its row's CPU seconds
    last = [0.0]

    def tick(desc: str, n: int = 1) -> None:
        now = cpu_seconds() - t0
        if desc == "fp16 reference":
            marks["load"] = now
        elif n == 0 and desc in texts:
            marks.setdefault("reference", now - marks["load"])
        elif n == 1:
            marks[desc.rsplit(" (", 1)[0]] = now - last[0]
        last[0] = now
        if n:
            print(f"{now:8.1f} CPU-s {time.time() - w0:8.1f} s  {desc}", flush=True)

    rows, info = run_bench(specs, a.model, None, BenchSettings(jobs=1), tick)
    load, reference = marks["load"], marks["reference"]
    per_spec = {r.spec: marks[r.spec] for r in rows}
    total = cpu_seconds() - t0
    spread = max(sum(per_spec.values()) / a.cores, max(per_spec.values()))
    wall = reference + spread + a.cores * load
    out = {
        "model": info["model"],
        "specs": len(specs),
        "skipped": info.get("skipped", []),
        "load_cpu_s": load,
        "reference_cpu_s": reference,
        "spec_cpu_s": per_spec,
        "total_cpu_s": total,
        "cores": a.cores,
        "estimated_wall_s": wall,
        "measured_wall_s": time.time() - w0,
    }
    slow = sorted(per_spec.items(), key=lambda kv: -kv[1])[:5]
    print(
        f"{len(specs)} specs on {Path(info['model']).name}: {total / 60:.1f} CPU-minutes in all "
        f"(model load {load:.0f} s, fp16 reference {reference:.0f} s, specs "
        f"{sum(per_spec.values()) / 60:.1f} min; slowest "
        + ", ".join(f"{k} {v:.0f} s" for k, v in slow)
        + f"); velox bench on {a.cores} idle cores: about {wall / 60:.1f} minutes"
    )
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
