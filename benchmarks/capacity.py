"""Capacity: the longest context each cache runs in a memory budget, weights included.

For each model shape, budget and cache, real runs find the largest prompt that can be
prefilled and then decode ``--decode`` tokens while MLX's peak memory of the whole run
(``mx.get_peak_memory()`` after ``mx.reset_peak_memory()``; the model's weights are active
memory, so they count, as on a Mac whose GPU shares one memory with everything else) stays
within the budget. Each run is one probe, as ``benchmarks/e2e.py`` runs a row: a model of the
shape with random weights (``e2e.build_model``), caches built as ``velox bench`` builds them
(``velox_cli.specs.build_caches``: ``velox_core.make_cache`` with the spec string, mlx-lm's
``KVCache`` for ``fp16``, its ``QuantizedKVCache`` for ``mlx-q4``), the prompt prefilled in
chunks of ``--chunk`` tokens with each chunk's cache state evaluated, then mlx-lm's own
``generate_step`` for the decoded tokens, attention routed to velox.

The search, per shape, budget and cache:

- a probe stops as soon as the peak passes the budget (checked after each prefill chunk and
  each decoded token): a probe that does not fit costs only the tokens run until then, and,
  the prefill being chunked from the first token on, every longer prompt runs the same chunks,
  so every context above the tokens it ran does not fit either;
- bracket: from ``--start`` tokens up, each probe aims where a line through the peaks of the
  two longest probes that fit (or through the weights and the one probe) meets the budget,
  until a probe does not fit or ``--max-context`` fits;
- bisect: the bracket [longest fit, shortest misfit] shrinks until it is no wider than the
  tolerance (``--tolerance``: a fraction of the context, or tokens); each split sits where the
  same line meets the budget, a plain midpoint after a split that did not halve the bracket.
  Probes that ran to the end are kept per shape and cache and reused for the next budget.

A row reports the context reached, the peak and decode tokens per second of its probe, the
shortest context seen not to fit, and its ratio to fp16's context at the same budget. Targets
(issue 52): a velox 4-bit cache reaches at least 3.5 times fp16's context, a 2-bit one 6 times,
each decoding at least as fast at its context as fp16 does at fp16's own: the table says, from
the rows, whether each holds.

Probes run in this process one after another (``--isolate process`` runs each in a fresh
one): before each, the previous probe's arrays are dropped, ``mx.clear_cache()`` frees MLX's
buffer cache and the peak is reset; each probe records the active memory it started from, and
the run warns if that grows past the weights between probes.

``budget=P%`` in a spec (``snapkv:budget=25%+uniform:bits=4``: SnapKV keeps a quarter of the
prompt, stored as uniform 4-bit codes) is resolved per probe to that share of its context.

    python3 benchmarks/capacity.py --shapes llama3-8b --budgets 16,24 \\
        --caches fp16,uniform:bits=4,uniform:bits=2 --json docs/data/capacity.json
    python3 benchmarks/capacity.py --tiny --json out/capacity-tiny.json   # CPU, MiB budgets
    python3 benchmarks/capacity.py --merge a.json b.json --json all.json  # runs joined

``--merge`` runs nothing: it joins the rows of several ``--json`` files (a long search split
over several commands) and recomputes the ratios and targets over them.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from velox_cli.plan_shapes import SHAPES as PLAN_SHAPES
from velox_cli.specs import split_specs

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e

# Shapes beyond e2e.py's (velox plan's table), registered in its table so that
# e2e.build_model builds them too: Llama 3.1 70B, and --tiny's CPU run in MiB budgets (sixteen
# layers of one 128-wide KV head: one layer's keys and values, what the CPU prefill decodes
# to float32 at a time, and one chunk's attention scores stay small beside the whole cache)
EXTRA_SHAPES: dict[str, dict[str, Any]] = {
    name: PLAN_SHAPES[name] for name in ("llama3-70b", "tiny")
}
for _name, _cfg in EXTRA_SHAPES.items():
    e2e.SHAPES.setdefault(_name, _cfg)
SHAPES = e2e.SHAPES

DEFAULT_SHAPES = "llama3-8b,qwen2.5-7b,llama3-70b"
DEFAULT_BUDGETS = "16,24,36,64,128"
DEFAULT_CACHES = (
    "fp16,mlx-q4,uniform:bits=4,uniform:bits=2,kivi:bits=2,turboquant:bits=3.5,"
    "turboquant:bits=4,snapkv:budget=25%+uniform:bits=4"
)
TINY = {
    "shapes": "tiny",
    "weights": "fp32",
    "budgets": "6M,8M",
    "caches": DEFAULT_CACHES,
    "decode": 32,
    "chunk": 64,
    "start": 256,
    "max_context": 2048,
}
# issue 52: a velox cache of these bits reaches this many times fp16's context, decoding at
# least as fast at it as fp16 at its own
TARGETS = {4.0: 3.5, 2.0: 6.0}
MIN_CONTEXT = 16  # below this no probe is run: the budget does not fit
GiB, MiB = 2**30, 2**20


# ---------------------------------------------------------------- arguments


def parse_size(text: str) -> int:
    """A budget: ``16``, ``16G``, ``16GiB`` (GiB, as a Mac's memory size is counted) or
    ``300M`` / ``300MiB`` (MiB), in bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(g|gb|gib|m|mb|mib)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"a budget is a number of GiB (16, 16G) or MiB (300M), got {text!r}")
    value = float(m.group(1))
    unit = MiB if (m.group(2) or "g").lower().startswith("m") else GiB
    if value <= 0:
        raise ValueError(f"a budget must be above 0, got {text!r}")
    return int(value * unit)


