"""``velox plan``: which cache settings fit a model and a context in a memory, best quality first.

    velox plan --shape llama3-8b --memory 24GB --context 128k [--batch 4] [--json]
    velox plan --model path/to/mlx-model --memory 64GiB --context 64k --methods fp16 uniform

For each spec (the baselines, every installed method's recommended settings and the specs the
long-context data measured; or ``--methods``): the cache bytes at the context, measured at the
model's KV shape (:mod:`.plan_bytes`), the peak as weights + cache + the prefill's transient
(:func:`.plan_data.transient`), whether it fits, the largest context that fits, and the
long-context quality ``docs/data/eval-*.json`` records (:func:`.plan_data.quality`). docs/plan.md
tells how each number is derived.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["Inputs", "add_parser", "cmd_plan", "parse_memory", "parse_tokens", "plan"]

_UNITS = {"": 1e9, "g": 1e9, "gb": 1e9, "gib": 2**30, "m": 1e6, "mb": 1e6, "mib": 2**20}
_UNITS.update({"t": 1e12, "tb": 1e12, "tib": 2**40})
MAX_CONTEXT = 1 << 24  # the largest context searched
GB = 1e9


def parse_memory(text: str) -> int:
    """``24``, ``24GB``, ``24GiB``, ``512MB``: bytes (a bare number is GB, 10^9 bytes)."""
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d*)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"--memory: {text!r} is not a size (24, 24GB, 24GiB, 512MB)")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if value <= 0:
        raise ValueError(f"--memory must be more than 0, got {text!r}")
    return int(value)


def parse_tokens(text: str, name: str, minimum: int) -> int:
    """``32768``, ``32k``, ``1m`` (k = 1,024 tokens): a count of at least ``minimum``."""
    m = re.fullmatch(r"\s*(-?\d+)\s*([km]?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"{name}: {text!r} is not a token count (32768, 32k, 1m)")
    value = int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2)]
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {text!r}")
    return value


@dataclass
class Inputs:
    shape: str | None
    model: str | None
    memory: int
    context: int
    batch: int = 1
    weights: str = "4bit"
    methods: list[str] | None = None


def _row(curve, q, info, inp: Inputs, rank_length: int) -> dict[str, Any]:
    from .plan_data import method_of, transient

    row: dict[str, Any] = {"spec": curve.spec, "error": curve.error}
    if curve.error:
        return row
    # the tokens a layer holds (its prefill attends them decoded): all of them, a share of
    # them (budget=25%), or a full eviction budget's
    held = curve.held[-1] / curve.layers

    def peak(n: int) -> tuple[float, float, dict]:
        cache = inp.batch * curve.at(n)
        kept = min(n, held) if curve.capped else n * held / curve.tokens[-1]
        terms = transient(
            info.dims(), info.weights_bytes, method_of(curve.spec), kept, n, inp.batch
        )
        return info.weights_bytes + cache + sum(terms.values()), cache, terms

    p, cache, terms = peak(inp.context)
    lo, hi = 0, MAX_CONTEXT  # the largest context whose peak fits: it grows with the context
    if peak(MAX_CONTEXT)[0] <= inp.memory:
        lo = MAX_CONTEXT
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid)[0] <= inp.memory else (lo, mid)
    cell = q.at(rank_length) if q else None
    row.update(
        bytes_per_token=curve.per_token,
        capped=curve.capped,
        cache_bytes=int(cache),
        transient_bytes={k: int(v) for k, v in terms.items()},
        peak_bytes=int(p),
        fits=p <= inp.memory,
        max_context=lo,
        measured_bytes={"tokens": curve.tokens, "bytes": curve.bytes},
        quality=None if q is None else {"cells": {str(k): v for k, v in q.cells.items()}},
        accuracy=None if cell is None else cell["accuracy"],
        low=None if cell is None else cell["low"],
        kl=None if cell is None else cell["kl"],
        prompts=None if cell is None else cell["prompts"],
        measured_ratio=None if cell is None else cell["ratio"],
    )
    return row


def _order(r: dict) -> tuple:
    """Measured first, by the lower end of the accuracy's 95% interval at the ranking length
    (4 prompts at 1.00 rank below 15 at 0.80), then accuracy, then lower KL; unmeasured after,
    in the candidates' order (no quality order is invented for them)."""
    if r.get("accuracy") is None:
        return (1, 0.0, 0.0, 0.0)
    kl = r["kl"] if r["kl"] is not None else float("inf")
    return (0, -(r["low"] or 0.0), -r["accuracy"], kl)


