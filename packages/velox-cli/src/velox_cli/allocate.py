"""``velox allocate``: one spec per layer from measured sensitivity, under a byte budget.

    velox allocate [--model M] --budget 3bits|BYTES|SPEC [--specs SPEC ...] [--json PATH]
                   [--data FILE] [--prompts N] [--context N] [--tail N] [--chunk N]
                   [--table PATH] [--from-table PATH]

The model is loaded as ``velox bench`` loads it (on a CPU: float32 compute, float16 storage)
and the base cache of every layer is bench's fp16 cache, so the table's bytes are bench's held
bytes. Prompts are cut from the end of the text (bench's samples start at its beginning):
``--prompts`` pieces of ``--context`` + ``--tail`` tokens, so that bytes are measured at the
length ``velox bench --context`` measures them (its ``--continuation`` is the tail). The
allocation file (``--json``) is a spec ``velox bench``, ``velox eval`` and ``velox generate``
take: ``velox bench --methods uniform:bits=3 alloc.json``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

__all__ = ["DEFAULT_SPECS", "add_parser", "cmd_allocate", "tail_prompts"]

DEFAULT_SPECS = ("uniform:bits=2", "uniform:bits=3", "uniform:bits=4", "uniform:bits=8")
MEASURE = (  # the measurement's options: (name, default, what)
    ("prompts", 4, "prompts measured"),
    ("context", 2048, "prefix tokens per prompt"),
    ("tail", 32, "tokens after the prefix, fed one at a time and scored"),
    ("chunk", 512, "prefill chunk size"),
)


def add_parser(sub) -> None:
    """``velox allocate``'s arguments (args.py registers the subcommand with this)."""
    p = sub.add_parser(
        "allocate",
        help="one spec per layer under a byte budget, from each layer's measured sensitivity",
    )
    p.add_argument(
        "--model",
        help="an mlx-lm directory, a .gguf file or a name (smollm2); default: the reference "
        "model in shared/",
    )
    p.add_argument(
        "--budget",
        required=True,
        help="bytes per token over the allocated layers: a number of bytes, NNbits (bits per "
        "key and value channel on average, every byte counted, e.g. 3bits) or a spec, meaning "
        "its bytes on every layer (uniform:bits=3; measured too if not among --specs)",
    )
    p.add_argument(
        "--specs",
        nargs="+",
        metavar="SPEC",
        help="candidate specs of any method, fp16 for a layer kept as it is (default: "
        f"{' '.join(DEFAULT_SPECS)}); with --from-table, choose among these (default: the "
        "table's candidates)",
    )
    p.add_argument(
        "--json",
        dest="json_path",
        metavar="PATH",
        help="write the allocation, a spec velox bench / eval / generate take ('-': print it "
        "instead of the table)",
    )
    p.add_argument(
        "--data", help="text to measure on (default: the held-out text velox bench reads)"
    )
    for name, default, what in MEASURE:
        p.add_argument(f"--{name}", type=int, help=f"{what} (default {default})")
    p.add_argument("--table", metavar="PATH", help="also write the measured table (JSON)")
    p.add_argument(
        "--from-table",
        metavar="PATH",
        help="allocate from a table --table wrote instead of measuring",
    )


def tail_prompts(stream, n: int, length: int) -> list[list[int]]:
    """``n`` pieces of ``length`` tokens from the end of ``stream``, the last piece first,
    none overlapping (``ValueError`` if the stream is shorter than ``n * length``)."""
    if len(stream) < n * length:
        raise ValueError(
            f"the text has {len(stream)} tokens; {n} prompts of {length} need {n * length}"
        )
    return [[int(t) for t in stream[len(stream) - k * length :][:length]] for k in range(1, n + 1)]


def _measure(a, specs: list[str], budget: Any):
    from velox_core.kernels import backend

    from .allocator import sensitivity
    from .bench import load_model
    from .data import load_text, token_stream
    from .specs import StoredKVCache

    spec = isinstance(budget, str) and not budget.strip().endswith(("bit", "bits"))
    extra = [budget] if spec and budget not in specs else []  # measured for its bytes
    model, tokenizer, store, path = load_model(a.model)
    stream = token_stream(tokenizer, load_text(a.data))
    prompts = tail_prompts(stream, a.prompts, a.context + a.tail)
    base = None if store is None else (lambda i: StoredKVCache(store))
    n = len(specs + extra)
    print(f"velox allocate: measuring {n} specs on every layer of {path}", file=sys.stderr)
    table = sensitivity(
        model,
        prompts,
        specs + extra,
        tail=a.tail,
        chunk=a.chunk,
        base=base,
        storage_dtype=store,
        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )
    table.info = {
        "model": path,
        "data": a.data or "shared/data/heldout.jsonl.gz",
        "prompts_from": "the end of the text",
        "context": a.context,
        "backend": backend(),
        "storage_dtype": None if store is None else str(store),
        "candidates": specs,  # --from-table chooses among these unless --specs says
    }
    return table