def size_label(nbytes: int, digits: int | None = None) -> str:
    """``16 GiB`` / ``300 MiB`` (``digits`` decimals, else as short as exact)."""
    value, unit = (nbytes / GiB, "GiB") if nbytes >= GiB else (nbytes / MiB, "MiB")
    return f"{value:g} {unit}" if digits is None else f"{value:.{digits}f} {unit}"


def parse_tolerance(text: str) -> tuple[float, int]:
    """``1/32`` or ``0.03`` (a fraction of the context) or ``256`` (tokens):
    (fraction, tokens), one of them 0."""
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            value = float(num) / float(den)
        else:
            value = float(text)
    except (ValueError, ZeroDivisionError):
        raise SystemExit(
            f"--tolerance must be a fraction (1/32, 0.05) or tokens, got {text!r}"
        ) from None
    if value <= 0:
        raise SystemExit(f"--tolerance must be above 0, got {text!r}")
    if value < 1:
        return value, 0
    if value != int(value):
        raise SystemExit(f"--tolerance in tokens must be a whole number, got {text!r}")
    return 0.0, int(value)


# ---------------------------------------------------------------- caches


PERCENT = re.compile(r"budget=(\d+(?:\.\d+)?)%")


def resolve(spec: str, context: int) -> str:
    """``spec`` with each ``budget=P%`` replaced by P percent of ``context`` tokens."""
    return PERCENT.sub(
        lambda m: f"budget={max(MIN_CONTEXT, math.ceil(float(m.group(1)) / 100 * context))}", spec
    )


def relative(spec: str) -> bool:
    """Whether the spec's cache depends on the context (a ``budget=P%``)."""
    return PERCENT.search(spec) is not None


def storage(weights: str):
    """The dtype caches store: float16 under fp32 weights (the CPU), else the model's."""
    return mx.float16 if weights == "fp32" else None


def build_caches(model, spec: str, context: int, weights: str) -> list:
    from velox_cli.specs import build_caches as build
    from velox_cli.specs import parse

    return build(parse(resolve(spec, context)), model, storage(weights))


def target_bits(spec: str) -> float | None:
    """The bits a velox quantizer spec stores, where issue 52 sets a target for them."""
    from velox_core import parse_spec

    if spec in ("fp16",) or spec.startswith("mlx-q") or "+" in spec:
        return None
    try:
        _, params = parse_spec(spec)
    except ValueError:
        return None
    if "budget" in params or "bits" not in params:
        return None
    bits = float(params["bits"])
    return bits if bits in TARGETS else None


# ---------------------------------------------------------------- one probe


@dataclass
class Probe:
    """One run of ``context`` prompt tokens plus the decoded ones."""

    context: int
    peak_bytes: int
    fits: bool
    base_bytes: int
    seconds: float
    stopped: str | None = None  # "prefill" / "decode" where the peak passed the budget
    stopped_at: int | None = None  # prompt tokens prefilled (or tokens decoded) by then
    prefill_s: float | None = None
    decode_tok_s: float | None = None
    cache_bytes: int | None = None
    reused: bool = False  # a finished probe of an earlier budget, not run again
    fill: str = "model"  # "direct": the prompt's first tokens written, not prefilled
    fill_s: float | None = None

    def over_from(self, spec: str) -> int:
        """The shortest context this probe shows not to fit: a prompt longer than the tokens
        a stopped prefill ran runs the same chunks first (unless the cache depends on the
        context)."""
        if self.stopped == "prefill" and not relative(spec) and self.stopped_at is not None:
            return min(self.context, self.stopped_at + 1)
        return self.context

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def direct_tokens(caches: list, context: int, args) -> int:
    """``--fill direct``: how many of the prompt's first tokens are written into the caches
    instead of prefilled (0 where the model prefills them all).

    The prefill's last two chunks always run through the model: a chunk's transients (its
    attention over every stored token among them) only grow with the tokens stored before it,
    and the last chunk may be a short one, so the peak of a whole prefill is that of one of
    its last two chunks. A cache that selects tokens from what the model attends (an eviction
    policy) is always prefilled by the model."""
    if getattr(args, "fill", "model") != "direct":
        return 0
    if any(getattr(c, "policy", None) is not None for c in caches):
        return 0
    starts = list(range(0, context - 1, args.chunk))  # the prefill's chunks, as probe runs them
    return starts[-2] if len(starts) > 2 else 0


def kv_layout(model, shape: str) -> tuple[int, int, mx.Dtype]:
    """(KV heads, head dim, dtype) of the keys and values the shape's layers store."""
    cfg = SHAPES[shape]
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = model.model.embed_tokens(mx.array([[0]])).dtype
    return heads, dim, dtype


