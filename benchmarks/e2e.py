"""End to end: what a user of mlx-lm sees with each cache on a model of real size.

For each context, batch size and cache, in one process: the prompt is prefilled the way
mlx-lm's ``generate_step`` prefills it (chunks of ``--chunk`` tokens, the cache's state
evaluated after each, the last token left for the first step), then ``--steps`` tokens are
decoded through mlx-lm's own ``generate_step`` (batch 1) or the same pipelined loop over a
``(B, 1)`` token batch (batch > 1, prompts of one length; ``benchmarks/batch_serve.py``
measures mlx-lm's own ``batch_generate``). Per row:

- ``prefill_s``: the whole prefill; ``first_chunk_s``: its first chunk and ``first_step_s``
  the first decode step (kernel builds show up there in a fresh process);
- ``decode_tok_s``: decoded tokens per second and sequence (the pipelined loop: the next step's
  graph is built while the device runs this one, as ``generate_step`` does); ``step_ms``: the
  median, 90th percentile and largest interval between two tokens of that loop, and
  ``slow_steps`` the loop's steps over twice the median (``[step, ms]``, at most 8: a velox
  cache's window flushes every ``flush`` tokens, and its stores grow in steps);
- ``host_ms_per_step``: median time to build one decode step's graph (``model(token)``
  without evaluating it); ``sync_ms_per_step``: median time of a step built and evaluated
  before the next one (host plus device, no overlap);
- where a pipelined step's time goes, medians over the timed steps of the loop in
  ``generate_step``'s order (build step n+1, ``mx.async_eval`` it, wait for step n):
  ``build_ms_per_step`` (Python builds the graph), ``encode_ms_per_step`` (``async_eval``:
  MLX turns the graph into launches on the host) and ``wait_ms_per_step`` (the host waits for
  the device; near 0 means the step is host-bound: the device idles between launches);
- with ``--repeats N`` the rows of one context and batch run N times in rotation (fp16, the
  next cache, ..., fp16 again), so that a drift of the host's speed reaches every cache
  alike; a row then reports the median of its runs (``decode_tok_s_runs`` lists them) and
  the largest peak;
- ``peak_bytes``: MLX's peak memory over prefill and decode (reset at the start of each row),
  ``prefill_peak_bytes`` the same over the prefill only, ``base_bytes`` what was active
  before the row (weights), ``cache_bytes`` the caches' resident bytes after the prefill;
- ``latent_decode`` (rows whose caches include velox's ``LatentCache``, on multi-head latent
  attention shapes): what the last decode step's attention read, ``codes`` (the absorbed
  attention from the latent's codes) or why it read the decoded latent, per distinct answer;
- ratios ``x_fp16_*`` against the fp16 row of the same context and batch.

Models are mlx-lm architectures built at a named shape with random weights (bf16, 4-bit by
``nn.quantize``, or fp32 for the CPU, where MLX's float16 matmuls are slow: there the
``fp16`` row's ``KVCache`` holds float32, as given). Caches: ``fp16`` (mlx-lm's
``KVCache``), ``mlx-q4`` / ``mlx-q8`` (mlx-lm's ``QuantizedKVCache``, group 64), or any velox
spec (``uniform:bits=4``), run with attention routed to velox.

    python3 benchmarks/e2e.py --shape llama3-8b --weights 4bit --contexts 32768,131072 \
        --caches fp16,uniform:bits=4,kivi:bits=2 --json out/e2e.json
    python3 benchmarks/e2e.py --shape small --weights fp32 --contexts 2048   # CPU
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from velox_cli.plan_shapes import SHAPES as PLAN_SHAPES
from velox_cli.specs import split_specs

# Architecture shapes (mlx-lm config fields), velox plan's own (one table for both). Weights
# are random: the shapes decide the cost. "small" is small enough for a CPU, with 8 KV heads
# so that the cache, not the weights, grows with context.
SHAPES: dict[str, dict[str, Any]] = {
    name: PLAN_SHAPES[name] for name in ("llama3-8b", "qwen2.5-7b", "small")
}
# Multi-head latent attention (mlx-lm's deepseek_v3): DeepSeek-V3's attention (128 heads, a
# 512-channel latent and a 64-channel RoPE key stored per token, one of each per layer) on 8
# layers with dense MLPs instead of its experts, so that the latent cache is measured at the
# real layer shape without 671B parameters; "mla-small" is its CPU-sized relative.
_DEEPSEEK_V3_ATTENTION = {
    "model_type": "deepseek_v3",
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 163840,
    "n_routed_experts": None,
}
SHAPES["deepseek-v3-8l"] = {
    **_DEEPSEEK_V3_ATTENTION,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 8,
    "vocab_size": 129280,
}
SHAPES["mla-small"] = {
    **_DEEPSEEK_V3_ATTENTION,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 128,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "vocab_size": 2048,
}
WEIGHTS = ("bf16", "4bit", "fp32")
MLX_QUANTIZED = {"mlx-q4": 4, "mlx-q8": 8}


def build_model(shape: str, weights: str, seed: int = 0) -> nn.Module:
    """An mlx-lm model of ``shape`` with random weights in ``weights``, evaluated."""
    if shape not in SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    cfg = dict(SHAPES[shape])
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32 if weights == "fp32" else mx.bfloat16)
    if weights == "4bit":
        nn.quantize(model, group_size=64, bits=4)
    # evaluated layer by layer, so that no more than one layer's unquantized weights exist
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    model.eval()
    return model


def make_caches(model: nn.Module, spec: str) -> list:
    from mlx_lm.models.cache import QuantizedKVCache

    import velox_core

    if spec == "fp16":
        return velox_core.make_cache(model, default="fp16")
    if spec in MLX_QUANTIZED:
        return [QuantizedKVCache(group_size=64, bits=MLX_QUANTIZED[spec]) for _ in model.layers]
    return velox_core.make_cache(model, default=spec)


def cache_bytes(caches: list) -> int:
    return int(sum(getattr(c, "nbytes", 0) for c in caches))


def prefill(model, caches, prompt: mx.array, chunk: int) -> tuple[float, float]:
    """``generate_step``'s prefill: all but the last token in chunks, each chunk's cache state
    evaluated (its logits never are). Returns (seconds in all, seconds of the first chunk)."""
    t0 = time.perf_counter()
    first = None
    done, total = 0, prompt.shape[1]
    while total - done > 1:
        n = min(chunk, total - done - 1)
        model(prompt[:, done : done + n], cache=caches)
        mx.eval([c.state for c in caches])
        done += n
        if first is None:
            first = time.perf_counter() - t0
        mx.clear_cache()
    return time.perf_counter() - t0, first or 0.0


def decode_generate_step(model, caches, last: mx.array, steps: int):
    """mlx-lm's ``generate_step`` from the prefilled caches (batch 1): (tokens per second,
    seconds to its first token, the seconds between tokens). The rate's clock starts at the
    first yielded token (its own step over the one prompt token left, where a fresh process
    builds its decode kernels)."""
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    gen = generate_step(last[0], model, max_tokens=steps + 1, prompt_cache=caches)
    next(gen)
    first = time.perf_counter() - t0
    start = t0 = time.perf_counter()
    times = []
    for _ in gen:
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return len(times) / (t0 - start), first, times


def decode_batched(model, caches, last: mx.array, steps: int):
    """``generate_step``'s pipelined loop over a ``(B, 1)`` token batch (greedy): (tokens per
    second and sequence, seconds to the first token, the seconds between steps)."""

    def step(tok):
        logits = model(tok, cache=caches)[:, -1, :]
        return mx.argmax(logits, axis=-1)[:, None]

    t0 = time.perf_counter()
    y = step(last)
    mx.async_eval(y)
    mx.eval(y)
    first = time.perf_counter() - t0
    start = t0 = time.perf_counter()
    times = []
    for _ in range(steps):
        nxt = step(y)
        mx.async_eval(nxt)
        y.tolist()  # what generate_step's y.item() waits for
        y = nxt
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    mx.eval(y)
    return steps / (time.perf_counter() - start), first, times


def step_stats(times: list[float]) -> dict[str, Any]:
    """``step_ms`` (median, 90th percentile, largest) and ``slow_steps`` of a decode loop's
    intervals between tokens (seconds)."""
    ms = [t * 1e3 for t in times]
    if not ms:
        return {"step_ms": None, "slow_steps": []}
    med = statistics.median(ms)
    p90 = sorted(ms)[min(len(ms) - 1, int(0.9 * len(ms)))]
    slow = [[i, round(t, 2)] for i, t in enumerate(ms) if t > 2 * med]
    return {"step_ms": [med, p90, max(ms)], "slow_steps": slow[:8]}


def step_times(model, caches, tok: mx.array, steps: int) -> tuple[float, float]:
    """Median ms to build one decode step's graph, and of a step built then evaluated."""
    build, total = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(tok, cache=caches)
        t1 = time.perf_counter()
        tok = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        mx.eval(tok)
        build.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return statistics.median(build) * 1e3, statistics.median(total) * 1e3


