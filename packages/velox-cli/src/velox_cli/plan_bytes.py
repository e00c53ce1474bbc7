"""``velox plan``'s cache bytes: each spec's resident bytes (``cache.nbytes``, every buffer with
its growth slack and every fitted or policy array) at a model's KV shape, measured.

A measurement runs the real caches as ``velox generate`` runs a prompt: a model of the target's
own mlx-lm architecture whose attention keeps its KV heads, head dim, RoPE and layer kinds
(every other width shrunk, one query head per KV head, random weights) gets ``velox_cli.specs``'
caches, a prompt of ``n - 1`` random tokens prefilled through velox's routed attention in
mlx-lm's 2,048-token chunks, the step after the prefill where the method has one (KVzip's), then
the last token as the first decode step (which makes an eviction policy cut to its budget). The
model's layers repeat with a period (Gemma 3: five sliding, one global), so the model has one
period of layers and each layer's bytes count once per layer of its kind; a method whose caches
link layers (MiniCache, xKV) gets four alike layers (every layer where that is not a whole
number of its groups). A policy that keeps queries (AdaKV's observation window, TOVA's last
query) keeps them per query head: the difference between the model's query heads and one per
KV head is measured on a 513-token prompt and added.

Each spec is measured afresh at :data:`POINTS` (2,560 and 3,072 tokens: past every default
budget, window and age tier, the buffers growing by whole quanta between them): the bytes at
``n`` tokens are the line through the two points, or, where the layers hold as many tokens at
both (an eviction budget full), the points' mean at any context. ``python -m
velox_cli.plan_bytes --write`` measures the :data:`~velox_cli.plan_model.SHAPES` once into
``plan_bytes.json`` beside this module, which the plan reads (``--check N`` measures the caches
again at ``N`` tokens and compares: tests/test_plan_methods.py); any other model is measured
when planned.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .plan_model import SHAPES, ModelInfo, model_info, small_model

__all__ = ["DATA", "POINTS", "Curve", "curve", "measure_at", "measured_layers", "period"]

CHUNK = 2048  # mlx-lm's prefill step (generate_step's prefill_step_size)
POINTS = (2560, 3072)
QUERY_PROMPT, QUERY_CHUNK = 513, 256  # the short prompt the per-query-head state is measured on
DATA = Path(__file__).with_name("plan_bytes.json")


@dataclass
class Curve:
    """A spec's whole-model cache bytes (batch 1) at measured token counts."""

    spec: str
    tokens: list[int]
    bytes: list[int]
    held: list[float] = field(default_factory=list)  # tokens the measured layers hold
    error: str | None = None
    layers: int = 1  # the measured layers (``held`` is theirs together)

    @property
    def capped(self) -> bool:
        """Whether the held tokens stopped growing (an eviction budget full)."""
        return len(self.held) >= 2 and abs(self.held[-1] - self.held[-2]) < 0.5

    @property
    def per_token(self) -> float:
        """Bytes each further token adds (0 once capped)."""
        if self.capped or len(self.tokens) < 2:
            return 0.0
        return (self.bytes[-1] - self.bytes[-2]) / (self.tokens[-1] - self.tokens[-2])

    def at(self, n: float) -> float:
        """Bytes at ``n`` tokens: the line through the two points (a capped curve: the larger
        points' mean, at any context; below the points, a bound: budgets are not full yet)."""
        if self.capped:  # per-head budgets move buffer slack between heads: the points' mean
            return (self.bytes[-1] + self.bytes[-2]) / 2
        return max(0.0, self.bytes[-1] + self.per_token * (n - self.tokens[-1]))


def period(layer_kinds: list[str]) -> int:
    """The shortest repeat of the layer kinds."""
    n = len(layer_kinds)
    for p in range(1, n + 1):
        if all(layer_kinds[i] == layer_kinds[i % p] for i in range(n)):
            return p
    return n


def _linked(spec_text: str) -> bool:
    from velox_core import get_method
    from velox_core.cache.linked import LinkedLayers

    from .specs import BASELINES

    names = [t.split(":", 1)[0] for t in spec_text.split("+")]
    return any(
        n not in BASELINES and issubclass(get_method(n).cache_class, LinkedLayers) for n in names
    )


