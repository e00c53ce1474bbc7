"""Peak memory of one mlx-vlm generation with velox caches against mlx-vlm's own caches.

The tiny random-weight Qwen2-VL of velox_vlm.testing (2 layers, 2 KV heads of 64 channels,
fp16) reads an image and ``context`` text tokens in mlx-vlm's generate loop (chunked prefill of
``prefill_step_size`` tokens, mlx-vlm's default 2048) and writes 16 tokens. Each configuration
runs in a process of its own; MLX's peak memory is reset after the model is built, so a row's
peak is the generation's (the model's weights, resident throughout, included). Rows: mlx-vlm's
fp16 caches, its ``kv_bits`` 8 and 4 (at its default ``quantized_kv_start`` of 5000 and at 0),
velox uniform 8 and 4 bits (velox_vlm.stream_generate; on the CPU the prefill attends over
slices of the stored tokens: velox_core.cache.attention.tiled_prefill_attention), and velox
uniform 4 bits with ``prefill_tile=0`` (all stored tokens decoded for fused SDPA). Also:
multi-turn reuse of the velox cache (a second turn through ``prompt_cache_state``) against
the same turns fed into one fresh cache (tokens and log-probabilities equal: exact).

    python benchmarks/vlm_memory.py                      # contexts 2048 4096 8192, a table
    python benchmarks/vlm_memory.py --json out/vlm_memory.json
    python benchmarks/vlm_memory.py --trace "velox uniform:bits=4" 4096   # per attention layer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "mlx-vlm fp16": {},
    "mlx-vlm kv_bits=8": {"kv_bits": 8},
    "mlx-vlm kv_bits=4": {"kv_bits": 4},
    "mlx-vlm kv_bits=8, start 0": {"kv_bits": 8, "quantized_kv_start": 0},
    "mlx-vlm kv_bits=4, start 0": {"kv_bits": 4, "quantized_kv_start": 0},
    "velox uniform:bits=8": {"velox": "uniform:bits=8"},
    "velox uniform:bits=4": {"velox": "uniform:bits=4"},
    # the prefill attending over all stored tokens decoded at once (fused SDPA), not slices
    "velox uniform:bits=4, untiled": {"velox": "uniform:bits=4", "prefill_tile": 0},
}


def _prompt(model, context: int) -> dict:
    from velox_vlm.testing import image_prompt

    text = [(7 * i + 3) % 400 + 1 for i in range(context)]
    return image_prompt(model, text[:3], text[3:])


def trace_attention(model, rows: list) -> None:
    """Record each prefill chunk's attention layer (more than 16 tokens) in ``rows``: its
    tokens, the active memory before it and MLX's peak during it (its inputs and its output
    evaluated on their own: the layer's transient alone; this resets the run's peak)."""
    import mlx.core as mx

    layers = model.language_model.layers
    cls = type(layers[0].self_attn)
    call = cls.__call__

    def traced(self, x, *args, **kwargs):
        if x.shape[1] <= 16:
            return call(self, x, *args, **kwargs)
        mx.eval(x)
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = call(self, x, *args, **kwargs)
        mx.eval(out)
        mx.synchronize()
        n = len(rows)
        rows.append(
            {
                "chunk": n // len(layers),
                "layer": n % len(layers),
                "tokens": x.shape[1],
                "before": before,
                "peak": mx.get_peak_memory(),
            }
        )
        return out

    cls.__call__ = traced


def run_one(name: str, context: int, max_tokens: int, trace: list | None = None) -> dict:
    """One configuration in this process: its peak memory and cache bytes (with ``trace``,
    a list: each prefill attention layer's memory, :func:`trace_attention`, instead)."""
    import mlx.core as mx
    from mlx_vlm import stream_generate

    import velox_core
    import velox_vlm
    from velox_vlm.testing import tiny_processor, tiny_vlm

    cfg = dict(CONFIGS[name])
    model = tiny_vlm("qwen2_vl")
    processor = tiny_processor()
    if trace is not None:
        trace_attention(model, trace)
    kw = _prompt(model, context)
    mx.eval(kw)
    spec = cfg.pop("velox", None)
    caches = velox_vlm.make_cache(model, spec) if spec else None
    for c in caches or []:
        if "prefill_tile" in cfg and isinstance(c, velox_core.VeloxCache):
            c.prefill_tile = cfg["prefill_tile"]
    cfg.pop("prefill_tile", None)
    gen = {"max_tokens": max_tokens, "temperature": 0.0, **cfg, **kw}
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    if spec:
        out = list(velox_vlm.stream_generate(model, processor, "", cache=caches, **gen))
    else:
        from mlx_vlm.models.cache import make_prompt_cache

        caches = make_prompt_cache(model.language_model)
        out = list(stream_generate(model, processor, "", prompt_cache=caches, **gen))
    mx.synchronize()
    peak = mx.get_peak_memory()
    return {
        "config": name,
        "context": context,
        "prompt_tokens": int(kw["input_ids"].shape[1]),
        "peak_bytes": int(peak),
        "cache_bytes": int(sum(c.nbytes for c in caches)),
        "tokens": [r.token for r in out[:-1]],
    }


def run_reuse(spec: str = "uniform:bits=4", context: int = 2048) -> dict:
    """Two turns, the second reusing the first's compressed cache, against the same turns fed
    into one fresh cache: equal tokens and log-probabilities (exact)."""
    import mlx.core as mx
    from mlx_vlm.generate import PromptCacheState, generate_step

    import velox_core
    import velox_vlm
    from velox_vlm.testing import tiny_processor, tiny_vlm

    model = tiny_vlm("qwen2_vl")
    processor = tiny_processor()
    kw1 = _prompt(model, context)
    gen = {"max_tokens": 16, "temperature": 0.0}
    state = PromptCacheState()
    r1 = [
        r.token
        for r in velox_vlm.stream_generate(
            model, processor, "", cache=spec, prompt_cache_state=state, **gen, **kw1
        )
    ][:-1]
    suffix = [(11 * i + 5) % 400 + 1 for i in range(64)]
    ids = mx.array([kw1["input_ids"][0].tolist() + r1 + suffix], dtype=mx.int32)
    kw2 = dict(kw1, input_ids=ids, mask=mx.ones_like(ids))
    turn2 = list(
        velox_vlm.stream_generate(
            model, processor, "", cache=spec, prompt_cache_state=state, **gen, **kw2
        )
    )[:-1]
    fresh = velox_vlm.make_cache(model, spec)
    list(velox_vlm.stream_generate(model, processor, "", cache=fresh, **gen, **kw1))
    lm = model.language_model
    pos, deltas = lm.get_rope_index(ids, kw2["image_grid_thw"], None, kw2["mask"])
    with velox_core.routed(model):
        step = generate_step(
            mx.array([suffix], dtype=mx.int32),
            model,
            None,
            kw2["mask"],
            prompt_cache=fresh,
            position_ids=pos,
            rope_deltas=deltas,
            **gen,
        )
        replay = [next(step) for _ in range(16)]
    exact = [r.token for r in turn2] == [int(t) for t, _ in replay] and all(
        mx.array_equal(r.logprobs, lp) for r, (_, lp) in zip(turn2, replay)
    )
    return {
        "spec": spec,
        "context": context,
        "reused_tokens": turn2[0].cached_tokens,
        "exact": bool(exact),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--one", nargs=2, metavar=("CONFIG", "CONTEXT"), help=argparse.SUPPRESS)
    ap.add_argument(
        "--trace",
        nargs=2,
        metavar=("CONFIG", "CONTEXT"),
        help="one configuration: the memory of each prefill attention layer",
    )
    args = ap.parse_args(argv)
    if args.trace:
        trace: list = []
        run_one(args.trace[0], int(args.trace[1]), args.max_tokens, trace)
        mib = 2**20
        for r in trace:
            print(
                f"chunk {r['chunk']} layer {r['layer']}: {r['tokens']} tokens, active before "
                f"{r['before'] / mib:.1f} MiB, peak {r['peak'] / mib:.1f} MiB, transient "
                f"{(r['peak'] - r['before']) / mib:.1f} MiB"
            )
        return 0
    if args.one:
        row = run_one(args.one[0], int(args.one[1]), args.max_tokens)
        print("ROW " + json.dumps(row))
        return 0
    rows = []
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    for context in args.contexts:
        for name in args.configs:
            cmd = [sys.executable, __file__, "--one", name, str(context)]
            cmd += ["--max-tokens", str(args.max_tokens)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
            if proc.returncode or line is None:
                err = (proc.stderr.strip().splitlines() or ["?"])[-1]
                rows.append({"config": name, "context": context, "error": err})
            else:
                rows.append(json.loads(line[4:]))
            r = rows[-1]
            shown = f"{r['peak_bytes'] / 2**20:8.1f} MiB" if "peak_bytes" in r else r["error"]
            print(f"  {context:>6} {name:<28} {shown}", file=sys.stderr, flush=True)
    reuse = run_reuse()
    _table(rows, args.contexts)
    print(
        f"\nmulti-turn reuse ({reuse['spec']}, {reuse['context']}-token first turn, "
        f"{reuse['reused_tokens']} tokens reused): exact = {reuse['exact']}"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "reuse": reuse}, indent=1))
    return 0


def _table(rows: list[dict], contexts: list[int]) -> None:
    by = {(r["config"], r["context"]): r for r in rows}
    names = list(dict.fromkeys(r["config"] for r in rows))
    head = "| configuration | " + " | ".join(f"peak @ {c} (cache)" for c in contexts) + " |"
    print(head)
    print("|" + "---|" * (len(contexts) + 1))
    for name in names:
        cells = []
        for c in contexts:
            r = by.get((name, c), {})
            if "peak_bytes" in r:
                cells.append(f"{r['peak_bytes'] / 2**20:.1f} MiB ({r['cache_bytes'] / 2**20:.2f})")
            else:
                cells.append(f"failed: {r.get('error', '?')[:40]}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
