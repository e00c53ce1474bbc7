"""``velox plan``'s measured inputs besides the bytes: which specs it plans, the long-context
quality the repository's data records for them, and the prefill transient MLX's peak holds
beyond the weights and the cache.

Quality comes from ``velox eval`` result files, ``docs/data/eval-*.json`` of a source checkout
(found from the working directory up, then beside this package): each cell's accuracy, KL and
prompt count by spec and prompt length, with the model and task the run names. Nothing is
estimated: a spec without a cell is "unmeasured".

The transient (:func:`transient`, docs/plan.md) is fitted on ``benchmarks/e2e.py``'s rows
(``docs/data/e2e-h200-llama3-8b*.json``); ``tests/test_plan.py`` recomputes the constants from
those files.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Quality", "candidates", "canonical", "data_dir", "method_of", "quality", "transient"]

CHUNK = 2048  # mlx-lm's prefill step
# velox's prefill attends each layer's held tokens decoded: bytes of that per token over one
# layer's fp16 keys and values, the largest of each method's benchmarks/e2e.py rows (llama3-8b
# shape, H200; TurboQuant's from e2e-h200-llama3-8b-tq-prefill.json, after its prefill change);
# a method without rows takes the largest of all
DECODED = {"uniform": 2.5386, "turboquant": 2.4199, "kivi": 8.884}
# mlx-lm's own caches evaluate a prefill chunk's whole graph at once (velox's evaluate each
# layer): their transient beyond the activations, in weights' bytes, by context (the largest
# fp16 row at batch 1; linear in log2 of the context between the points and past them)
WHOLE_GRAPH = ((4096, 1.6201), (32768, 2.3323), (131072, 2.752))
# a prompt of at most CHUNK tokens is prefilled as one chunk of under CHUNK queries, which
# holds far less: fp16's row of benchmarks/capacity.py (llama3-8b shape in 8 GiB, H100), whose
# 2,048-token prompt fits where a 2,049-token one does not
ONE_CHUNK = 0.5775


def data_dir() -> Path | None:
    """``docs/data`` of a source checkout: from the working directory up, then beside this
    package (an editable install); None where there is none."""
    here = Path.cwd().resolve()
    for root in (here, *here.parents, *Path(__file__).resolve().parents):
        if (root / "docs" / "data").is_dir():
            return root / "docs" / "data"
    return None


@dataclass
class Quality:
    """What one eval file measured of one spec: a cell per prompt length."""

    file: str
    model: str
    task: str
    cells: dict[int, dict[str, Any]] = field(default_factory=dict)  # length -> cell

    def at(self, length: int) -> dict[str, Any] | None:
        return self.cells.get(length)


def _model_label(path: str) -> str:
    """``/…/models/gemma3-a5fd3b62230aa5ec-bfloat16`` -> ``gemma3`` (a converted model's
    directory: its name, a hash, its dtype)."""
    name = Path(path).name
    m = re.fullmatch(r"(.+)-[0-9a-f]{16}-[a-z0-9]+", name)
    return m.group(1) if m else name


# a run whose fp16 answers fewer of its longest prompts than this measures nothing (the task
# is beyond the model there): its accuracies do not rank methods
FP16_FLOOR = 0.5


def _fp16_holds(cells: list[dict[str, Any]]) -> bool:
    """Whether fp16 answers at least :data:`FP16_FLOOR` of the run's longest prompts."""
    longest = max(c["length"] for c in cells)
    fp16 = [c["accuracy"] for c in cells if c["spec"] == "fp16" and c["length"] == longest]
    return bool(fp16) and min(fp16) >= FP16_FLOOR