def _recommend(rows: list[dict], inp: Inputs, info) -> dict[str, Any]:
    ok = [r for r in rows if not r["error"]]
    fits = [r for r in ok if r["fits"]]
    if not fits:
        best = max(ok, key=lambda r: r["max_context"], default=None)
        if best is None or best["max_context"] == 0:
            weights = f"{info.weights_bytes / GB:.2f} GB"
            why = f"the weights ({weights}) and the prefill's transient alone pass the memory"
            return {"spec": None, "reason": f"nothing fits: {why}"}
        reach = f"{best['spec']} reaches {best['max_context']:,} tokens"
        return {"spec": None, "reason": f"no setting fits {inp.context:,} tokens; {reach}"}
    fp16 = next((r for r in fits if r["spec"] == "fp16"), None)
    if fp16 is not None:
        return {"spec": "fp16", "reason": "the uncompressed cache fits: nothing to gain"}
    measured = [r for r in fits if r["accuracy"] is not None]
    if not measured:
        return {"spec": None, "reason": "settings fit, but none has measured quality"}
    pick = min(measured, key=_order)
    acc = f"{pick['accuracy']:.2f} on {pick['prompts']} prompts"
    fp16 = 2 * info.dims()["kv"] * 2 * info.kinds.count("KVCache")  # full-attention layers'
    here = fp16 / pick["bytes_per_token"] if pick["bytes_per_token"] else None
    there = pick["measured_ratio"]
    bytes_ = (
        ""
        if not (here and there)
        else f", at {there:.1f}x fewer bytes than fp16 there, {here:.1f}x here"
    )
    why = f"the best measured long-context accuracy that fits ({acc}{bytes_})"
    return {"spec": pick["spec"], "reason": why}


def plan(inp: Inputs, note=None) -> dict[str, Any]:
    """The plan as ``--json`` prints it (docs/plan.md describes every field)."""
    from .longctx.run import spec_check
    from .plan_bytes import curve
    from .plan_data import candidates, canonical, quality
    from .plan_model import model_info

    specs = inp.methods or candidates()
    for s in specs:
        spec_check(s)  # an unknown method or parameter: the registry's error, before any work
    info = model_info(inp.shape, inp.model, inp.weights)
    found, source = quality()
    measured = {canonical(k): v for k, v in found.items()}
    length = source.get("rank_length", 0)
    rows = [
        _row(curve(s, info, note, bool(inp.methods)), measured.get(canonical(s)), info, inp, length)
        for s in specs
    ]
    ok = sorted((r for r in rows if not r["error"]), key=_order)
    return {
        "model": {
            "name": info.name,
            "layers": info.describe(),
            "weights_bytes": info.weights_bytes,
            "weights_from": info.weights_from,
            "max_position_embeddings": info.config.get("max_position_embeddings"),
        },
        "memory_bytes": inp.memory,
        "context": inp.context,
        "batch": inp.batch,
        "quality_source": source,
        "rows": ok + [r for r in rows if r["error"]],
        "recommendation": _recommend(rows, inp, info),
    }


def add_parser(sub) -> None:
    """``velox plan``'s arguments (main.py registers the subcommand with this)."""
    from .plan_model import SHAPES, WEIGHTS

    p = sub.add_parser("plan", help="which cache settings fit a model and a context in memory")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--shape", help=f"a model shape: {', '.join(SHAPES)}")
    who.add_argument("--model", help="a name, an mlx-lm directory or a .gguf")
    p.add_argument("--memory", required=True, help="memory MLX may use: 24, 24GB, 24GiB, 512MB")
    p.add_argument("--context", required=True, help="prompt tokens: 32768, 32k, 1m")
    p.add_argument("--batch", default="1", help="sequences at once (default 1)")
    p.add_argument(
        "--weights", choices=list(WEIGHTS), default="4bit", help="a shape's weights (default 4bit)"
    )
    p.add_argument("--methods", nargs="+", metavar="SPEC", help="only these specs")
    p.add_argument("--all", action="store_true", help="list the settings that do not fit too")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def cmd_plan(a) -> int:
    """``velox plan``: every argument checked before any work."""
    from .plan_table import render

    inp = Inputs(
        a.shape,
        a.model,
        parse_memory(a.memory),
        parse_tokens(a.context, "--context", 1),
        parse_tokens(a.batch, "--batch", 1),
        a.weights,
        a.methods,
    )

    def note(spec: str) -> None:
        print(f"velox plan: measuring {spec} at this shape", file=sys.stderr, flush=True)

    result = plan(inp, note=note)
    print(json.dumps(result, indent=1) if a.json else render(result, everything=a.all))
    return 0