def fill_directly(model, caches: list, tokens: int, budget: int, args) -> int:
    """Write ``tokens`` tokens of random keys and values into every layer's cache, in the
    prefill's chunks and through each cache's own ``update_and_fetch`` (under velox's routing,
    as the model's attention stores them), each layer's state evaluated before the next layer
    stores (the model's layers depend on each other; written apart, every layer's growth of a
    chunk would otherwise be evaluated at once): the caches
    then hold what a prefill of that many tokens stores, in the same steps, without the
    model's compute. Stops once MLX's peak passes ``budget``; returns the tokens written."""
    heads, dim, dtype = kv_layout(model, args.shape)
    key = mx.random.key(args.seed + 1)
    done = 0
    while done < tokens:
        n = min(args.chunk, tokens - done)
        key, sub = mx.random.split(key)
        kv = mx.random.normal((2, 1, heads, n, dim), key=sub).astype(dtype)
        for c in caches:  # layer by layer, as the model's layers store one after another
            c.update_and_fetch(kv[0], kv[1])
            mx.eval(c.state)
        del kv
        done += n
        mx.clear_cache()
        if mx.get_peak_memory() > budget:
            break
    return done


def probe(model, spec: str, context: int, budget: int, args) -> Probe:
    """Run ``context`` prompt tokens and ``args.decode`` decoded ones with ``spec``'s caches,
    stopping once MLX's peak passes ``budget`` (a run's peak only grows)."""
    from mlx_lm.generate import generate_step

    import velox_core

    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    vocab = SHAPES[args.shape]["vocab_size"]
    t0 = time.perf_counter()
    prompt = mx.random.randint(0, vocab, (1, context), key=mx.random.key(args.seed))
    mx.eval(prompt)
    caches = build_caches(model, spec, context, args.weights)
    out = Probe(context, 0, False, base, 0.0)
    gen = None
    try:
        with velox_core.routed(model):
            done = 0
            direct = direct_tokens(caches, context, args)
            if direct:
                out.fill = "direct"
                done = fill_directly(model, caches, direct, budget, args)
                out.fill_s = time.perf_counter() - t0
                if done < direct:
                    out.stopped, out.stopped_at = "prefill", done
            while out.stopped is None and context - done > 1:  # the last token is left
                n = min(args.chunk, context - done - 1)
                model(prompt[:, done : done + n], cache=caches)
                mx.eval([c.state for c in caches])
                done += n
                mx.clear_cache()
                if mx.get_peak_memory() > budget:
                    out.stopped, out.stopped_at = "prefill", done
                    break
            if out.stopped is None:
                out.prefill_s = time.perf_counter() - t0
                out.cache_bytes = e2e.cache_bytes(caches)
                gen = generate_step(
                    prompt[0, -1:], model, max_tokens=args.decode, prompt_cache=caches
                )
                count, start = 0, time.perf_counter()
                for _ in gen:
                    count += 1
                    if count == 1:  # the rate's clock starts at the first token (e2e.py's)
                        start = time.perf_counter()
                    if mx.get_peak_memory() > budget:
                        out.stopped, out.stopped_at = "decode", count
                        break
                if out.stopped is None and count > 1:
                    out.decode_tok_s = (count - 1) / (time.perf_counter() - start)
    finally:
        if gen is not None:
            gen.close()
        out.peak_bytes = mx.get_peak_memory()
        out.fits = out.stopped is None and out.peak_bytes <= budget
        out.seconds = time.perf_counter() - t0
        del caches, prompt, gen
        gc.collect()
        mx.clear_cache()
    return out


def probe_in_subprocess(spec: str, context: int, budget: int, args) -> Probe:
    """:func:`probe` in a fresh Python process that builds the model itself."""
    job = {
        "shape": args.shape,
        "weights": args.weights,
        "spec": spec,
        "context": context,
        "budget": budget,
        "decode": args.decode,
        "chunk": args.chunk,
        "seed": args.seed,
        "fill": args.fill,
    }
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe-json", json.dumps(job)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"probe process failed ({res.returncode}): {tail}")
    data = json.loads(lines[-1])
    if "error" in data:
        raise RuntimeError(data["error"])
    return Probe(**data)


def probe_main(job_text: str) -> int:
    """``--probe-json``: one probe in this process, its fields printed as one JSON line."""
    job = json.loads(job_text)
    args = argparse.Namespace(**job)
    try:
        model = e2e.build_model(job["shape"], job["weights"])
        result = probe(model, job["spec"], job["context"], job["budget"], args).as_dict()
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------- the search


@dataclass
class Search:
    """The probes of one shape and cache, shared by its budgets."""

    spec: str
    weights_bytes: int
    done: dict[int, Probe] = field(default_factory=dict)  # probes that ran to the end


def tolerance(context: int, args) -> int:
    frac, tokens = args.tol
    return max(1, tokens if tokens else math.ceil(frac * context))


def estimate(search: Search, budget: int, below: int | None = None) -> float:
    """The context where a line through the peaks of the two longest finished probes that fit
    (under ``below``), or through the weights and one such probe, meets ``budget``."""
    fits = sorted(
        (p for p in search.done.values() if p.peak_bytes <= budget),
        key=lambda p: p.context,
    )
    if below is not None:
        fits = [p for p in fits if p.context < below]
    pts = [(float(p.context), float(p.peak_bytes)) for p in fits[-2:]]
    if len(pts) < 2:
        pts.insert(0, (0.0, float(search.weights_bytes)))
    (c0, p0), (c1, p1) = pts[-2], pts[-1]
    if p1 <= p0 or c1 <= c0:
        return math.inf
    return c1 + (budget - p1) * (c1 - c0) / (p1 - p0)