def measured_layers(spec_text: str, info: ModelInfo) -> int:
    """The measurement model's layers: one period of the layer kinds; four where the model's
    layers are all alike and a multiple of four and the method links layers (two of xKV's
    groups of two, MiniCache's fp16 half and one pair) or budgets each head (AdaKV, NestedKV,
    KVzip: each head's buffer keeps its own growth slack, which moves with the data, so four
    layers' heads average it); a linked method on other layers: every layer."""
    p = period(info.kinds)
    four = p == 1 and info.layers % 4 == 0
    if _linked(spec_text):
        return 4 if four else info.layers
    if four and _unit(spec_text, json.dumps(info.config, sort_keys=True), 1, POINTS[0])[3]:
        return 4
    return p


class _ByteTokenizer:
    """The measurement model's tokenizer for a step after the prefill (KVzip encodes its repeat
    instruction with it): a text's UTF-8 bytes, ids under the model's vocabulary of 512."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))


def _run(spec_text: str, model, n: int, chunk: int = CHUNK) -> list:
    """The model's caches after an ``n``-token prompt: ``n - 1`` prefilled, the step after the
    prefill, the last token decoded."""
    import mlx.core as mx
    import numpy as np

    import velox_core

    from .evaluate import after_prefill, prefill
    from .longctx.run import resolve_spec
    from .specs import build_caches, parse

    ids = np.random.default_rng(0).integers(0, 400, n)
    caches = build_caches(parse(resolve_spec(spec_text, n)), model, mx.float16)
    with warnings.catch_warnings(), velox_core.routed(model):
        warnings.simplefilter("ignore")
        prefill(model, caches, ids[: n - 1], chunk=chunk)
        after_prefill(model, _ByteTokenizer(), caches, ids[: n - 1])
        model(mx.array(ids[None, n - 1 :]), cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def _scaled(caches: list, unit: list[str], whole: list[str]) -> int:
    """The whole model's bytes: each measured layer's once per layer of its kind in the whole
    model, over its count in the measured ones."""
    return round(sum(c.nbytes * whole.count(k) / unit.count(k) for c, k in zip(caches, unit)))


def measure_at(spec_text: str, info: ModelInfo, n: int, layers: int | None = None) -> int:
    """The whole model's cache bytes after an ``n``-token prompt, measured (``layers``: the
    measurement model's; default one period, every layer for a linked method)."""
    layers = measured_layers(spec_text, info) if layers is None else layers
    unit, sizes, *_ = _unit(spec_text, json.dumps(info.config, sort_keys=True), layers, n)
    total = round(sum(b * info.kinds.count(k) / unit.count(k) for b, k in zip(sizes, unit)))
    return total + _query_heads(spec_text, info, layers)


def _held(cache) -> float:
    """Tokens a cache holds per KV head (with per-head budgets, their mean; mlx-lm's own
    caches: the tokens seen, or a rotating cache's window)."""
    if getattr(cache, "ragged", False):
        sizes = cache.body_sizes()
        return sum(sizes) / len(sizes) + cache.protected()
    if hasattr(cache, "logical_nbytes") or type(cache).__name__ == "RotatingKVCache":
        return float(cache.size())
    return float(getattr(cache, "offset", 0))


_UNITS: dict[tuple, tuple[list[str], list[int], float, bool]] = {}


def _unit(spec_text: str, config: str, layers: int, n: int, query_heads: bool = False):
    """Each measured layer's kind and bytes, kept for this process by the measurement model's
    config (llama3-8b's and llama3-70b's layers are one geometry: measured once)."""
    from .plan_model import kinds, shrunk

    cfg = json.loads(config)
    key = (spec_text, json.dumps(shrunk(cfg, layers, query_heads), sort_keys=True), n)
    if key not in _UNITS:
        model = small_model(cfg, layers, query_heads)
        chunk = QUERY_CHUNK if n == QUERY_PROMPT else CHUNK
        caches = _run(spec_text, model, n, chunk)
        ragged = any(getattr(c, "ragged", False) for c in caches)
        _UNITS[key] = (kinds(model), [c.nbytes for c in caches], sum(map(_held, caches)), ragged)
    return _UNITS[key]


def _query_heads(spec_text: str, info: ModelInfo, layers: int) -> int:
    """The bytes a policy keeps per query head beyond one per KV head (0 without a policy)."""
    c = info.config
    if int(c.get("num_attention_heads") or 1) == int(c.get("num_key_value_heads") or 0):
        return 0
    name = spec_text.split(":", 1)[0].split("+", 1)[0]
    if getattr(_method_policy(name), "__name__", None) is None:
        return 0
    sizes = []
    for q in (False, True):
        unit, got, *_ = _unit(spec_text, json.dumps(c, sort_keys=True), layers, QUERY_PROMPT, q)
        sizes.append(sum(b * info.kinds.count(k) / unit.count(k) for b, k in zip(got, unit)))
    return round(sizes[1] - sizes[0])