def step_timeline(model, caches, tok: mx.array, steps: int) -> tuple[float, float, float]:
    """Median ms per pipelined step spent building the graph, in ``mx.async_eval`` and
    waiting for the previous step, in ``generate_step``'s order."""

    def step(t):
        return mx.argmax(model(t, cache=caches)[:, -1, :], axis=-1)[:, None]

    y = step(tok)
    mx.async_eval(y)
    build, encode, wait = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = step(y)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.tolist()
        t3 = time.perf_counter()
        build.append(t1 - t0)
        encode.append(t2 - t1)
        wait.append(t3 - t2)
        y = nxt
    mx.eval(y)
    return tuple(statistics.median(v) * 1e3 for v in (build, encode, wait))


def run_row(model, spec: str, context: int, batch: int, args) -> dict[str, Any]:
    import velox_core

    vocab = SHAPES[args.shape]["vocab_size"]
    row: dict[str, Any] = {
        "shape": args.shape,
        "weights": args.weights,
        "cache": spec,
        "context": context,
        "batch": batch,
        "eval_chunks": not args.no_eval_chunks,
    }
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    prompt = mx.random.randint(0, vocab, (batch, context), key=mx.random.key(context + batch))
    mx.eval(prompt)
    caches = make_caches(model, spec)
    try:
        with velox_core.routed(model):
            row["prefill_s"], row["first_chunk_s"] = prefill(model, caches, prompt, args.chunk)
            row["prefill_peak_bytes"] = mx.get_peak_memory()
            row["cache_bytes"] = cache_bytes(caches)
            last = prompt[:, -1:]
            decode = decode_generate_step if batch == 1 else decode_batched
            row["decode_tok_s"], row["first_step_s"], times = decode(
                model, caches, last, args.steps
            )
            row.update(step_stats(times))
            row["peak_bytes"] = mx.get_peak_memory()
            tok = mx.zeros((batch, 1), dtype=mx.int32)
            row["host_ms_per_step"], row["sync_ms_per_step"] = step_times(
                model, caches, tok, args.timed_steps
            )
            timeline = step_timeline(model, caches, tok, args.timed_steps)
            for key, ms in zip(("build", "encode", "wait"), timeline, strict=True):
                row[f"{key}_ms_per_step"] = ms
            paths = sorted({c.decode_path for c in caches if hasattr(c, "decode_path")})
            if paths:
                row["latent_decode"] = "; ".join(map(str, paths))
    finally:
        row["base_bytes"] = base
        del caches, prompt
        gc.collect()
        mx.clear_cache()
    return row


