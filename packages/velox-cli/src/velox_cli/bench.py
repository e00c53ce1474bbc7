"""``velox bench``: every spec on one model, offline, in one run.

The fp16 run comes first (its distributions are the reference for KL and top-1, its bytes the
reference for compression); then each spec runs the same samples and recall prompts. Results
are printed as a table, optionally written as JSON rows and drawn as a PNG chart of quality
(KL) against memory (bytes per token).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from velox_core.kernels import backend

from .blas import active_blas
from .data import find_shared, load_text, recall_prompts, token_stream
from .evaluate import Row, decode_quality, reference_run, retrieval
from .specs import Spec, build_caches

__all__ = ["DEPTHS", "BenchSettings", "load_model", "run_bench"]

DEPTHS = (0.1, 0.5, 0.9)  # where the recalled definition sits in the context


@dataclass
class BenchSettings:
    """How much to measure. ``quick`` shrinks everything for a smoke run."""

    context: int = 2048
    samples: int = 2
    continuation: int = 24
    recall_trials: int = 1
    chunk: int = 512
    quick: bool = False

    def resolved(self) -> BenchSettings:
        if not self.quick:
            return self
        return BenchSettings(min(self.context, 1024), 1, 16, 1, self.chunk, True)

    def recall_lengths(self) -> list[int]:
        return [self.context]


def load_model(path: str | None):
    """``mlx_lm.load`` of ``path``: an mlx-lm directory, a ``.gguf`` file or a model name such
    as ``smollm2`` (a GGUF converted once into velox's cache, see ``velox_cli.models``);
    default: the reference model in ``shared/``.

    On a CPU the model computes in float32 and caches store float16 (see ``specs``).
    Returns ``(model, tokenizer, storage dtype or None, resolved path)``.
    """
    import mlx_lm

    from .models import resolve

    if path is None:
        found = find_shared("reference-model")
        if found is None:
            raise FileNotFoundError(
                "reference model not found (shared/reference-model); pass --model PATH"
            )
        path = str(found)
    else:
        path = str(resolve(path))
    model, tokenizer = mlx_lm.load(path)
    artifacts = find_shared("artifacts")  # fitted per-model artifacts (e.g. Q-Filters' filters)
    if artifacts is not None:
        import os

        dirs = [d for d in os.environ.get("VELOX_ARTIFACTS", "").split(":") if d]
        if str(artifacts) not in dirs:
            os.environ["VELOX_ARTIFACTS"] = ":".join([*dirs, str(artifacts)])
    store = None
    if backend() == "cpu":
        first = next(iter(v for _, v in _params(model)))
        store = mx.bfloat16 if first.dtype == mx.bfloat16 else mx.float16
        model.set_dtype(mx.float32)
    return model, tokenizer, store, path


def _params(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def _samples(stream: np.ndarray, s: BenchSettings) -> list[tuple[list[int], list[int]]]:
    need = s.context + s.continuation
    if len(stream) < need:
        raise ValueError(
            f"the evaluation text has {len(stream)} tokens; --context {s.context} needs {need}"
        )
    starts = np.linspace(0, len(stream) - need, num=s.samples).astype(int)
    return [
        (
            [int(t) for t in stream[a : a + s.context]],
            [int(t) for t in stream[a + s.context : a + need]],
        )
        for a in starts
    ]


def run_bench(
    specs: list[Spec],
    model_path: str | None,
    data: str | None,
    settings: BenchSettings,
    progress=None,
    transfer: tuple[str, str] | None = None,
) -> tuple[list[Row], dict]:
    """Measure every spec; ``progress(description, advance)`` is called as work completes.

    ``transfer``: ``(mapper directory, source model)`` adds the transfer row
    (:mod:`velox_cli.transfer_row`) after the specs'; both are checked before any row runs.
    """
    s = settings.resolved()
    model, tokenizer, store, path = load_model(model_path)
    xfer = None
    if transfer is not None:
        from .transfer_row import open_transfer

        xfer = open_transfer(*transfer, model, tokenizer, store, load_model)
    stream = token_stream(tokenizer, load_text(data))
    samples = _samples(stream, s)
    prompts = recall_prompts(tokenizer, stream, s.recall_lengths(), DEPTHS, s.recall_trials)
    tick = progress or (lambda desc, n=1: None)
    tick("fp16 reference", 0)
    ref = reference_run(
        model, lambda: build_caches(Spec("fp16", "fp16"), model, store), samples, s.chunk
    )
    rows = []
    for spec in specs:
        tick(spec.text, 0)
        row = Row(spec.text, spec.name, dict(spec.params), s.context)
        make = lambda spec=spec: build_caches(spec, model, store)  # noqa: E731
        mx.clear_cache()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        try:
            decode_quality(model, make, samples, ref, row, s.chunk)
            row.retrieval, row.retrieval_by_length = retrieval(
                model, tokenizer, make, prompts, s.chunk
            )
        except Exception as e:  # one broken method must not lose the others' results
            row.error = f"{type(e).__name__}: {e}"
        row.peak_memory = int(mx.get_peak_memory())
        rows.append(row)
        tick(f"{spec.text} ({time.perf_counter() - t0:.0f}s)", 1)
    if xfer is not None:
        tick(xfer.spec, 0)
        t0 = time.perf_counter()
        rows.append(xfer.measure(model, tokenizer, samples, ref, prompts, s.chunk))
        tick(f"{xfer.spec} ({time.perf_counter() - t0:.0f}s)", 1)
    info = {
        "model": path,
        "backend": backend(),
        "context": s.context,
        "samples": s.samples,
        "continuation": s.continuation,
        "recall_prompts": len(prompts),
        "recall_lengths": s.recall_lengths(),
        "chunk": s.chunk,
        "compute_dtype": str(next(iter(v for _, v in _params(model))).dtype),
        "storage_dtype": None if store is None else str(store),
        "fp16_cache_bytes": ref.cache_bytes,
        "fp16_tokens": ref.tokens,
        "data": data or "shared/data/heldout.jsonl.gz",
        "blas": active_blas(),
    }
    if xfer is not None:
        info["transfer"] = xfer.describe()
    return rows, info


def write_json(path: str, rows: list[Row], info: dict) -> None:
    """A JSON list of rows, one per spec; each carries the run's settings under ``run``."""
    out = [{**r.to_json(), "run": info} for r in rows]
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
