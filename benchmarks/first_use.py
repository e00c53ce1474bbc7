"""How long a fresh process waits for velox's kernels: the first prefill chunk and the first
decode step of a velox cache, against the same with mlx-lm's ``KVCache`` (whose kernels MLX
builds too), on a two-layer model of ``e2e.py``'s llama3-8b shape.

Run it twice: the first process on a machine builds the kernels, the second finds MLX's
compiled-kernel cache (``MLX_PTX_CACHE_DIR`` on CUDA, default under the temp dir). It
prints one JSON line per cache (with ``compile_ahead``: ``VELOX_COMPILE_AHEAD=0`` compiles
each kernel when it is first called, one after another) and the velox entries of that cache
directory.

    python3 benchmarks/first_use.py --cache uniform:bits=4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e


def timed_use(model, spec: str, context: int) -> dict:
    import velox_core

    caches = e2e.make_caches(model, spec)
    prompt = mx.random.randint(0, 1000, (1, context), key=mx.random.key(1))
    with velox_core.routed(model):
        t0 = time.perf_counter()
        model(prompt[:, :-1], cache=caches)
        mx.eval([c.state for c in caches])
        chunk = time.perf_counter() - t0
        t0 = time.perf_counter()
        mx.eval(model(prompt[:, -1:], cache=caches))
        step = time.perf_counter() - t0
        t0 = time.perf_counter()
        mx.eval(model(prompt[:, -1:], cache=caches))
        again = time.perf_counter() - t0
    from velox_core.kernels.config import kernel_config

    ahead = kernel_config().compile_ahead
    return {
        "cache": spec,
        "compile_ahead": ahead,
        "first_chunk_s": chunk,
        "first_step_s": step,
        "next_step_s": again,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default="uniform:bits=4")
    p.add_argument("--context", type=int, default=2048)
    args = p.parse_args()
    e2e.SHAPES["llama3-8b-2l"] = {**e2e.SHAPES["llama3-8b"], "num_hidden_layers": 2}
    model = e2e.build_model("llama3-8b-2l", "4bit")
    for spec in ("fp16", args.cache):
        print(json.dumps(timed_use(model, spec, args.context)), flush=True)
    ptx = Path(os.environ.get("MLX_PTX_CACHE_DIR", Path(tempfile.gettempdir()) / "mlx"))
    names = sorted(str(f.relative_to(ptx)) for f in ptx.rglob("*velox*")) if ptx.exists() else []
    print(json.dumps({"ptx_cache": str(ptx), "velox_entries": len(names), "first": names[:6]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