def _check(a) -> list[str] | None:
    """Every option checked before any work; the measurement's defaults filled in."""
    if a.from_table:
        given = [n for n in ("model", "data", "table", *(m[0] for m in MEASURE)) if getattr(a, n)]
        if given:
            raise ValueError(
                "--from-table allocates from a measured table; "
                f"{', '.join('--' + n for n in given)} apply only to measuring"
            )
    for name, default, _ in MEASURE:
        v = default if getattr(a, name) is None else getattr(a, name)
        if v < 1:
            raise ValueError(f"--{name} must be a positive integer, got {v}")
        setattr(a, name, v)
    specs = list(a.specs) if a.specs else None
    for s in specs or []:
        _velox_spec("--specs", s)
    return specs


def _velox_spec(option: str, text: str) -> None:
    """``ValueError`` unless ``text`` is ``fp16`` or a spec of an installed velox method."""
    from velox_core import make

    if text.startswith("mlx-q") or text.endswith(".json") or "+" in text:
        raise ValueError(
            f"{option}: {text!r} is not a velox method's spec (mlx-lm's caches and compositions "
            "are not allocated per layer; uniform:bits=4,group=64 is mlx-q4's format)"
        )
    if text != "fp16":
        make(text)  # an unknown method or parameter, named now rather than after measuring


def _budget(text: str, measuring: bool) -> Any:
    """``--budget`` as :func:`velox_cli.allocator.allocate` takes it, checked before any work:
    a positive number of bytes, ``NNbits`` or a spec (a velox spec where it is measured)."""
    try:
        v = float(text)
    except ValueError:
        v = None
    if v is not None:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"--budget must be a positive number of bytes per token, got {text}")
        return v
    if text.strip().endswith(("bit", "bits")):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*bits?\s*", text)
        if m is None or float(m.group(1)) <= 0:
            raise ValueError(f"--budget {text!r}: NNbits takes a positive number, e.g. 3bits")
        return text
    if measuring:
        _velox_spec("--budget", text)
    return text


def cmd_allocate(a) -> int:
    from .allocator import SensitivityTable, allocate

    specs = _check(a)
    budget = _budget(a.budget, measuring=not a.from_table)
    if a.from_table:
        table = SensitivityTable.load(a.from_table)
        choose = specs or table.info.get("candidates")
    else:
        table = _measure(a, specs or list(DEFAULT_SPECS), budget)
        choose = specs or list(DEFAULT_SPECS)
        if a.table:
            table.save(a.table)
    plan = allocate(table, budget, choose)
    plan.info.update({"budget_asked": a.budget, "model": table.info.get("model")})
    if a.json_path == "-":
        print(json.dumps(plan.to_json(), indent=1))
        return 0
    for line in report(table, plan, a.budget):
        print(line)
    if a.table:
        print(f"table written to {a.table} (velox allocate --from-table reads it)")
    if a.json_path:
        plan.save(a.json_path)
        print(f"allocation written to {a.json_path}: velox bench --methods {a.json_path}")
    return 0


def report(table, plan, asked: str) -> list[str]:
    """The lines ``velox allocate`` prints: each layer's measured KL and held bytes per token
    for every spec (the chosen one marked ``*``), the totals, and the ``make_cache`` call."""
    width = max(len(s) for s in plan.specs) + 2
    head = f"{'layer':>5}  " + "".join(f"{s:>{width + 12}}" for s in plan.specs)
    out = [
        f"velox allocate: {table.info.get('model', 'model')} | {table.prompts} prompts, "
        f"{table.tokens:,} tokens held, last {table.tail} scored",
        "KL against fp16 with only that layer coded, and held bytes/token (* chosen):",
        head,
    ]
    for li, layer in enumerate(table.layers):
        cells = []
        for s in plan.specs:
            k = table.specs.index(s)
            d, h = table.damage[li][k], table.held[li][k]
            mark = "*" if plan.layers.get(layer) == s else " "
            kl = "" if d is None else mark + f"{d:.4g}"
            cells.append(f"{kl:>{width}}" + ("" if h is None else f"{h:>12,.1f}").ljust(12))
        out.append(f"{layer:>5}  " + "".join(cells))
    fp16 = sum(table.base)
    out.append(
        f"predicted: {plan.bytes_per_token:,.1f} B/token held over {len(table.layers)} layers "
        f"(budget {plan.budget:,.1f} from {asked!r}; fp16 {fp16:,.1f}, "
        f"{fp16 / plan.bytes_per_token:.2f}x), summed KL {plan.damage:.4g}"
    )
    layers = ", ".join(f"{k}: {v!r}" for k, v in sorted(plan.layers.items()) if v != plan.default)
    out.append(f"make_cache(model, {plan.default!r}, layers={{{layers}}})")
    return out