def find(model, search: Search, budget: int, args, log) -> dict[str, Any]:
    """The largest context of ``search.spec`` within ``budget``: the row's search fields."""
    spec = search.spec
    probes: list[Probe] = []

    def reuse(p: Probe) -> Probe:
        p = replace(p, fits=p.peak_bytes <= budget, reused=True)
        probes.append(p)
        return p

    def run(context: int) -> Probe:
        context = int(context)
        if context in search.done:
            return reuse(search.done[context])
        if args.isolate == "process":
            p = probe_in_subprocess(spec, context, budget, args)
        else:
            p = probe(model, spec, context, budget, args)
        if p.stopped is None:
            search.done[context] = p
        probes.append(p)
        leak = p.base_bytes - search.weights_bytes
        log(
            f"  {spec} @ {size_label(budget)}: {context} tokens -> "
            f"{'fits' if p.fits else 'over'}, peak {p.peak_bytes / MiB:.1f} MiB"
            + (f" (stopped in {p.stopped} at {p.stopped_at})" if p.stopped else "")
            + f", {p.seconds:.1f} s"
        )
        if args.isolate == "none" and leak > max(args.leak_warn * budget, 0):
            log(f"  warning: a probe started {leak / MiB:.1f} MiB above the weights")
        return p

    # the longest finished probe known to fit, and the shortest context known not to
    fitting = [p for p in search.done.values() if p.peak_bytes <= budget]
    lo = reuse(max(fitting, key=lambda p: p.context)) if fitting else None
    misfit = [p for p in search.done.values() if p.peak_bytes > budget]
    hi = reuse(min(misfit, key=lambda p: p.context)).context if misfit else None
    if lo is None:
        first = run(min(args.start, args.max_context))
        if first.fits:
            lo = first
        else:
            hi = first.over_from(spec)
    last_width = None
    while True:
        lo_c = lo.context if lo is not None else 0
        if lo_c >= args.max_context:
            break
        if hi is None:  # bracket: aim where the line meets the budget, at least one step up
            est = estimate(search, budget)
            step = tolerance(lo_c, args)
            aim = est - step / 2 if math.isfinite(est) else args.max_context
            c = min(args.max_context, max(lo_c + step, aim, lo_c * 1.25))
            if not math.isfinite(est):
                c = min(args.max_context, max(lo_c * 4, lo_c + step))
        else:
            if lo is None and hi <= MIN_CONTEXT:
                break
            width = hi - lo_c
            tol = tolerance(max(lo_c, 1), args)
            if width <= tol:
                break
            est = estimate(search, budget, below=hi) if lo is not None else math.inf
            if last_width is not None and width > last_width / 2:
                c = lo_c + width / 2  # the last split did not halve the bracket
            elif not math.isfinite(est) or est <= lo_c or est >= hi:
                c = lo_c + width / 2
            elif est - lo_c < tol:
                c = lo_c + tol  # just above the longest fit: likely closes the bracket
            elif hi - est < tol:
                c = hi - tol
            else:
                c = est
            c = min(max(int(c), lo_c + 1, MIN_CONTEXT), hi - 1)
            if c <= lo_c or c >= hi:
                break
            last_width = width
        p = run(int(c))
        if p.fits:
            lo = p
        else:
            hi = min(hi or p.context, p.over_from(spec))
            if lo is not None:
                hi = max(hi, lo.context + 1)
    out: dict[str, Any] = {"probes": [p.as_dict() for p in probes]}
    if lo is None:
        out["status"] = "does not fit"
        least = min(probes, key=lambda p: p.context) if probes else None
        out["reason"] = f"no context of {MIN_CONTEXT} tokens or more fits" + (
            f" ({least.context} tokens: peak {size_label(least.peak_bytes, 2)})"
            if least is not None
            else ""
        )
        return out
    out.update(
        status="ok",
        context=lo.context,
        peak_bytes=lo.peak_bytes,
        decode_tok_s=lo.decode_tok_s,
        prefill_s=lo.prefill_s,
        cache_bytes=lo.cache_bytes,
        base_bytes=lo.base_bytes,
        next_over=hi,
        tolerance_tokens=tolerance(lo.context, args),
        capped=lo.context >= args.max_context,
    )
    return out