def quality(where: Path | None = None) -> tuple[dict[str, Quality], dict[str, Any]]:
    """Each spec's cells in the eval file with the longest prompts (more specs breaking a tie)
    among those whose fp16 answers at least :data:`FP16_FLOOR` at that length, and that
    source: file, model, task, lengths."""
    where = where or data_dir()
    best: tuple | None = None
    for path in sorted(where.glob("eval-*.json")) if where else []:
        try:
            d = json.loads(path.read_text())
            run, cells = d["run"], d["cells"]
        except (ValueError, KeyError, TypeError):
            continue  # not a velox eval file
        ok = [c for c in cells if not c.get("error") and c.get("accuracy") is not None]
        if not ok or not _fp16_holds(ok):
            continue
        key = (max(c["length"] for c in ok), len({c["spec"] for c in ok}))
        if best is None or key > best[0]:
            best = (key, path, run, ok)
    if best is None:
        return {}, {}
    _, path, run, ok = best
    model = _model_label(str(run.get("model", "")))
    out: dict[str, Quality] = {}
    for c in ok:
        q = out.setdefault(c["spec"], Quality(path.name, model, c["task"]))
        q.cells[int(c["length"])] = {
            k: c.get(k) for k in ("accuracy", "prompts", "kl", "top1", "low", "high", "ratio")
        }
    lengths = sorted({int(c["length"]) for c in ok})
    source = {"file": path.name, "model": model, "tasks": sorted({c["task"] for c in ok})}
    source.update(lengths=lengths, rank_length=lengths[-1])
    return out, source


def canonical(text: str) -> str:
    """A spec's identity across spellings: the method's defaults filled in, parameters sorted
    (``kvsink:bits=2`` and ``kvsink:bits=2,sinks=0,...`` at its defaults are one)."""
    from velox_core import parse_spec
    from velox_core.registry import method_params

    if "+" in text:
        return "+".join(canonical(t) for t in text.split("+"))
    try:
        name, params = parse_spec(text)
        merged = {**method_params(name), **params}
    except (ValueError, KeyError):
        return text

    def norm(v: Any) -> str:
        return repr(float(v)) if isinstance(v, int) and not isinstance(v, bool) else str(v)

    return name + ":" + ",".join(f"{k}={norm(v)}" for k, v in sorted(merged.items()))


def candidates(where: Path | None = None) -> list[str]:
    """The specs a plan weighs: the baselines, every installed method's recommended settings,
    then the specs the quality data measured (``budget=25%`` shares, compositions) whose methods
    are installed, each setting once (its first spelling)."""
    from velox_core import methods

    from .specs import BASELINES, default_specs

    texts = [s.text for s in default_specs()]
    measured, _ = quality(where)
    have = {*methods(), *BASELINES}
    texts += [t for t in sorted(measured) if all(_name(p) in have for p in t.split("+"))]
    out: dict[str, str] = {}
    for t in texts:
        out.setdefault(canonical(t), t)
    return list(out.values())


def _name(spec: str) -> str:
    return spec.split(":", 1)[0]


def whole_graph(n: int) -> float:
    """:data:`WHOLE_GRAPH`'s factor at ``n`` tokens (linear in log2 of ``n``), or
    :data:`ONE_CHUNK` for a prompt prefilled as one chunk (``n <= CHUNK``)."""
    if n <= CHUNK:
        return ONE_CHUNK
    xs = [math.log2(p) for p, _ in WHOLE_GRAPH]
    ys = [f for _, f in WHOLE_GRAPH]
    x = math.log2(max(n, 1))
    if x <= xs[0]:
        return ys[0]
    i = next((i for i in range(1, len(xs)) if x <= xs[i]), len(xs) - 1)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def transient(
    dims: dict[str, int], weights: int, method: str, held: float, context: int, batch: int
) -> dict[str, float]:
    """The prefill's transient on a GPU in bytes, by term (docs/plan.md):

    - ``activations``: one layer's activations of one chunk, ``batch x CHUNK x (4 hidden +
      query + 2 KV + 3 MLP widths) x 2`` bytes;
    - ``decoded`` (velox caches): ``DECODED[method] x batch x held x (2 x KV width x 2)``,
      ``held`` the tokens a layer holds (fewer than ``context`` under an eviction budget);
    - ``whole_graph`` (mlx-lm's caches): ``WHOLE_GRAPH``'s factor x the weights.
    """
    chunk = min(CHUNK, context)
    width = 4 * dims["hidden"] + dims["q"] + 2 * dims["kv"] + 3 * dims["mlp"]
    out = {"activations": float(batch * chunk * width * 2)}
    if method in ("fp16", "mlx-q4", "mlx-q8"):
        out["whole_graph"] = whole_graph(context) * weights
    else:
        k = DECODED.get(method, max(DECODED.values()))
        out["decoded"] = k * batch * held * 2 * dims["kv"] * 2
    return out


def method_of(spec: str) -> str:
    """The method a spec's transient is looked up by (a composition: its codecs')."""
    last = spec.split("+")[-1]
    m = re.match(r"^[a-z0-9-]+", last)
    return m.group(0) if m else last