def safe_row(model, spec: str, context: int, batch: int, args) -> dict[str, Any]:
    """:func:`run_row`, or a row holding the error (one failing cache must not lose the
    other rows)."""
    try:
        return run_row(model, spec, context, batch, args)
    except Exception as exc:
        row = {
            "shape": args.shape,
            "weights": args.weights,
            "cache": spec,
            "context": context,
            "batch": batch,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
        print(row["traceback"], file=sys.stderr)
        return row


# a repeated row's fields that take the median of its runs (the peaks take the largest)
MEDIAN_FIELDS = (
    "prefill_s",
    "first_chunk_s",
    "decode_tok_s",
    "host_ms_per_step",
    "sync_ms_per_step",
    "build_ms_per_step",
    "encode_ms_per_step",
    "wait_ms_per_step",
)


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the runs of one cache: medians of the times, the largest peaks, the first
    step of the first run (where a fresh process builds kernels); an error if any run failed."""
    failed = [r for r in runs if "error" in r]
    if failed or len(runs) == 1:
        return failed[0] if failed else runs[0]
    row = dict(runs[0])
    for key in MEDIAN_FIELDS:
        row[key] = statistics.median(r[key] for r in runs)
    for key in ("peak_bytes", "prefill_peak_bytes"):
        row[key] = max(r[key] for r in runs)
    row["decode_tok_s_runs"] = [r["decode_tok_s"] for r in runs]
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    fp16 = {
        (r["context"], r["batch"]): r for r in rows if r["cache"] == "fp16" and "error" not in r
    }
    keys = ("decode_tok_s", "host_ms_per_step", "peak_bytes", "prefill_s", "cache_bytes")
    for r in rows:
        ref = fp16.get((r["context"], r["batch"]))
        if ref is None or "error" in r:
            continue
        for k in keys:
            if ref.get(k):
                r[f"x_fp16_{k}"] = r[k] / ref[k]


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| context | batch | cache | prefill s | first chunk s | decode tok/s | x fp16 "
        "| step ms median / p90 / max | host ms/step | x fp16 | sync ms/step "
        "| build / encode / wait ms | cache GiB | peak GB | x fp16 | prefill peak GB |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(r, k, fmt):
        v = r.get(k)
        return "" if v is None else format(v, fmt)

    def steps(r):
        ms = r.get("step_ms")
        return "" if not ms else " / ".join(f"{v:.1f}" for v in ms)

    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['context']} | {r['batch']} | {r['cache']} | error: {r['error']} |"
                + " |" * 12
            )
            continue
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['cache']} | {f(r, 'prefill_s', '.2f')} "
            f"| {f(r, 'first_chunk_s', '.2f')} | {f(r, 'decode_tok_s', '.1f')} "
            f"| {f(r, 'x_fp16_decode_tok_s', '.2f')} | {steps(r)} "
            f"| {f(r, 'host_ms_per_step', '.2f')} "
            f"| {f(r, 'x_fp16_host_ms_per_step', '.2f')} | {f(r, 'sync_ms_per_step', '.2f')} "
            f"| {f(r, 'build_ms_per_step', '.2f')} / {f(r, 'encode_ms_per_step', '.2f')} / "
            f"{f(r, 'wait_ms_per_step', '.2f')} | {r['cache_bytes'] / 2**30:.3f} "
            f"| {r['peak_bytes'] / 1e9:.2f} "
            f"| {f(r, 'x_fp16_peak_bytes', '.2f')} | {r['prefill_peak_bytes'] / 1e9:.2f} |"
        )
    return "\n".join(lines)


def parse_ints(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name} must be comma-separated integers, got {text!r}") from None
    if not out or any(x < 2 for x in out):
        raise SystemExit(f"{name} must list integers of at least 2, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--weights", default="4bit", choices=WEIGHTS)
    p.add_argument("--caches", default="fp16,uniform:bits=4,turboquant:bits=4,kivi:bits=2")
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=64, help="decoded tokens timed per row")
    p.add_argument("--timed-steps", type=int, default=16, help="steps timed for host/sync ms")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (mlx-lm's default)")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of each row, in rotation (medians kept)"
    )
    p.add_argument("--json", type=Path, default=None, help="write the rows to this file")
    p.add_argument(
        "--no-warmup", action="store_true", help="no unrecorded fp16 row first (MLX's kernels)"
    )
    p.add_argument(
        "--no-eval-chunks",
        action="store_true",
        help="velox caches leave a prefill chunk's codes unevaluated (VeloxCache.eval_chunks)",
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if args.no_eval_chunks:
        from velox_core import VeloxCache

        VeloxCache.eval_chunks = False
    contexts = parse_ints(args.contexts, "--contexts")
    batches = [int(b) for b in args.batch.split(",")]
    specs = split_specs(args.caches)
    if "fp16" in specs:  # the reference row first, for the ratios
        specs = ["fp16", *[s for s in specs if s != "fp16"]]
    t0 = time.perf_counter()
    model = build_model(args.shape, args.weights)
    info = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "model_build_s": time.perf_counter() - t0,
        "weights_bytes": mx.get_active_memory(),
    }
    print(
        f"model {args.shape} ({args.weights}) built in {info['model_build_s']:.1f} s, "
        f"{info['weights_bytes'] / 1e9:.2f} GB active",
        flush=True,
    )
    if not args.no_warmup:
        # MLX builds its own kernels on first use (tens of seconds on a fresh CUDA machine):
        # an unrecorded fp16 prefill and decode first, so that no row's times hold them;
        # velox's kernels are still first built in the first velox row (its first_chunk_s
        # and first_step_s)
        t0 = time.perf_counter()
        warm = argparse.Namespace(**{**vars(args), "steps": 4, "timed_steps": 2})
        run_row(model, "fp16", min(contexts[0], 4096), batches[0], warm)
        info["warmup_s"] = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    for context in contexts:
        for batch in batches:
            runs: dict[str, list[dict[str, Any]]] = {spec: [] for spec in specs}
            for _ in range(args.repeats):
                for spec in specs:
                    row = safe_row(model, spec, context, batch, args)
                    runs[spec].append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}))
            rows.extend(median_row(runs[spec]) for spec in specs)
    add_ratios(rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