# ---------------------------------------------------------------- ratios and targets


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's context and decode rate against fp16's at the same shape and budget, and
    the issue-52 target where one applies (computed here from the rows)."""
    fp16 = {
        (r["shape"], r["budget_bytes"]): r
        for r in rows
        if r["cache"] == "fp16" and r["status"] == "ok"
    }
    for r in rows:
        if r["status"] != "ok":
            continue
        ref = fp16.get((r["shape"], r["budget_bytes"]))
        bits = target_bits(r["cache"])
        if bits is not None:
            r["target"] = {"bits": bits, "context_x_fp16": TARGETS[bits]}
        if ref is None:
            if bits is not None:
                r["target"].update(met=None, why="no fp16 context at this budget")
            continue
        ratio = r["context"] / ref["context"]
        # a capped context is a lower bound: the ratio is bounded, not measured
        bound = {(False, False): "=", (True, False): ">=", (False, True): "<=", (True, True): "?"}
        r["x_fp16_context"] = ratio
        r["x_fp16_bound"] = bound[(r["capped"], ref["capped"])]
        if r.get("decode_tok_s") and ref.get("decode_tok_s"):
            r["x_fp16_decode"] = r["decode_tok_s"] / ref["decode_tok_s"]
        if bits is None:
            continue
        t = r["target"]
        need = TARGETS[bits]
        if r["x_fp16_bound"] in ("=", ">=") and ratio >= need:
            t["context_met"] = True
        elif r["x_fp16_bound"] in ("=", "<=") and ratio < need:
            t["context_met"] = False
        else:
            t["context_met"] = None
        t["decode_met"] = None if "x_fp16_decode" not in r else r["x_fp16_decode"] >= 1.0
        if t["context_met"] is False or t["decode_met"] is False:
            t["met"] = False
        elif t["context_met"] and t["decode_met"]:
            t["met"] = True
        else:
            t["met"] = None
            t["why"] = (
                "the search reached --max-context"
                if t["context_met"] is None
                else "no decode rate to compare"
            )


def verdict(r: dict[str, Any]) -> str:
    t = r.get("target")
    if t is None:
        return ""
    head = f">= {t['context_x_fp16']:g}x fp16's context at >= its decode rate: "
    if t.get("met") is True:
        return head + "met"
    if t.get("met") is False:
        parts = []
        if t.get("context_met") is False:
            parts.append("context short")
        if t.get("decode_met") is False:
            parts.append("decode slower")
        return head + "not met (" + ", ".join(parts) + ")"
    return head + "undetermined" + (f" ({t['why']})" if t.get("why") else "")


# ---------------------------------------------------------------- output

# how a ratio reads: measured, or bounded where a context reached --max-context
BOUND = {"=": "", ">=": ">= ", "<=": "<= ", "?": "? "}


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| shape | budget | cache | context | x fp16 | peak | decode tok/s | x fp16 "
        "| next over | probes | target |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        pre = f"| {r['shape']} | {size_label(r['budget_bytes'])} | {r['cache']} "
        if r["status"] != "ok":
            lines.append(pre + f"| {r['status']}: {r.get('reason', '')} |" + " |" * 7)
            continue
        ctx = f"{r['context']:,}" + (" (max)" if r["capped"] else "")
        ratio = ""
        if "x_fp16_context" in r:
            ratio = f"{BOUND[r['x_fp16_bound']]}{r['x_fp16_context']:.2f}"
        rate = "" if r.get("decode_tok_s") is None else f"{r['decode_tok_s']:.1f}"
        xrate = "" if "x_fp16_decode" not in r else f"{r['x_fp16_decode']:.2f}"
        over = "" if r.get("next_over") is None else f"{r['next_over']:,}"
        lines.append(
            pre + f"| {ctx} | {ratio} | {size_label(r['peak_bytes'], 2)} | {rate} | {xrate} "
            f"| {over} | {len(r['probes'])} | {verdict(r)} |"
        )
    return "\n".join(lines)


def targets_summary(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if "target" not in r:
            continue
        ratio = r.get("x_fp16_context")
        rate = r.get("x_fp16_decode")
        said = [f"{r['shape']} {size_label(r['budget_bytes'])} {r['cache']}:"]
        if ratio is not None:
            said.append(f"context {BOUND[r['x_fp16_bound']]}{ratio:.2f}x fp16's")
        if rate is not None:
            said.append(f"decode {rate:.2f}x fp16's at its own context")
        said.append("-> " + verdict(r))
        out.append(" ".join(said))
    return out


def draw_chart(path: Path, rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """Bars of the context reached: one panel per shape, one bar group per cache, one bar per
    budget (log scale); a capped bar is hatched, a budget that does not fit is marked x."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from velox_cli.chart import FAMILIES, family

    fmt = path.suffix.lstrip(".").lower() or "png"
    allowed = FigureCanvasAgg.get_supported_filetypes()
    if fmt not in allowed:
        raise SystemExit(f"--chart {path}: suffix {fmt!r} is not one of {', '.join(allowed)}")
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    budgets = sorted({r["budget_bytes"] for r in rows})
    fig = Figure(figsize=(max(8.0, 0.4 * len(caches) * len(budgets) + 3), 4.2 * len(shapes)))
    FigureCanvasAgg(fig)
    cmap = colormaps["viridis"]
    colours = [cmap(0.15 + 0.7 * i / max(1, len(budgets) - 1)) for i in range(len(budgets))]
    width = 0.8 / max(1, len(budgets))
    for k, shape in enumerate(shapes):
        ax = fig.add_subplot(len(shapes), 1, k + 1)
        ax.set_yscale("log")
        mine = {(r["cache"], r["budget_bytes"]): r for r in rows if r["shape"] == shape}
        reached = [r["context"] for r in mine.values() if r["status"] == "ok"] or [1]
        floor = 10.0 ** math.floor(math.log10(max(1.0, min(reached) / 3)))
        top = max(reached)
        for i, cache in enumerate(caches):
            for j, b in enumerate(budgets):
                r = mine.get((cache, b))
                x = i - 0.4 + width * (j + 0.5)
                if r is None:
                    continue
                if r["status"] != "ok":
                    mark = "x" if r["status"] == "does not fit" else "s"
                    ax.plot([x], [floor], marker=mark, color="0.4", ms=5, clip_on=False)
                    continue
                ax.bar(
                    x,
                    r["context"],
                    width * 0.95,
                    color=colours[j],
                    hatch="//" if r["capped"] else None,
                    edgecolor="white",
                )
                label = (
                    f"{r['context'] / 1000:.0f}k" if r["context"] >= 10000 else str(r["context"])
                )
                if "x_fp16_context" in r and cache != "fp16":
                    label += f"\n{BOUND[r['x_fp16_bound']]}{r['x_fp16_context']:.1f}x"
                ax.text(x, r["context"] * 1.05, label, ha="center", va="bottom", fontsize=6)
        ax.set_ylim(floor, top * 4)
        ax.set_xticks(range(len(caches)))
        ax.set_xticklabels(caches, rotation=20, ha="right", fontsize=8)
        for tick, cache in zip(ax.get_xticklabels(), caches, strict=True):
            tick.set_color(FAMILIES[family(cache.split("+")[0])])
        ax.set_ylabel("context reached (tokens)")
        ax.set_title(
            f"{shape} ({info.get('weights', '')} weights): longest context within each budget, "
            f"prefill + {info.get('decode') or 'its'} decoded tokens, weights included",
            fontsize=9,
        )
        ax.grid(True, axis="y", alpha=0.3)
        handles = [Patch(color=colours[j], label=size_label(b)) for j, b in enumerate(budgets)]
        handles.append(
            Patch(facecolor="white", edgecolor="0.3", hatch="//", label="reached --max-context")
        )
        ax.legend(handles=handles, fontsize=7, loc="upper left", ncol=len(handles))
    fig.text(
        0.01,
        0.005,
        "x: the budget does not fit (the weights, or the shortest probe); square: skipped or "
        "not measured. "
        f"Device: {info.get('device') or 'not recorded'}; MLX {info.get('mlx') or 'not recorded'}.",
        fontsize=7,
        color="0.3",
    )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110, format=fmt)


