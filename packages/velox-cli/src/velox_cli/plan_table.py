"""``velox plan``'s table: the settings that fit, best measured quality first, in at most 100
columns with every spec whole (long specs wrap after a comma), then what does not fit, what
cannot run at this shape, where the quality comes from, and the recommendation."""

from __future__ import annotations

import re
import textwrap

__all__ = ["render"]

GB = 1e9
SPEC = 36  # the spec column's width
WIDTH = 100


def _wrap_spec(spec: str, width: int = SPEC) -> list[str]:
    """A spec in lines of at most ``width``, broken after a comma, ``+`` or ``:``."""
    lines, cur = [], ""
    for part in re.split(r"(?<=[,+:])", spec):
        if cur and len(cur) + len(part) > width:
            lines.append(cur)
            cur = "  "
        cur += part
    return [*lines, cur]


def _context(n: int) -> str:
    return ">16.7M" if n >= 1 << 24 else f"{n:,}"


def _line(i: int | str, r: dict) -> list[str]:
    per = "capped" if r["capped"] else f"{r['bytes_per_token']:,.0f}"
    acc = "unmeasured" if r["accuracy"] is None else f"{r['accuracy']:.2f} ({r['prompts']})"
    kl = "" if r["kl"] is None else f"{r['kl']:.3f}"
    spec = _wrap_spec(r["spec"])
    head = (
        f"{i:>3} {spec[0]:{SPEC}} {per:>8} {r['cache_bytes'] / GB:8.2f} "
        f"{r['peak_bytes'] / GB:7.2f} {_context(r['max_context']):>11} {acc:>11} {kl:>6}"
    )
    return [head, *(f"    {s}" for s in spec[1:])]


def render(result: dict, everything: bool = False) -> str:
    """The plan as text (``everything``: the settings that do not fit listed in the table too)."""
    m, src = result["model"], result["quality_source"]
    rows = [r for r in result["rows"] if not r["error"]]
    shown = rows if everything else [r for r in rows if r["fits"]]
    length = src.get("rank_length")
    acc = f"acc@{length // 1024}k" if length else "accuracy"
    out = [
        f"velox plan: {m['name']} ({m['layers']})",
        f"weights {m['weights_bytes'] / GB:.2f} GB ({m['weights_from']})",
        f"memory {result['memory_bytes'] / GB:.2f} GB | context {result['context']:,} tokens"
        f" | batch {result['batch']}",
        "",
        f"{'#':>3} {'spec':{SPEC}} {'B/token':>8} {'cache GB':>8} {'peak GB':>7}"
        f" {'max context':>11} {acc:>11} {'KL':>6}",
    ]
    for i, r in enumerate(shown, 1):
        out += _line(i if r["fits"] else "--", r)  # --: does not fit (with --all)
    if not shown:
        out.append("    (no setting fits this context)")
    key = (
        "B/token: bytes each further token adds (capped: an eviction budget, the bytes stop "
        "growing). cache GB: the cache at the context x batch. peak GB: weights + cache + the "
        "prefill's transient. max context: the longest context whose peak fits the memory."
    )
    out += ["", *textwrap.wrap(key, WIDTH)]
    if src:
        what = (
            f"{acc}: long-context accuracy (prompts) and KL against fp16 that "
            f"{src['file']} measured on {src['model']} ({', '.join(src['tasks'])}, "
            f"{length:,}-token prompts), ranked by the lower end of the accuracy's 95% interval "
            "(few prompts rank lower). unmeasured: no cell for that spec, listed after the "
            "measured ones in no quality order."
        )
    else:
        what = "quality: no docs/data/eval-*.json found: every setting is unmeasured."
    out += textwrap.wrap(what, WIDTH)
    over = [r["spec"] for r in rows if not r["fits"]]
    if over and not everything:
        out += textwrap.wrap(f"do not fit ({len(over)}): {'; '.join(over)}", WIDTH)
    bad = [r for r in result["rows"] if r["error"]]
    if bad:
        out.append(f"cannot run at this shape ({len(bad)}):")
        out += [textwrap.shorten(f"  {r['spec']}: {r['error']}", WIDTH) for r in bad]
    limit = m.get("max_position_embeddings")
    if limit and result["context"] > limit:
        out.append(f"note: the context is past the model's max_position_embeddings ({limit:,})")
    rec = result["recommendation"]
    out += textwrap.wrap(f"recommendation: {rec['spec'] or 'none'}: {rec['reason']}", WIDTH)
    return "\n".join(out)