def _method_policy(name: str):
    """The method's first policy class (None: a baseline or a method without one)."""
    from velox_core import get_method

    from .specs import BASELINES

    if name in BASELINES:
        return None
    policies = getattr(get_method(name), "policies", ())
    return policies[0] if policies else None


def measure(spec_text: str, info: ModelInfo) -> Curve:
    """``spec_text``'s :class:`Curve` at ``info``'s shape; a spec that cannot run there (a group
    wider than the head, a missing fitted artifact) gets its reason as ``error``."""
    try:
        sizes = [measure_at(spec_text, info, n) for n in POINTS]
    except Exception as e:  # the reason, as velox bench gives it
        return Curve(spec_text, [], [], [], reason(e))
    layers = measured_layers(spec_text, info)
    config = json.dumps(info.config, sort_keys=True)
    held = [_unit(spec_text, config, layers, n)[2] for n in POINTS]
    return Curve(spec_text, list(POINTS), sizes, held, layers=layers)


def reason(e: Exception) -> str:
    """An error's first line, without where an artifact was looked for (machine paths)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {re.sub(r' [(]fingerprint .*', '', msg)}"


def _shipped() -> dict:
    return json.loads(DATA.read_text()) if DATA.is_file() else {"shapes": {}}


def curve(spec_text: str, info: ModelInfo, note=None, measure_missing: bool = True) -> Curve:
    """The shipped curve of a shape's spec, else a measurement (``note(spec)`` first); a
    shape's spec the file lacks, with ``measure_missing`` False, gets the command that measures
    it as its ``error`` (a default plan stays seconds when a new method is installed)."""
    rows = _shipped()["shapes"].get(info.shape or "", {})
    if spec_text in rows:
        return Curve(spec_text, **rows[spec_text])
    if info.shape and not measure_missing:
        how = f"python -m velox_cli.plan_bytes --write --shapes {info.shape} --specs '{spec_text}'"
        return Curve(spec_text, [], [], [], f"not in {DATA.name}: measure it with `{how}`")
    if note is not None:
        note(spec_text)
    return measure(spec_text, info)


def check(shape: str, specs: list[str], n: int) -> list[tuple[str, float, int, float]]:
    """Each shipped spec's bytes at ``n`` tokens against its caches measured afresh there:
    ``(spec, shipped line, measured, relative error)``, the worst first."""
    info = model_info(shape=shape, weights="fp32")
    rows = _shipped()["shapes"][shape]
    out = []
    for spec in specs:
        if rows[spec].get("error"):
            continue
        got = measure_at(spec, info, n)
        said = Curve(spec, **rows[spec]).at(n)
        out.append((spec, said, got, abs(said - got) / got))
    return sorted(out, key=lambda r: -r[3])


def main(argv: list[str] | None = None) -> int:
    """``python -m velox_cli.plan_bytes --write``: measure the shapes' specs into :data:`DATA`;
    ``--check N``: compare the shipped bytes with the caches measured at ``N`` tokens."""
    from .plan_data import candidates

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names")
    p.add_argument("--specs", nargs="+", default=None, help="default: the plan's candidates")
    p.add_argument("--write", action="store_true", help=f"merge the results into {DATA.name}")
    p.add_argument("--out", type=Path, default=DATA, help=argparse.SUPPRESS)  # split runs
    p.add_argument("--check", type=int, default=None, metavar="N", help="compare at N tokens")
    a = p.parse_args(argv)
    if a.check is not None:
        for shape in a.shapes.split(","):
            for spec, said, got, err in check(shape, a.specs or candidates(), a.check):
                print(f"{shape} {spec}: shipped {said:,.0f} measured {got:,} error {err:.2%}")
        return 0
    data = json.loads(a.out.read_text()) if a.out.is_file() else {"shapes": {}}
    data.update(chunk=CHUNK, points=list(POINTS), generated_by="python -m velox_cli.plan_bytes")
    for shape in a.shapes.split(","):
        info = model_info(shape=shape, weights="fp32")  # the weights' bytes play no part
        rows = data["shapes"].setdefault(shape, {})
        for spec in a.specs or candidates():
            t0 = time.perf_counter()
            c = measure(spec, info)
            rows[spec] = {k: v for k, v in asdict(c).items() if k != "spec"}
            print(f"{shape} {spec}: {c.bytes or c.error} {time.perf_counter() - t0:.1f} s")
            sys.stdout.flush()
            if a.write:
                a.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
