"""How long a fresh process waits for velox's kernels: the first prefill chunk and the first
decode step of a velox cache, against the same with mlx-lm's ``KVCache`` (whose kernels MLX
builds too), on a two-layer model of ``e2e.py``'s llama3-8b shape.

Run it twice: the first process on a machine builds the kernels, the second finds MLX's
compiled-kernel cache (``MLX_PTX_CACHE_DIR`` on CUDA, default under the temp dir). It
prints one JSON line per cache (with ``compile_ahead``: ``VELOX_COMPILE_AHEAD=0`` compiles
each kernel when it is first called, one after another; and ``compile_processes``:
``VELOX_COMPILE_PROCESSES=0`` runs NVRTC in this process's threads rather than in worker
processes) and the velox entries of that cache directory.

    python3 benchmarks/first_use.py --cache uniform:bits=4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
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

    config = kernel_config()
    return {
        "cache": spec,
        "compile_ahead": config.compile_ahead,
        "compile_processes": config.compile_processes,
        "first_chunk_s": chunk,
        "first_step_s": step,
        "next_step_s": again,
    }


class Timeline:
    """Each velox NVRTC compile of the process: its thread, kernel, start and end (seconds from
    the timeline's start), and its source, for :func:`nvrtc_overlap`."""

    def __init__(self) -> None:
        from velox_core.kernels import disk_cache

        self.t0 = time.perf_counter()
        self.compiles: list[dict] = []
        self.sources: list[tuple[str, str, str]] = []
        self.compile_cuda = compile_cuda = disk_cache.compile_cuda

        def timed(source: str, kernel: str, file_name: str):
            start = time.perf_counter() - self.t0
            try:
                return compile_cuda(source, kernel, file_name)
            finally:
                end = time.perf_counter() - self.t0
                self.sources.append((source, kernel, file_name))
                self.compiles.append(
                    {
                        "thread": threading.current_thread().name,
                        "kernel": kernel.removeprefix("mlx::core::cu::custom_kernel_")[:48],
                        "start": round(start, 3),
                        "end": round(end, 3),
                    }
                )

        disk_cache.compile_cuda = timed

    def mark(self) -> float:
        return round(time.perf_counter() - self.t0, 3)


def nvrtc_overlap(timeline: Timeline) -> dict:
    """The process's velox kernels compiled again, one after another and then all at once in
    threads: whether NVRTC compiles in parallel here."""
    from concurrent.futures import ThreadPoolExecutor

    compile_cuda, sources = timeline.compile_cuda, timeline.sources
    if not sources:  # the CPU or Metal, or every kernel found on disk
        return {"kernels": 0}
    t0 = time.perf_counter()
    for item in sources:
        compile_cuda(*item)
    serial = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(sources)) as pool:
        list(pool.map(lambda item: compile_cuda(*item), sources))
    return {"kernels": len(sources), "serial_s": serial, "threads_s": time.perf_counter() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default="uniform:bits=4")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also print when each velox kernel compiled (thread, start, end), and the same "
        "kernels compiled again one after another and all at once",
    )
    args = p.parse_args()
    e2e.SHAPES["llama3-8b-2l"] = {**e2e.SHAPES["llama3-8b"], "num_hidden_layers": 2}
    model = e2e.build_model("llama3-8b-2l", "4bit")
    timeline = Timeline() if args.timeline else None
    for spec in ("fp16", args.cache):
        row = timed_use(model, spec, args.context)
        if timeline is not None:
            row["done_at"] = timeline.mark()
        print(json.dumps(row), flush=True)
    if timeline is not None:
        print(json.dumps({"compiles": timeline.compiles}), flush=True)
        print(json.dumps(nvrtc_overlap(timeline)), flush=True)
    ptx = Path(os.environ.get("MLX_PTX_CACHE_DIR", Path(tempfile.gettempdir()) / "mlx"))
    names = sorted(str(f.relative_to(ptx)) for f in ptx.rglob("*velox*")) if ptx.exists() else []
    print(json.dumps({"ptx_cache": str(ptx), "velox_entries": len(names), "first": names[:6]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
