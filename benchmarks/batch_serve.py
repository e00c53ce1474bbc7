"""Batched generation as mlx-lm's server runs it: ``batch_generate`` over prompts of different
lengths, with mlx-lm's fp16 ``BatchKVCache`` and with velox caches (``velox_core.install``).

Per cache, in one process, on an mlx-lm architecture of a named shape with random weights
(``benchmarks/e2e.py``'s shapes): prompt tokens per second and generated tokens per second
as ``batch_generate`` reports them (all sequences together), MLX's peak memory over the run
(reset per row), the wall time, and ratios against the fp16 row. Each row follows a short
run of the same cache (4 tokens), so that kernels built on first use are not timed. Rows of
one length share a velox cache and one kernel launch per layer and step; rows of other
lengths are attended group by group (``velox_core.VeloxBatch``), so ``--lengths`` with all
lengths equal and with different lengths measure both.

    python3 benchmarks/batch_serve.py --shape llama3-8b --weights 4bit \
        --lengths 8192,6144,4096,2048 --steps 64 --caches fp16,uniform:bits=4 --json out/b.json
    python3 benchmarks/batch_serve.py --shape small --weights fp32 --lengths 300,200 --steps 8
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import mlx.core as mx

from velox_cli.specs import split_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json
from e2e import SHAPES, WEIGHTS, build_model, parse_ints


class _Tokens:
    """The least of a tokenizer that ``batch_generate`` needs: no end-of-sequence token (so
    every sequence runs ``--steps`` tokens) and a decode that returns nothing."""

    eos_token_ids: frozenset = frozenset()

    def decode(self, ids) -> str:
        return ""


def run_row(model, spec: str, prompts: list[list[int]], steps: int, chunk: int) -> dict:
    from mlx_lm.generate import batch_generate

    import velox_core

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    if spec != "fp16":
        velox_core.install(model, spec)
    try:
        t0 = time.perf_counter()
        out = batch_generate(
            model,
            _Tokens(),
            prompts,
            max_tokens=steps,
            prefill_step_size=chunk,
            return_token_ids=True,
        )
        wall = time.perf_counter() - t0
    finally:
        if spec != "fp16":
            velox_core.uninstall(model)
    s = out.stats
    return {
        "cache": spec,
        "lengths": [len(p) for p in prompts],
        "steps": steps,
        "prompt_tok_s": s.prompt_tps,
        "generation_tok_s": s.generation_tps,
        "generated": sum(len(t) for t in out.token_ids),
        "peak_bytes": int(mx.get_peak_memory()),
        "base_bytes": int(base),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--weights", default="fp32", choices=WEIGHTS)
    p.add_argument("--lengths", default="300,200,100", help="prompt lengths, one per sequence")
    p.add_argument("--steps", type=int, default=16, help="tokens generated per sequence")
    p.add_argument("--chunk", type=int, default=2048, help="prefill step size")
    p.add_argument("--caches", default="fp16,uniform:bits=4")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    lengths = parse_ints(a.lengths, "--lengths")
    if a.steps < 1:
        raise SystemExit("--steps must be at least 1")
    specs = split_specs(a.caches)
    if "fp16" not in specs:
        specs.insert(0, "fp16")
    model = build_model(a.shape, a.weights)
    vocab = SHAPES[a.shape]["vocab_size"]
    keys = mx.random.split(mx.random.key(1), len(lengths))
    prompts = [mx.random.randint(0, vocab, (n,), key=k).tolist() for k, n in zip(keys, lengths)]
    rows = []
    for spec in specs:
        # a short run first: MLX and velox build their kernels on first use in a process
        run_row(model, spec, prompts, min(4, a.steps), a.chunk)
        rows.append(run_row(model, spec, prompts, a.steps, a.chunk))
    ref = next(r for r in rows if r["cache"] == "fp16")
    for r in rows:
        r["x_fp16_generation"] = r["generation_tok_s"] / ref["generation_tok_s"]
        r["x_fp16_peak"] = r["peak_bytes"] / ref["peak_bytes"]
        r.update(shape=a.shape, weights=a.weights)
    print(f"{a.shape} {a.weights}, prompts {lengths}, {a.steps} tokens each")
    print("| cache | prompt tok/s | generated tok/s | x fp16 | peak GB | x fp16 | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['cache']} | {r['prompt_tok_s']:.0f} | {r['generation_tok_s']:.1f} | "
            f"{r['x_fp16_generation']:.2f} | {r['peak_bytes'] / 1e9:.2f} | "
            f"{r['x_fp16_peak']:.2f} | {r['wall_s']:.1f} |"
        )
    write_json(a.json_path, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
