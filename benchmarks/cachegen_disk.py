"""A saved cache on disk: CacheGen against KVTC and velox's ``save_cache`` (issue 51).

    python benchmarks/cachegen_disk.py [--tokens 8192] [--prompts 2] [--steps 32]
        [--levels 2 2.75 4] [--ratios 20] [--specs uniform:bits=4] [--json PATH]

For each prompt (``--tokens`` tokens of the held-out text at evenly spaced offsets, as
``benchmarks/kvtc_disk.py`` cuts them) the reference model (on a CPU: float32 compute, float16
caches) prefills an mlx-lm ``KVCache``. That cache is written by ``velox_core.save_cache``
(the fp16 file) and by ``velox_cachegen.save``: at each ``--level`` (its default settings and
the reference model's measured layer steps from ``shared/artifacts``); at the default level
with the window coded at the body's step (``window_step=1``) and with every channel coded as
anchor + delta (``delta="anchor"``, the paper's coding); and under the reference code's layer
groups (``layer_steps="reference"``) and with ``delta="anchor"``, each at the step that gives
the default level's bytes (within 2%, found by bisection). It is also written by
``velox_kvtc.save`` at each ``--ratio``; each ``--spec`` is a velox cache of the same prompt
written by ``save_cache``. Every file is loaded back and decoded from, against the fp16
cache: KL and top-1 over ``--steps`` teacher-forced tokens of the text that follows, greedy
tokens against the fp16 cache's (``kvtc_disk.py``'s measures), bytes, and save and load
seconds (wall time, ``mx.eval`` included). Each CacheGen row also gives its frequency tables'
bytes and the share of its channels coded as deltas.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from kvtc_disk import _quality, disk_args, disk_rows, print_table

import velox_cachegen as cg
from velox_cachegen.chunks import read_meta
from velox_cachegen.container import split
from velox_cachegen.header import chunk_count


def _cachegen_row(model, caches, name, kwargs, f: Path, text, ref, fp16: int) -> dict:
    start = time.perf_counter()
    sizes = cg.save(f, caches, model=model, **kwargs)
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    mx.eval([[c.keys, c.values] for c in cg.load(f)])
    load_s = time.perf_counter() - start
    _, frames = split(f.read_bytes(), chunk_count)
    flags = [np.unpackbits(np.frombuffer(read_meta(x)[1]["delta"], np.uint8)) for x in frames]
    row = {
        "cache": name,
        "delta_share": float(np.mean(np.concatenate(flags))),  # channels coded as deltas
        "bytes": sizes.total,
        "x_fp16": fp16 / sizes.total,
        "tables_bytes": sizes.tables,
        "streams_bytes": sizes.streams,
        "side_bytes": sizes.side,
        "save_s": save_s,
        "load_s": load_s,
    }
    return {**row, **_quality(model, lambda: cg.load(f), text, ref)}


def _matched(caches, model, kwargs: dict, target: int, tol: float = 0.02) -> float:
    """The step at which CacheGen with ``kwargs`` writes ``target`` bytes (within ``tol``):
    a bisection on the step's logarithm (bytes fall as the step grows)."""
    lo, hi = 0.1, 40.0
    for _ in range(20):
        step = float(np.sqrt(lo * hi))
        size = len(cg.encode(caches, model=model, step=step, **kwargs))
        if abs(size / target - 1) <= tol:
            break
        lo, hi = (step, hi) if size > target else (lo, step)
    return step


def main() -> None:
    ap = disk_args(__doc__.split("\n\n")[0])
    ap.add_argument("--levels", type=float, nargs="+", default=[2.0, cg.STEP, 4.0])
    ap.add_argument("--ratios", type=float, nargs="*", default=[20.0])
    ap.add_argument("--specs", nargs="*", default=["uniform:bits=4"])
    args = ap.parse_args()

    variants = [(f"cachegen step={lv:g}", {"step": lv}) for lv in args.levels]
    variants += [
        (f"cachegen step={cg.STEP:g}, window at the body's step", {"window_step": 1.0}),
        (f"cachegen step={cg.STEP:g}, delta=anchor", {"delta": "anchor"}),
    ]
    # the paper's choices at the bytes of the default level (its step found by bisection)
    matched = [
        ("reference layer groups", {"layer_steps": "reference"}),
        ("delta=anchor", {"delta": "anchor"}),
    ]

    def coded(model, caches, text, ref, fp16: int, tmp: Path) -> list[dict]:
        out = []
        for name, kwargs in variants:
            f = tmp / "cache.cgen"
            out.append(_cachegen_row(model, caches, name, kwargs, f, text, ref, fp16))
        target = len(cg.encode(caches, model=model))
        for what, kwargs in matched:
            step = _matched(caches, model, kwargs, target)
            name = f"cachegen {what}, step={step:.3g} (the default's bytes)"
            kwargs = {**kwargs, "step": step}
            out.append(_cachegen_row(model, caches, name, kwargs, tmp / "c.cgen", text, ref, fp16))
        return out

    rows, path = disk_rows(args, "cachegen-disk-", coded=coded)

    tables = {"tables": lambda r: f"{r['tables_bytes']:,}" if "tables_bytes" in r else "-"}
    print_table(args, path, rows, tables)


if __name__ == "__main__":
    main()
