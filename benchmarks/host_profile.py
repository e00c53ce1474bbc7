"""Where the host time of a decode step goes: cProfile of building the reference model's step
graphs (``model(token, cache=...)``, not evaluating them) with a velox cache.

On a GPU a decode step of a small model is host-bound: the device waits while Python builds
the next step's graph. This script fills the cache with ``--context`` tokens, then profiles
``--steps`` decode steps (each built under the profiler, then evaluated outside it) and prints
the functions by their own time and by their cumulative time, next to the mean build time of
a step for mlx-lm's ``KVCache``. Runs on any MLX device (on the CPU it profiles the reference
path, which is not what a GPU runs).

    python3 benchmarks/host_profile.py --cache uniform:bits=4 --context 4096 --steps 50

``--shape llama3-8b --weights 4bit`` profiles a model of that shape instead (random weights,
``benchmarks/e2e.py``'s shapes), and ``--generate`` profiles mlx-lm's own ``generate_step``
token by token (building, ``async_eval`` and waiting, as a user's loop runs), printing the
intervals between tokens beside the profile: on a GPU, where the host's time of a whole step
goes, MLX's calls included (a custom kernel call's source assembly shows as its builtin).

    python3 benchmarks/host_profile.py --shape llama3-8b --weights 4bit --context 32768 \
        --cache uniform:bits=4,kivi:bits=2 --generate --steps 128

``--layers N`` gives the shape N layers (a many-layer small model: the host's cost of a
step grows with the layers, not with the weights), and each profile's line says the Python
function calls a step makes (cProfile's count, deterministic where the caches are).
``--clock thread`` times the builds by the building thread's CPU time (on a machine shared
with other processes their time on the core does not count), and ``--repeats R`` prints the
median, mean and largest of R timings of ``--steps`` builds each.

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

from velox_cli.specs import split_specs

ROOT = Path(__file__).resolve().parents[1]


def load_model():
    import mlx_lm

    try:
        model, _ = mlx_lm.load(str(ROOT / "shared" / "reference-model"))
    except Exception:  # e.g. no tokenizer backend: the weights suffice
        from mlx_lm.utils import load_model

        model, _ = load_model(ROOT / "shared" / "reference-model")
    return model


def generate_times(model, cache, steps: int, profile: cProfile.Profile | None = None):
    """Seconds between the tokens of ``steps`` tokens of mlx-lm's ``generate_step`` from
    ``cache`` (each ``next`` under the profiler)."""
    from mlx_lm.generate import generate_step

    gen = generate_step(mx.array([5]), model, max_tokens=steps + 1, prompt_cache=cache)
    next(gen)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        next(gen)
        if profile is not None:
            profile.disable()
        times.append(time.perf_counter() - t0)
    return times


def build_times(
    model, cache, steps: int, profile: cProfile.Profile | None = None, clock=time.perf_counter
) -> float:
    """Mean seconds to build one decode step's graph (each step evaluated after timing), by
    ``clock``."""
    tok = mx.array([[5]])
    total = 0.0
    for _ in range(steps):
        t0 = clock()
        if profile is not None:
            profile.enable()
        y = model(tok, cache=cache)
        if profile is not None:
            profile.disable()
        total += clock() - t0
        # the caches too: with stubbed kernels the output no longer reads the window, whose
        # writes would otherwise pile up unevaluated from step to step
        mx.eval(y, [c.state for c in cache])
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
    import statistics

    import velox_core

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default="uniform:bits=4", help="velox method specs, commas")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk, tokens")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--shape", default=None, help="an e2e.py shape (default: reference)")
    parser.add_argument("--weights", default="4bit", help="with --shape: bf16, 4bit or fp32")
    parser.add_argument("--layers", type=int, default=None, help="with --shape: its layer count")
    parser.add_argument(
        "--generate", action="store_true", help="profile generate_step's tokens, not builds"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="time builds by the wall clock or by the building thread's CPU time (on a shared "
        "machine the wall clock also counts the time other processes take the core)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timings of --steps builds each (not --generate)"
    )
    parser.add_argument(
        "--stub-kernels",
        action="store_true",
        help="build the CUDA kernel path with the kernel calls stubbed (any machine)",
    )
    args = parser.parse_args()
    if args.layers is not None and (args.shape is None or args.layers < 1):
        parser.error("--layers needs --shape and a count of at least 1")
    if args.shape is None:
        model = load_model()
        vocab = 8000
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from e2e import SHAPES, build_model

        if args.layers is not None and args.shape in SHAPES:
            SHAPES[args.shape] = {**SHAPES[args.shape], "num_hidden_layers": args.layers}
        model = build_model(args.shape, args.weights)
        vocab = SHAPES[args.shape]["vocab_size"]
    prompt = mx.random.randint(1, vocab, (1, args.context), key=mx.random.key(0))
    specs = ["fp16", *split_specs(args.cache)]
    stub = " (velox kernel calls stubbed, CUDA path)" if args.stub_kernels else ""
    what = "a generate_step token" if args.generate else "building a step's graph"
    if not args.generate:
        what += f" ({args.clock} clock, {args.repeats} x {args.steps} steps)"
    for spec in specs:
        cache = velox_core.make_cache(model, default=spec)
        prof = cProfile.Profile()
        with velox_core.routed(model):
            for i in range(0, args.context, args.chunk):
                model(prompt[:, i : i + args.chunk], cache=cache)
                mx.eval([c.state for c in cache])
                mx.clear_cache()
            with stubbed_kernels(args.stub_kernels and spec != "fp16"):
                if args.generate:
                    generate_times(model, cache, 8)  # warm-up
                    times = generate_times(model, cache, args.steps)
                    generate_times(model, cache, args.steps, prof)
                else:
                    clock = time.thread_time if args.clock == "thread" else time.perf_counter
                    build_times(model, cache, 5)  # warm-up
                    times = [build_times(model, cache, args.steps, clock=clock)]
                    times += [
                        build_times(model, cache, args.steps, clock=clock)
                        for _ in range(args.repeats - 1)
                    ]
                    build_times(model, cache, args.steps, prof)
        ms = [t * 1e3 for t in times]
        med = statistics.median(ms)
        calls = pstats.Stats(prof).total_calls / args.steps
        slow = [(i, round(t, 1)) for i, t in enumerate(ms) if t > 2 * med][:8]
        print(
            f"{spec:28s} {what}: median {med:.3f} ms, mean {statistics.mean(ms):.3f} ms, "
            f"max {max(ms):.3f} ms, {calls:.0f} function calls a step"
            + (stub if spec != "fp16" else "")
            + (f"; steps over twice the median: {slow}" if slow else ""),
            flush=True,
        )
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key)
            stats.print_stats(args.top)
            print(f"\n== {spec} by {key} ({args.steps} steps) ==")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:12000])
        del cache
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
