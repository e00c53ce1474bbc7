"""What one decode step asks of the GPU, on any machine: velox's kernel launches (name, template
constants, grid, threadgroup, input shapes and dtypes) and MLX's graph (primitives by name) of a
few decode steps of a one-layer Llama-3-8B-shaped model (32 query heads, 8 KV heads, head dim
128, bf16), with velox's kernel backend reporting CUDA and every kernel call stubbed (zeroed
outputs of the shapes it asks for), as ``benchmarks/host_profile.py --stub-kernels`` does.

Two trees that write the same record launch the same kernels and build the same graph: a
refactor of the host path is checked for a change in what the device runs without a GPU.

    python3 benchmarks/decode_launches.py --caches uniform:bits=4,turboquant:bits=4 --json a.json
    python3 benchmarks/decode_launches.py --caches uniform:bits=4,turboquant:bits=4 --compare a.json

``--compare`` exits 1 and names the first difference where a cache's record differs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx

from velox_cli.specs import split_specs


def build_model():
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=1,
        intermediate_size=256,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        vocab_size=256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def record(spec: str, context: int, steps: int) -> dict:
    """The launches of ``steps`` decode steps after a ``context``-token prefill, and the graph
    of the step after them (primitive name -> count)."""
    import velox_core
    import velox_core.kernels as vk
    from velox_core.kernels.build import KernelSpec

    model = build_model()
    cache = velox_core.make_cache(model, default=spec)
    prompt = mx.random.randint(0, 256, (1, context))
    launches: list = []
    feeds: list = []  # the last step's kernel inputs: their graphs belong to the step's

    def stub_for(kspec):
        def stub(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, **_):
            feeds.extend(a for a in inputs if isinstance(a, mx.array))
            launches[-1].append(
                {
                    "kernel": kspec.name,
                    "template": [[k, str(v)] for k, v in (template or ())],
                    "grid": list(grid),
                    "threadgroup": list(threadgroup),
                    "inputs": [[list(a.shape), str(a.dtype)] for a in inputs],
                }
            )
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return stub

    backend, kernel = vk.backend, KernelSpec.kernel
    try:
        with velox_core.routed(model):
            for i in range(0, context, 2048):
                model(prompt[:, i : i + 2048], cache=cache)
                mx.eval([c.state for c in cache])
            vk.backend = lambda: "cuda"
            KernelSpec.kernel = lambda self: stub_for(self)
            tok = mx.array([[5]])
            for _ in range(steps):
                launches.append([])
                y = model(tok, cache=cache)
                mx.eval(y, [c.state for c in cache])
            feeds.clear()
            launches.append([])  # the graph's step: its launches are recorded too
            y = model(tok, cache=cache)
            with tempfile.TemporaryDirectory() as d:
                dot = Path(d) / "step.dot"
                mx.export_to_dot(str(dot), y, *feeds)
                ops = Counter(re.findall(r'label ="([A-Za-z_]+)', dot.read_text()))
    finally:
        vk.backend, KernelSpec.kernel = backend, kernel
    return {"launches": launches, "graph": dict(sorted(ops.items()))}


def first_difference(a: dict, b: dict) -> str | None:
    """Where two records of one cache differ first, in words, or None."""
    if a["graph"] != b["graph"]:
        keys = sorted(set(a["graph"]) | set(b["graph"]))
        diff = [
            f"{k} {a['graph'].get(k, 0)} -> {b['graph'].get(k, 0)}"
            for k in keys
            if a["graph"].get(k) != b["graph"].get(k)
        ]
        return "graph: " + ", ".join(diff)
    if len(a["launches"]) != len(b["launches"]):
        return f"steps: {len(a['launches'])} -> {len(b['launches'])}"
    for i, (sa, sb) in enumerate(zip(a["launches"], b["launches"], strict=True)):
        if len(sa) != len(sb):
            return f"step {i}: {len(sa)} launches -> {len(sb)}"
        for j, (la, lb) in enumerate(zip(sa, sb, strict=True)):
            for field in ("kernel", "template", "grid", "threadgroup", "inputs"):
                if la[field] != lb[field]:
                    where = f"step {i}, launch {j} ({la['kernel']})"
                    return f"{where}: {field} {la[field]} -> {lb[field]}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--caches", default="uniform:bits=4,kivi:bits=2,turboquant:bits=4,qjl")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="write the records here")
    p.add_argument("--compare", type=Path, default=None, help="compare with these records")
    args = p.parse_args(argv)
    if args.context < 1 or args.steps < 1:
        p.error("--context and --steps must be positive")
    records = {spec: record(spec, args.context, args.steps) for spec in split_specs(args.caches)}
    for spec, r in records.items():
        kernels = Counter(launch["kernel"] for step in r["launches"] for launch in step)
        print(f"{spec}: {sum(r['graph'].values())} graph nodes, launches {dict(kernels)}")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    if args.compare is None:
        return 0
    other = json.loads(args.compare.read_text())
    bad = 0
    for spec, r in records.items():
        if spec not in other:
            print(f"{spec}: not in {args.compare}")
            continue
        why = first_difference(other[spec], r)
        print(f"{spec}: {'the same launches and graph' if why is None else why}")
        bad += why is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