# ---------------------------------------------------------------- main


def weights_nbytes(shape: str, weights: str) -> int:
    """The bytes of ``shape``'s weights in ``weights``, from the unevaluated arrays (nothing
    is allocated: a shape too large for this machine is still sized)."""
    cfg = dict(SHAPES[shape])
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32 if weights == "fp32" else mx.bfloat16)
    if weights == "4bit":
        nn.quantize(model, group_size=64, bits=4)
    return int(sum(v.nbytes for _, v in tree_flatten(model.parameters())))


def device_memory() -> int | None:
    """The memory MLX's device can use: the GPU's, or the machine's on the CPU."""
    info = mx.device_info()
    for key in ("memory_size", "total_memory"):  # Metal's, CUDA's
        if info.get(key):
            return int(info[key])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def skipped(shape, weights, budget, spec, status, reason) -> dict[str, Any]:
    return {
        "shape": shape,
        "weights": weights,
        "budget_bytes": budget,
        "cache": spec,
        "status": status,
        "reason": reason,
        "probes": [],
    }


def checkpoint(args, rows: list[dict[str, Any]]) -> None:
    """With ``--json``, the rows found so far in ``<json>.partial`` after each row (a run
    stopped by a time limit keeps them; ``--merge`` reads the file)."""
    if args.json is None:
        return
    done = [*getattr(args, "rows_before", []), *rows]
    path = args.json.with_name(args.json.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"partial": True, "device": str(mx.default_device()), "mlx": mx.__version__}
    info.update(weights=args.weights, decode=args.decode, fill=getattr(args, "fill", "model"))
    path.write_text(json.dumps({"info": info, "rows": done}, indent=1) + "\n")


def run_shape(shape: str, budgets: list[int], specs: list[str], args, log) -> list[dict]:
    rows: list[dict[str, Any]] = []
    args.shape = shape
    wbytes = weights_nbytes(shape, args.weights)
    memory = device_memory()
    log(f"{shape} ({args.weights} weights): {size_label(wbytes, 2)} of weights")
    usable = [b for b in budgets if b > wbytes and (memory is None or b <= 0.95 * memory)]
    model = None
    weights_bytes = wbytes
    if usable:
        t0 = time.perf_counter()
        model = e2e.build_model(shape, args.weights)
        gc.collect()
        mx.clear_cache()
        weights_bytes = mx.get_active_memory()
        log(f"  built in {time.perf_counter() - t0:.1f} s, {size_label(weights_bytes, 2)} active")
    searches = {spec: Search(spec, weights_bytes) for spec in specs}
    reasons: dict[str, str] = {}
    for spec in specs:
        try:
            from velox_cli.specs import parse

            parse(resolve(spec, args.start))
        except Exception as exc:
            reasons[spec] = f"{type(exc).__name__}: {exc}"
    for budget in budgets:
        for spec in specs:
            row_head = (shape, args.weights, budget, spec)
            if wbytes >= budget:
                why = f"the weights alone take {size_label(wbytes, 2)}"
                rows.append(skipped(*row_head, "does not fit", why))
                continue
            if memory is not None and budget > 0.95 * memory:
                why = f"the budget is above this device's memory ({size_label(memory, 1)})"
                rows.append(skipped(*row_head, "not measured", why))
                continue
            if spec in reasons:
                rows.append(skipped(*row_head, "skipped", reasons[spec]))
                continue
            row: dict[str, Any] = {
                "shape": shape,
                "weights": args.weights,
                "budget_bytes": budget,
                "cache": spec,
                "weights_bytes": weights_bytes,
            }
            t0 = time.perf_counter()
            try:
                row.update(find(model, searches[spec], budget, args, log))
            except Exception as exc:
                print(traceback.format_exc(), file=sys.stderr)
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
                if not searches[spec].done:  # not one probe ran: the backend cannot run it
                    reasons[spec] = reason
                    row.update(status="skipped", reason=reason, probes=[])
                else:
                    row.update(status="error", reason=reason, probes=[])
            row["search_s"] = time.perf_counter() - t0
            rows.append(row)
            checkpoint(args, rows)
            if row["status"] == "ok":
                log(
                    f"  {spec} @ {size_label(budget)}: {row['context']:,} tokens, peak "
                    f"{size_label(row['peak_bytes'], 2)}, {len(row['probes'])} probes, "
                    f"{row['search_s']:.1f} s"
                )
    del model
    gc.collect()
    mx.clear_cache()
    return rows


