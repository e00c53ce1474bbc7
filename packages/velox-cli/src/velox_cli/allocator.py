"""Per-layer allocation of cache settings: measured sensitivity, then one spec per layer that
minimizes the summed damage under a byte budget.

Layers differ in how much a coarser cache costs the model. :func:`sensitivity` measures it:
for each layer and each candidate spec (any method's, e.g. ``uniform:bits=2`` ...
``uniform:bits=8``, or one family's specs of several widths), only that layer gets the spec
while every other layer keeps the base cache (fp16: the model's own ``KVCache``), each prompt
is prefilled and its last ``tail`` tokens teacher-forced one at a time, and the mean
``KL(p_base || p)`` of those next-token distributions is the choice's damage; the layer's
held bytes per token (:func:`velox_cli.scoring.held_bytes`: the rows of its arrays that hold
tokens, measured on the real cache after the run, not nominal bits) are its cost.

:func:`allocate` then picks one spec per layer minimizing the summed damage subject to the
summed bytes per token staying within the budget: a multiple-choice knapsack, solved exactly
by dynamic programming over the layers on the Pareto frontier of (bytes, damage) of the
layers so far (no discretization: every partial choice that is neither dearer nor more
damaging than another is kept, every one that cannot fit the budget with the cheapest choice
of the layers left is dropped). The summed damage is a model of the whole mix's KL (layers'
damages add to first order); ``velox bench`` measures the mix itself.

The result is the ``layers`` argument of :func:`velox_core.make_cache`::

    table = sensitivity(model, prompts, ["uniform:bits=2", "uniform:bits=4", "uniform:bits=8"])
    plan = allocate(table, "uniform:bits=4")  # the bytes of 4-bit codes on every layer
    caches = make_cache(model, plan.default, layers=plan.layers)

Reference: RateQuant (Zuo et al., arXiv 2605.06675) allocates bits per attention head from a
distortion model fitted per quantizer; velox allocates per layer from damage measured per
layer and spec (docs/allocate.md).
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import LatentCache, VeloxCache, make, make_cache, routed
from velox_core.router import layer_routes
from velox_core.validation import check_int

from .allocation import Allocation, SensitivityTable
from .scoring import held_bytes, kl_rows, prefill, teacher_force

__all__ = ["allocate", "budget_bytes", "sensitivity"]

FP16 = "fp16"  # a candidate that keeps the base cache on the layer
_BITS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*bits?\s*$")


def _check_specs(specs: Any) -> list[str]:
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise TypeError(f"specs must be a list of spec strings, got {type(specs).__name__}")
    out = list(specs)
    if not out:
        raise ValueError("specs: give at least one candidate spec")
    for s in out:
        if not isinstance(s, str):
            raise TypeError(f"specs: each must be a spec string, got {type(s).__name__} {s!r}")
        if s == FP16:
            continue
        cache = make(s)  # unknown method or parameter: ValueError naming it
        if hasattr(type(getattr(cache, "policy", None)), "after_prefill"):
            raise ValueError(
                f"specs: {s!r} takes a step after the prefill over every layer at once (a "
                "budget shared by the layers), which a per-layer allocation cannot measure"
            )
    dup = [s for s, n in Counter(out).items() if n > 1]
    if dup:
        raise ValueError(f"specs: {', '.join(map(repr, dup))} given more than once")
    return out


def _check_prompts(prompts: Any, tail: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of token id sequences (tokenize text first)")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            raise TypeError(f"prompts[{i}] is a str: give token ids (tokenizer.encode(text))")
        a = np.asarray(p)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"prompts[{i}] must be a 1-D sequence of token ids")
        if a.size <= tail:
            raise ValueError(
                f"prompts[{i}] has {a.size} tokens; it needs more than tail={tail} (the scored "
                "tokens come after a prefix)"
            )
        out.append([int(t) for t in a])
    if not out:
        raise ValueError("prompts: give at least one prompt")
    return out


def _served(model: Any, spec: str, storage_dtype: Any) -> set[int]:
    """The layers where ``make_cache`` gives ``spec`` a velox cache (the others keep the
    model's own cache: sliding windows, state-space layers, attention velox cannot serve)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = make_cache(model, spec, storage_dtype=storage_dtype)
    return {i for i, c in enumerate(caches) if isinstance(c, (VeloxCache, LatentCache))}


def _run(model, caches: list, prompt: list[int], tail: int, chunk: int) -> np.ndarray:
    with routed(model):
        logits = prefill(model, caches, prompt[:-tail], chunk)
        return teacher_force(model, caches, logits, prompt[-tail:])


def sensitivity(
    model: Any,
    prompts: Sequence[Sequence[int]],
    specs: Sequence[str],
    *,
    tail: int = 32,
    chunk: int = 512,
    base: Any = None,
    storage_dtype: Any = None,
    progress: Callable[[str], None] | None = None,
) -> SensitivityTable:
    """Measure what each candidate spec costs each layer alone (module docstring).

    Args:
        model: an mlx-lm model (or a registered host's, as :func:`make_cache` takes).
        prompts: token id sequences; each is prefilled but its last ``tail`` tokens, which are
            then fed one at a time (the decode path) and scored. Bytes are measured at these
            lengths: give prompts as long as the contexts the allocation is for.
        specs: candidate spec strings; ``"fp16"`` keeps the base cache on the layer (damage 0).
            A spec that serves no layer of a kind leaves those choices out (None).
        tail: scored tokens at the end of each prompt.
        chunk: prefill chunk (tokens).
        base: the cache of every layer but the measured one, any :func:`make_cache` spec
            (default None: the model's own cache); the KL is against a run with it everywhere.
        storage_dtype: as :func:`make_cache` takes it.
        progress: called with a line after each layer and spec is measured.

    Raises:
        ValueError, TypeError: no prompts, a prompt of ``tail`` tokens or fewer, an unknown
            spec or parameter, a spec given twice, a spec whose step after the prefill spans
            every layer (KVzip's), no layer any spec serves.
    """
    tail = check_int("tail", tail, minimum=1)
    chunk = check_int("chunk", chunk, minimum=1)
    specs = _check_specs(specs)
    prompts = _check_prompts(prompts, tail)
    say = progress or (lambda line: None)
    served = {s: _served(model, s, storage_dtype) for s in specs if s != FP16}
    layers = sorted(set().union(*served.values())) if served else []
    if not layers:
        raise ValueError(
            "sensitivity: no layer of this model takes a velox cache for any of the specs "
            f"{', '.join(specs)}"
        )
    routes = layer_routes(model)
    elements = [
        (routes[i].kv_heads or 1) * (routes[i].key_dim + routes[i].value_dim) for i in layers
    ]
    ref, base_held, base_res, tokens = [], np.zeros(len(layers)), np.zeros(len(layers)), 0
    for p in prompts:
        caches = make_cache(model, base, storage_dtype=storage_dtype)
        ref.append(_run(model, caches, p, tail, chunk))
        tokens += caches[layers[0]].offset
        base_held += [held_bytes(caches[i]) for i in layers]
        base_res += [caches[i].nbytes for i in layers]
        del caches
    shape = (len(layers), len(specs))
    damage = np.full(shape, np.nan)
    held, resident = np.full(shape, np.nan), np.full(shape, np.nan)
    for li, i in enumerate(layers):
        for si, s in enumerate(specs):
            if s == FP16:
                damage[li, si], held[li, si], resident[li, si] = 0.0, base_held[li], base_res[li]
                continue
            if i not in served[s]:
                continue
            kls, h, r = [], 0, 0
            for p, lp_ref in zip(prompts, ref, strict=True):
                caches = make_cache(model, base, layers={i: s}, storage_dtype=storage_dtype)
                kls.extend(kl_rows(lp_ref, _run(model, caches, p, tail, chunk)).tolist())
                h, r = h + held_bytes(caches[i]), r + caches[i].nbytes
                del caches
                mx.clear_cache()
            kl = float(np.mean(kls))
            damage[li, si] = kl if math.isfinite(kl) else math.inf
            held[li, si], resident[li, si] = h, r
            say(f"layer {i} {s}: KL {kl:.3g}, {h / tokens:,.1f} B/token")
    per_token = lambda a: [[None if math.isnan(x) else x / tokens for x in r] for r in a]  # noqa: E731
    return SensitivityTable(
        specs=specs,
        layers=layers,
        damage=[[None if math.isnan(x) else x for x in r] for r in damage.tolist()],
        held=per_token(held.tolist()),
        resident=per_token(resident.tolist()),
        base=(base_held / tokens).tolist(),
        elements=elements,
        prompts=len(prompts),
        tail=tail,
        tokens=tokens // len(prompts),
    )


def budget_bytes(table: SensitivityTable, budget: Any) -> float:
    """Bytes per token (summed over the table's layers) that ``budget`` allows: a number of
    bytes per token; ``"Nbits"`` (N bits per key and value channel on average, every byte
    counted: N/8 times the layers' ``elements``); or a spec of the table, meaning what it
    costs on every layer (``"uniform:bits=3"``, for a mix as large as one setting)."""
    if isinstance(budget, bool):
        raise TypeError("budget must be bytes per token, 'Nbits' or a spec of the table")
    if isinstance(budget, (int, float)):
        out = float(budget)
    elif isinstance(budget, str) and _BITS.match(budget):
        out = float(_BITS.match(budget).group(1)) / 8 * sum(table.elements)
    elif isinstance(budget, str) and budget in table.specs:
        s = table.specs.index(budget)
        costs = [r[s] for r in table.held]
        if any(c is None for c in costs):
            missing = [table.layers[i] for i, c in enumerate(costs) if c is None]
            raise ValueError(f"budget {budget!r}: the spec does not serve layers {missing}")
        out = float(sum(costs))
    elif isinstance(budget, str):
        raise ValueError(
            f"budget {budget!r}: give bytes per token, 'Nbits' (e.g. '3bits') or one of the "
            f"table's specs: {', '.join(table.specs)}"
        )
    else:
        raise TypeError(f"budget must be a number or a string, got {type(budget).__name__}")
    if not (math.isfinite(out) and out > 0):
        raise ValueError(f"budget must be a positive, finite number of bytes, got {out}")
    return out


def allocate(
    table: SensitivityTable,
    budget: Any,
    specs: Sequence[str] | None = None,
    *,
    resolution: float = 0.0,
) -> Allocation:
    """The spec of each layer minimizing the table's summed damage within ``budget``.

    Args:
        table: from :func:`sensitivity` (or :meth:`SensitivityTable.load`).
        budget: bytes per token over the table's layers, ``"Nbits"`` or a spec of the table
            (:func:`budget_bytes`).
        specs: choose only among these of the table's specs (default: all).
        resolution: 0 (default) solves exactly; above 0 each choice's bytes are first rounded
            up to a multiple of it (bytes per token), which bounds the frontier by
            ``budget / resolution`` states on a table too large to solve exactly, keeps the
            budget met, and may cost up to ``len(layers) * resolution`` bytes of optimality.

    Raises:
        ValueError: a budget below the cheapest allocation (every layer's cheapest choice), a
            spec not in the table, a layer left without a choice among ``specs``.
    """
    if not isinstance(table, SensitivityTable):
        raise TypeError(f"table must be a SensitivityTable, got {type(table).__name__}")
    if isinstance(resolution, bool) or not isinstance(resolution, (int, float)):
        raise TypeError(f"resolution must be a number of bytes, got {resolution!r}")
    if not (math.isfinite(resolution) and resolution >= 0):
        raise ValueError(f"resolution must be 0 (exact) or a positive number, got {resolution}")
    limit = budget_bytes(table, budget)
    use = list(table.specs) if specs is None else _pick(table, specs)
    cols = [table.specs.index(s) for s in use]
    cost = np.array([[np.nan if r[c] is None else r[c] for c in cols] for r in table.held])
    harm = np.array([[np.inf if r[c] is None else r[c] for c in cols] for r in table.damage])
    none = [table.layers[i] for i in range(len(cost)) if np.isnan(cost[i]).all()]
    if none:
        raise ValueError(f"allocate: no spec among {use} serves layers {none}")
    solve_cost = np.ceil(cost / resolution) * resolution if resolution else cost
    pick = _solve(solve_cost, np.nan_to_num(harm, nan=np.inf), limit, table, use)
    chosen = {table.layers[i]: use[k] for i, k in enumerate(pick)}
    return Allocation(
        layers=chosen,
        default=Counter(chosen.values()).most_common(1)[0][0],
        bytes_per_token=float(sum(cost[i, k] for i, k in enumerate(pick))),
        damage=float(sum(harm[i, k] for i, k in enumerate(pick))),
        budget=limit,
        specs=use,
        info={"tokens": table.tokens, "prompts": table.prompts, "tail": table.tail},
    )


def _pick(table: SensitivityTable, specs: Any) -> list[str]:
    if isinstance(specs, str) or not isinstance(specs, Sequence) or not specs:
        raise TypeError("specs must be a non-empty list of the table's spec strings")
    unknown = [s for s in specs if s not in table.specs]
    if unknown:
        raise ValueError(
            f"allocate: {', '.join(map(repr, unknown))} not in the table (measured: "
            f"{', '.join(table.specs)})"
        )
    return list(dict.fromkeys(specs))


def _solve(
    cost: np.ndarray, harm: np.ndarray, budget: float, table: SensitivityTable, use: list[str]
) -> list[int]:
    """Exact multiple-choice knapsack by dynamic programming over the layers: each layer's
    Pareto frontier of (bytes, damage) over every choice of the layers so far that can still
    fit the budget; returns one column index per layer (unavailable choices: NaN cost).

    Ties: of equal damage, the fewer bytes.
    """
    n = cost.shape[0]
    cheapest = np.where(np.isnan(cost), np.inf, cost).min(axis=1)
    rest = np.concatenate([np.cumsum(cheapest[::-1])[::-1], [0.0]])  # rest[l]: layers l.. at least
    tol = 1e-9 * max(budget, 1.0)
    if rest[0] > budget + tol:
        raise ValueError(
            f"allocate: budget {budget:,.1f} bytes per token is below the cheapest allocation, "
            f"{rest[0]:,.1f} (each layer's cheapest of {', '.join(use)}; layers {table.layers})"
        )
    front_b, front_d = np.zeros(1), np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for li in range(n):
        opts = np.flatnonzero(~np.isnan(cost[li]))
        nb = (front_b[:, None] + cost[li, opts][None, :]).ravel()
        nd = (front_d[:, None] + harm[li, opts][None, :]).ravel()
        src = np.repeat(np.arange(front_b.size), opts.size)
        col = np.tile(opts, front_b.size)
        ok = nb + rest[li + 1] <= budget + tol
        nb, nd, src, col = nb[ok], nd[ok], src[ok], col[ok]
        order = np.lexsort((col, src, nd, nb))
        nb, nd, src, col = nb[order], nd[order], src[order], col[order]
        keep = np.ones(nb.size, bool)
        keep[1:] = nd[1:] < np.minimum.accumulate(nd)[:-1]  # strictly below every cheaper one
        front_b, front_d = nb[keep], nd[keep]
        back.append((src[keep], col[keep]))
    at = front_b.size - 1  # damage falls along the frontier: its last state is the least
    pick = []
    for src, col in reversed(back):
        pick.append(int(col[at]))
        at = int(src[at])
    return pick[::-1]
