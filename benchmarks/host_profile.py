"""Where the host time of a decode step goes: cProfile of building the reference model's step
graphs (``model(token, cache=...)``, not evaluating them) with a velox cache.

On a GPU a decode step of a small model is host-bound: the device waits while Python builds
the next step's graph. This script fills the cache with ``--context`` tokens, then profiles
``--steps`` decode steps (each built under the profiler, then evaluated outside it) and prints
the functions by their own time and by their cumulative time, next to the mean build time of
a step for mlx-lm's ``KVCache``. Runs on any MLX device (on the CPU it profiles the reference
path, which is not what a GPU runs).

    python3 benchmarks/host_profile.py --cache uniform:bits=4 --context 4096 --steps 50

``--stub-kernels`` measures the GPU code path's Python side on any machine (a CPU one
included): after the prefill, velox's kernel backend reports CUDA and every velox kernel call
returns zeroed outputs of the shapes it asks for, so the steps build what they would build on
an NVIDIA GPU (launch plans, checks, views, slice updates) without running a kernel. MLX's own
work for a custom-kernel call (assembling its source, the primitive) is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]


def load_model():
    import mlx_lm

    try:
        model, _ = mlx_lm.load(str(ROOT / "shared" / "reference-model"))
    except Exception:  # e.g. no tokenizer backend: the weights suffice
        from mlx_lm.utils import load_model

        model, _ = load_model(ROOT / "shared" / "reference-model")
    return model


def build_times(model, cache, steps: int, profile: cProfile.Profile | None = None) -> float:
    """Mean seconds to build one decode step's graph (each step evaluated after timing)."""
    tok = mx.array([[5]])
    total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        y = model(tok, cache=cache)
        if profile is not None:
            profile.disable()
        total += time.perf_counter() - t0
        mx.eval(y)
    return total / steps


@contextlib.contextmanager
def stubbed_kernels(on: bool):
    """With ``on``: velox's kernel backend reports CUDA and every ``KernelSpec`` call returns
    zeroed outputs of the requested shapes and dtypes (see the module's docstring)."""
    if not on:
        yield
        return
    import velox_core.kernels as vk
    from velox_core.kernels.build import KernelSpec

    def stub(*_, output_shapes, output_dtypes, **__):
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

    backend, kernel = vk.backend, KernelSpec.kernel
    vk.backend = lambda: "cuda"
    KernelSpec.kernel = lambda self: stub
    try:
        yield
    finally:
        vk.backend, KernelSpec.kernel = backend, kernel


def main() -> int:
    import velox_core

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default="uniform:bits=4", help="a velox method spec")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--stub-kernels",
        action="store_true",
        help="build the CUDA kernel path with the kernel calls stubbed (any machine)",
    )
    args = parser.parse_args()
    model = load_model()
    prompt = mx.random.randint(1, 8000, (1, args.context), key=mx.random.key(0))
    rows = {}
    for name, spec in (("fp16 KVCache", "fp16"), (args.cache, args.cache)):
        cache = velox_core.make_cache(model, default=spec)
        with velox_core.routed(model):
            for i in range(0, args.context, 2048):
                mx.eval(model(prompt[:, i : i + 2048], cache=cache))
            with stubbed_kernels(args.stub_kernels and spec != "fp16"):
                build_times(model, cache, 5)  # warm-up
                rows[name] = build_times(model, cache, args.steps)
                if spec != "fp16":
                    prof = cProfile.Profile()
                    build_times(model, cache, args.steps, prof)
    stub = " (velox kernel calls stubbed, CUDA path)" if args.stub_kernels else ""
    for name, t in rows.items():
        print(
            f"{name:28s} building a step's graph: {t * 1e3:.3f} ms"
            + (stub if name != "fp16 KVCache" else "")
        )
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key)
        stats.print_stats(args.top)
        print(f"\n== by {key} ({args.steps} steps) ==")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:12000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