def fill_check(shapes: list[str], specs: list[str], contexts: list[int], args, log) -> int:
    """``--fill-check``: each cache at each context run twice, its prompt prefilled by the
    model and then with ``--fill direct``, no budget: how far the direct fill's peak, cache
    bytes and decode rate are from a whole prefill's."""
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        args.shape = shape
        model = e2e.build_model(shape, args.weights)
        for spec in specs:
            for context in contexts:
                row: dict[str, Any] = {"shape": shape, "cache": spec, "context": context}
                for fill in ("model", "direct"):
                    args.fill = fill
                    p = probe(model, spec, context, 1 << 62, args)
                    row[fill] = p.as_dict()
                m, d = row["model"], row["direct"]
                row["peak_ratio"] = d["peak_bytes"] / m["peak_bytes"]
                rows.append(row)
                log(
                    f"  {shape} {spec} {context}: peak {m['peak_bytes'] / MiB:.1f} MiB "
                    f"(model, {m['seconds']:.1f} s) / {d['peak_bytes'] / MiB:.1f} MiB "
                    f"({d['fill']}, {d['seconds']:.1f} s): x{row['peak_ratio']:.4f}"
                )
        del model
        gc.collect()
        mx.clear_cache()
    head = "| shape | cache | context | peak, model fill | peak, direct | ratio |"
    head += " cache bytes equal | decode tok/s model / direct | seconds model / direct |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        m, d = r["model"], r["direct"]
        lines.append(
            f"| {r['shape']} | {r['cache']} | {r['context']:,} | "
            f"{size_label(m['peak_bytes'], 3)} | {size_label(d['peak_bytes'], 3)} | "
            f"{r['peak_ratio']:.4f} | {m.get('cache_bytes') == d.get('cache_bytes')} | "
            f"{m.get('decode_tok_s', 0):.1f} / {d.get('decode_tok_s', 0):.1f} | "
            f"{m['seconds']:.1f} / {d['seconds']:.1f} |"
        )
    print("\n".join(lines))
    if args.json is not None:
        info = {"device": str(mx.default_device()), "mlx": mx.__version__, "weights": args.weights}
        info.update(decode=args.decode, chunk=args.chunk, fill_check=contexts)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"info": info, "fill_check": rows}, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the CPU smoke run: tiny shape, MiB")
    p.add_argument("--shapes", default=None, help=f"comma-separated (default {DEFAULT_SHAPES})")
    p.add_argument("--weights", default=None, choices=e2e.WEIGHTS, help="default 4bit")
    p.add_argument("--budgets", default=None, help="GiB (16, 16G) or MiB (300M), comma-separated")
    p.add_argument("--caches", default=None, help="comma-separated specs; fp16 is the reference")
    p.add_argument("--decode", type=int, default=None, help="decoded tokens per run (256)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (mlx-lm's 2048)")
    p.add_argument("--start", type=int, default=None, help="first probe's context (4096)")
    p.add_argument("--max-context", type=int, default=None, help="search bound (1048576)")
    p.add_argument("--tolerance", default="1/32", help="fraction of the context, or tokens")
    p.add_argument(
        "--isolate",
        choices=("none", "process"),
        default="none",
        help="process: each probe in a fresh Python process (builds the model each time)",
    )
    p.add_argument(
        "--fill",
        choices=("model", "direct"),
        default="model",
        help="direct: the prompt's tokens before its last two chunks are written into the "
        "caches (random keys and values) instead of prefilled by the model",
    )
    p.add_argument(
        "--fill-check",
        default=None,
        help="no search: each cache at these contexts (comma-separated) prefilled by the "
        "model and filled directly, peaks side by side",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--leak-warn", type=float, default=0.01, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, help="write the rows to this file")
    p.add_argument("--chart", type=Path, default=None, help="bar chart (.png or .svg)")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="no runs: the rows of these --json files as one table, ratios recomputed",
    )
    p.add_argument("--probe-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe_json is not None:
        return probe_main(args.probe_json)
    if args.merge:
        return merge(args.merge, args)
    defaults = {
        "shapes": DEFAULT_SHAPES,
        "weights": "4bit",
        "budgets": DEFAULT_BUDGETS,
        "caches": DEFAULT_CACHES,
        "decode": 256,
        "chunk": 2048,
        "start": 4096,
        "max_context": 1 << 20,
    }
    if args.tiny:
        defaults.update(TINY)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        raise SystemExit(f"--shapes must name some of {', '.join(SHAPES)}, got {args.shapes!r}")
    try:
        budgets = sorted({parse_size(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError as exc:
        raise SystemExit(f"--budgets: {exc}") from None
    if not budgets:
        raise SystemExit("--budgets lists no budget")
    specs = split_specs(args.caches)
    if not specs:
        raise SystemExit("--caches lists no cache")
    if "fp16" in specs:  # the reference first
        specs = ["fp16", *[s for s in specs if s != "fp16"]]
    for name in ("decode", "chunk", "start", "max_context"):
        if getattr(args, name) < 2:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 2")
    if args.start > args.max_context:
        args.start = args.max_context
    args.tol = parse_tolerance(args.tolerance)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.fill_check is not None:
        try:
            contexts = [int(c) for c in args.fill_check.split(",") if c.strip()]
        except ValueError:
            raise SystemExit(f"--fill-check takes token counts, got {args.fill_check!r}") from None
        if not contexts or min(contexts) < 2:
            raise SystemExit(f"--fill-check takes contexts of 2 tokens or more, got {contexts}")
        return fill_check(shapes, specs, contexts, args, log)

    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        args.rows_before = list(rows)
        rows.extend(run_shape(shape, budgets, specs, args, log))
    add_ratios(rows)
    probes = [p for r in rows for p in r.get("probes", [])]
    info = {
        "device": str(mx.default_device()),
        "device_info": {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int))},
        "mlx": mx.__version__,
        "weights": args.weights,
        "decode": args.decode,
        "chunk": args.chunk,
        "start": args.start,
        "max_context": args.max_context,
        "tolerance": args.tolerance,
        "isolate": args.isolate,
        "fill": args.fill,
        "seconds": time.perf_counter() - t0,
        "probes": len(probes),
        "probe_base_bytes": (
            [min(p["base_bytes"] for p in probes), max(p["base_bytes"] for p in probes)]
            if probes
            else None
        ),
    }
    if mx.default_device() == mx.cpu:
        from velox_cli.blas import active_blas

        info["blas"] = active_blas()
    report(rows, info, args)
    print(f"\n{len(probes)} probes in {info['seconds']:.0f} s on {info['device']}")
    return 0


def report(rows: list[dict[str, Any]], info: dict[str, Any], args) -> None:
    """Write ``--json`` and ``--chart`` and print the table and the targets."""
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")
        args.json.with_name(args.json.name + ".partial").unlink(missing_ok=True)
    if args.chart is not None:
        args.chart.parent.mkdir(parents=True, exist_ok=True)
        draw_chart(args.chart, rows, info)
    print(table(rows))
    summary = targets_summary(rows)
    if summary:
        print(
            "\nissue 52 targets (velox 4-bit >= 3.5x fp16's context, 2-bit >= 6x, decode >= "
            "fp16's at its own context):"
        )
        print("\n".join(summary))


# fields add_ratios sets, dropped from rows read back for --merge
RATIO_FIELDS = ("x_fp16_context", "x_fp16_bound", "x_fp16_decode", "target")


def merge(paths: list[Path], args) -> int:
    """``--merge``: the rows of several ``--json`` files as one run's (a later file's row of the
    same shape, budget and cache replaces an earlier one), ratios and targets recomputed."""
    rows: dict[tuple, dict[str, Any]] = {}
    infos = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            found = data["rows"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"--merge {path}: not a capacity --json file ({exc})") from None
        infos.append({"file": str(path), **data.get("info", {})})
        for r in found:
            r = {k: v for k, v in r.items() if k not in RATIO_FIELDS}
            rows[(r["shape"], r["budget_bytes"], r["cache"])] = r
    merged = sorted(
        rows.values(),
        key=lambda r: (r["shape"], r["budget_bytes"], r["cache"] != "fp16"),
    )
    add_ratios(merged)
    # each setting from the first file that records it (a run's rows kept beside its --json
    # before they carried any), the weights also from the rows
    info: dict[str, Any] = {"merged": infos}
    for k in ("device", "mlx", "weights", "decode"):
        info[k] = next((i[k] for i in infos if i.get(k) is not None), None)
    if info["weights"] is None:
        info["weights"] = next((r["weights"] for r in merged if r.get("weights")), None)
    report(merged, info, args)
    return 0


def preload_blas(argv: list[str]) -> None:
    """On Linux's CPU wheel of MLX, re-execute this script once with OpenBLAS preloaded, as
    the ``velox`` command does (``velox_cli.blas``): MLX's bundled reference BLAS makes the
    CPU run 10-15 times slower. ``VELOX_BLAS=off`` keeps it."""
    try:
        from velox_cli import blas
    except ImportError:
        return
    setting = (os.environ.get("VELOX_BLAS") or "").lower()
    if (
        sys.platform != "linux"
        or setting in blas.OFF
        or os.environ.get(blas.ACTIVE)
        or "blas" in os.environ.get("LD_PRELOAD", "").lower()
        or blas.mlx_reference_blas() is None
    ):
        return
    lib, what, _ = blas.find_blas()
    if lib is None:
        return
    print(f"capacity: preloading {what}", file=sys.stderr, flush=True)
    env = dict(os.environ)
    env[blas.ACTIVE] = str(lib)
    env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(lib)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


if __name__ == "__main__":
    preload_blas(sys.argv[1:])
    sys.exit(main())
