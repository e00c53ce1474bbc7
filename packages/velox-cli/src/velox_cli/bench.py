"""``velox bench``: every spec on one model, offline, in one run.

The fp16 run comes first (its distributions are the reference for KL and top-1, its bytes the
reference for compression, and its own measurements the fp16 row's); then each spec runs the
same samples and recall prompts. Results are printed as a table, optionally written as JSON
rows and drawn as a PNG chart of quality (KL) against memory (bytes per token).

On a CPU backend the specs run in ``jobs`` worker processes at once (default: one per CPU core
this process may use, fewer where memory would not hold that many copies of the model), each
loading the model once and measuring whole specs; the rows are the same as one process's
(each spec's caches, samples and prompts are its own), their speeds are measured beside the
other jobs. ``jobs=1`` measures every spec in this process, one after another.
"""

from __future__ import annotations

import copy
import ctypes
import json
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core.kernels import backend

from .blas import active_blas
from .data import find_shared, load_text, recall_prompts, token_stream
from .evaluate import Row, decode_quality, reference_run, retrieval
from .specs import Spec, build_caches

__all__ = ["DEPTHS", "BenchSettings", "auto_jobs", "load_model", "run_bench"]

DEPTHS = (0.1, 0.5, 0.9)  # where the recalled definition sits in the context


@dataclass
class BenchSettings:
    """How much to measure. ``quick`` shrinks everything for a smoke run. ``jobs``: worker
    processes measuring specs at once (0: :func:`auto_jobs`; 1: all in this process)."""

    context: int = 2048
    samples: int = 1
    continuation: int = 32
    recall_trials: int = 1
    chunk: int = 512
    quick: bool = False
    jobs: int = 1

    def resolved(self) -> BenchSettings:
        if not self.quick:
            return self
        return BenchSettings(min(self.context, 1024), 1, 16, 1, self.chunk, True, self.jobs)

    def recall_lengths(self) -> list[int]:
        return [self.context]


def model_path(path: str | None) -> str:
    """The mlx-lm directory ``load_model`` reads for ``path`` (a GGUF or a name is converted
    once, see ``velox_cli.models``; None: the reference model in ``shared/``)."""
    from .models import resolve

    if path is None:
        found = find_shared("reference-model")
        if found is None:
            raise FileNotFoundError(
                "reference model not found (shared/reference-model); pass --model PATH"
            )
        return str(found)
    return str(resolve(path))


def model_head_dim(path: str | None) -> int:
    """The attention head dimension in the model's ``config.json`` (``head_dim``, else
    ``hidden_size / num_attention_heads``), read without loading the weights."""
    config = json.loads((Path(model_path(path)) / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def load_model(path: str | None, group: Any = None, pipeline: bool = False):
    """``mlx_lm.load`` of ``path``: an mlx-lm directory, a ``.gguf`` file or a model name such
    as ``smollm2`` (a GGUF converted once into velox's cache, see ``velox_cli.models``);
    default: the reference model in ``shared/``.

    With a distributed ``group`` of more than one process (``mlx.launch``) the model is
    loaded split over it, as mlx-lm's server does (``mlx_lm.utils.sharded_load``): by heads
    (``model.shard``), or into pipeline stages with ``pipeline``.

    On a CPU the model computes in float32 and caches store float16 (see ``specs``).
    Returns ``(model, tokenizer, storage dtype or None, resolved path)``.
    """
    import mlx_lm

    path = model_path(path)
    if group is not None and group.size() > 1:
        from mlx_lm.utils import sharded_load

        if pipeline and not (Path(path) / "model.safetensors.index.json").is_file():
            raise ValueError(
                f"pipeline stages need the model's model.safetensors.index.json (mlx_lm.convert "
                f"writes it), which {path} lacks"
            )
        model, tokenizer = sharded_load(
            path,
            pipeline_group=group if pipeline else None,
            tensor_group=None if pipeline else group,
        )
    elif pipeline:
        raise ValueError("pipeline stages need several processes: run under mlx.launch")
    else:
        model, tokenizer = mlx_lm.load(path)
    artifacts = find_shared("artifacts")  # fitted per-model artifacts (e.g. Q-Filters' filters)
    if artifacts is not None:
        from velox_core import environment

        dirs = [d for d in (environment.get("VELOX_ARTIFACTS") or "").split(":") if d]
        if str(artifacts) not in dirs:
            environment.put("VELOX_ARTIFACTS", ":".join([*dirs, str(artifacts)]))
    store = None
    if backend() == "cpu":
        first = next(iter(v for _, v in _params(model)))
        store = mx.bfloat16 if first.dtype == mx.bfloat16 else mx.float16
        model.set_dtype(mx.float32)
    return model, tokenizer, store, path


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _available_memory() -> int | None:
    """Bytes of memory available to new processes (Linux ``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


WORKER_OVERHEAD = 512 * 2**20  # a worker's own memory beside the weights (imports, caches)


def auto_jobs(specs: int, weight_bytes: int = 0) -> int:
    """Worker processes for ``specs`` specs: one per usable CPU core on MLX's CPU backend (a
    GPU is one device: 1), at most one per spec, and no more than available memory holds at
    four times the weights' bytes plus :data:`WORKER_OVERHEAD` each."""
    if backend() != "cpu":
        return 1
    jobs = min(_usable_cpus(), max(specs, 1))
    avail = _available_memory()
    if avail is not None:
        jobs = min(jobs, avail // (4 * weight_bytes + WORKER_OVERHEAD))
    return max(1, jobs)


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


def _measure(spec: Spec, w: dict[str, Any], ref, quality: Row | None) -> Row:
    """One spec's row on the bench's model and data ``w``. ``quality``: the fp16 row that the
    reference run already filled (only its recall is left to measure); otherwise the samples
    run first. A method that raises gets its error in the row, not the run's end."""
    s = w["settings"]
    row = (
        quality if quality is not None else Row(spec.text, spec.name, dict(spec.params), s.context)
    )
    model, store = w["model"], w["store"]
    make = lambda: build_caches(spec, model, store)  # noqa: E731
    mx.clear_cache()
    mx.reset_peak_memory()
    try:
        if quality is None:
            decode_quality(model, make, w["samples"], ref, row, s.chunk, w["tokenizer"])
        row.retrieval, row.retrieval_by_length = retrieval(
            model, w["tokenizer"], make, w["prompts"], s.chunk
        )
    except Exception as e:  # one broken method must not lose the others' results
        row.error = f"{type(e).__name__}: {e}"
    row.peak_memory = max(row.peak_memory, int(mx.get_peak_memory()))
    return row


_WORKER: dict[str, Any] = {}  # a worker process's model, tokenizer, samples and prompts


def _workspace(model, tokenizer, store, samples, prompts, settings: BenchSettings) -> dict:
    """What measuring a spec reads: the model, its data and the settings."""
    return {
        "model": model,
        "tokenizer": tokenizer,
        "store": store,
        "samples": samples,
        "prompts": prompts,
        "settings": settings,
    }


def _die_with_parent(parent: int, poll: float = 0.5) -> None:
    """End this (worker) process as soon as process ``parent`` is gone, however it ended
    (a SIGKILL included): on Linux the kernel sends SIGKILL (``PR_SET_PDEATHSIG``), and
    everywhere a daemon thread polls ``os.getppid()`` (reparented: the parent died)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os._exit(1)

    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)
    threading.Thread(target=watch, name="velox-bench-parent", daemon=True).start()


def _worker_init(path: str, samples, prompts, settings: BenchSettings, parent: int) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the workers
    model, tokenizer, store, _ = load_model(path)
    _WORKER.update(_workspace(model, tokenizer, store, samples, prompts, settings))


def _worker_ready() -> int:
    return os.getpid()


def _worker_measure(spec: Spec, ref, quality: Row | None) -> tuple[Row, float]:
    t0 = time.perf_counter()
    row = _measure(spec, _WORKER, ref, quality)
    return row, time.perf_counter() - t0


def _fp16_quality(spec: Spec, fp16: Row | None) -> Row | None:
    """The reference run's fp16 row for a plain ``fp16`` spec (a copy each), else None."""
    return copy.deepcopy(fp16) if fp16 is not None and spec.name == "fp16" else None


def run_bench(
    specs: list[Spec],
    model_path: str | None,
    data: str | None,
    settings: BenchSettings,
    progress=None,
    transfer: tuple[str, str] | None = None,
    on_row=None,
    on_skip=None,
) -> tuple[list[Row], dict]:
    """Measure every spec; ``progress(description, advance)`` is called as work completes.

    ``transfer``: ``(mapper directory, source model)`` adds the transfer row
    (:mod:`velox_cli.transfer_row`) after the specs'; both are checked before any row runs.
    ``on_row(rows, info)``: called each time a row is finished, with the rows finished so far
    (in the order of ``specs``) and the run's info (``velox bench --json`` rewrites its file
    there, so a stopped run keeps them). An interrupt (KeyboardInterrupt) ends the worker
    processes at once and propagates.

    A spec whose method needs a file fitted on the model (Palu's bases, CommVQ's codebooks,
    Q-Filters' filters) and finds none is skipped, not measured: ``on_skip(spec, reason)``
    is called with the reason, which names the fit command, and ``info["skipped"]`` lists
    them.
    """
    s = settings.resolved()
    if s.jobs < 0:
        raise ValueError(f"jobs must be 0 (one per CPU core) or a positive count, got {s.jobs}")
    model, tokenizer, store, path = load_model(model_path)
    xfer = None
    if transfer is not None:
        from .transfer_row import open_transfer

        xfer = open_transfer(*transfer, model, tokenizer, store, load_model)
    tick = progress or (lambda desc, n=1: None)
    skipped: list[dict[str, str]] = []
    specs = [x for x in specs if not _skip(x, model, store, skipped, tick, on_skip)]
    stream = token_stream(tokenizer, load_text(data))
    samples = _samples(stream, s)
    prompts = recall_prompts(tokenizer, stream, s.recall_lengths(), DEPTHS, s.recall_trials)
    weights = sum(v.nbytes for _, v in _params(model))
    jobs = min(s.jobs or auto_jobs(len(specs), weights), max(len(specs), 1))
    w = _workspace(model, tokenizer, store, samples, prompts, s)
    pool = None
    if jobs > 1:  # workers start (import, load the model) while the reference runs here
        pool = ProcessPoolExecutor(
            jobs,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(str(path), samples, prompts, s, os.getpid()),
        )
        for _ in range(jobs):
            pool.submit(_worker_ready)
    try:
        tick("fp16 reference", 0)
        fp16 = Row("fp16", "fp16", {}, s.context) if any(x.name == "fp16" for x in specs) else None
        mx.clear_cache()
        mx.reset_peak_memory()
        ref = reference_run(
            model,
            lambda: build_caches(Spec("fp16", "fp16"), model, store),
            samples,
            s.chunk,
            row=fp16,
        )
        if fp16 is not None:
            fp16.peak_memory = int(mx.get_peak_memory())
        info = _run_info(path, s, ref, model, store, data, prompts, jobs, xfer)
        info["skipped"] = skipped
        finished = (lambda rows: on_row(rows, info)) if on_row is not None else None
        if pool is None:
            rows = []
            for spec in specs:
                tick(spec.text, 0)
                t0 = time.perf_counter()
                rows.append(_measure(spec, w, ref, _fp16_quality(spec, fp16)))
                tick(f"{spec.text} ({time.perf_counter() - t0:.0f}s)", 1)
                if finished is not None:
                    finished(list(rows))
        else:
            rows = _measure_in(pool, jobs, specs, ref, fp16, s.context, tick, finished)
    except BaseException:
        if pool is not None:  # an interrupt (or an error) must not wait for running specs
            _end_workers(pool)
            pool = None
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    if xfer is not None:
        tick(xfer.spec, 0)
        t0 = time.perf_counter()
        rows.append(xfer.measure(model, tokenizer, samples, ref, prompts, s.chunk))
        tick(f"{xfer.spec} ({time.perf_counter() - t0:.0f}s)", 1)
        if on_row is not None:
            on_row(list(rows), info)
    return rows, info


def fit_hint(e: BaseException) -> str:
    """The one line a skipped spec gets: no fitted file, and the command its method's message
    names to fit one (the message's first line where it names none)."""
    text = str(e).strip()
    found = re.search(r"`([^`]*\bfit\b[^`]*)`", text)
    if found:
        return f"no fitted file for this model; fit one with {found.group(1)}"
    return text.splitlines()[0] if text else type(e).__name__


def _skip(spec: Spec, model, store, skipped: list, tick, on_skip) -> bool:
    """Whether ``spec`` is skipped: its caches cannot be built for want of a fitted file
    (a ``FileNotFoundError``, as every method's missing-artifact error is). Other errors are
    left to the spec's row."""
    if spec.baseline:
        return False
    try:
        build_caches(spec, model, store)
    except FileNotFoundError as e:
        reason = fit_hint(e)
        skipped.append({"spec": spec.text, "reason": reason})
        tick(f"skipped {spec.text}", 0)
        if on_skip is not None:
            on_skip(spec, reason)
        return True
    except Exception:
        return False
    return False


def _end_workers(pool) -> None:
    """Kill ``pool``'s worker processes now, then shut it down (its work is cancelled; its
    thread, finding its workers dead, ends at once: nothing is left for the exit to wake)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        try:
            p.kill()
        except (OSError, ValueError):
            pass
    pool.shutdown(wait=True, cancel_futures=True)  # the workers are dead: its thread ends now
    for p in procs:
        try:
            p.join(2)
        except (OSError, ValueError, AssertionError):
            pass


def _run_info(path, s: BenchSettings, ref, model, store, data, prompts, jobs, xfer) -> dict:
    """The run's settings and environment, as each JSON row carries them under ``run``."""
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
        "fp16_cache_bytes": ref.cache_bytes,  # held bytes (velox_cli.evaluate.held_bytes)
        "fp16_tokens": ref.tokens,
        "fp16_ppl": ref.ppl if math.isfinite(ref.ppl) else None,
        "fp16_nll_se": ref.nll_se if math.isfinite(ref.nll_se) else None,
        "scored_tokens": ref.scored,
        "data": data or "shared/data/heldout.jsonl.gz",
        "blas": active_blas(),
        "jobs": jobs,
    }
    if xfer is not None:
        info["transfer"] = xfer.describe()
    return info


def _measure_in(
    pool, jobs: int, specs: list[Spec], ref, fp16: Row | None, context: int, tick, finished=None
) -> list[Row]:
    """Every spec's row measured by the worker processes of ``pool``, in the order of
    ``specs``. A worker that dies (a crash in native code) leaves an error in the rows of the
    specs that were still to measure. ``finished(rows)``: called as each row is done, with
    the rows done so far (in the order of ``specs``)."""
    tick(f"{len(specs)} specs in {jobs} worker processes", 0)
    todo = {
        pool.submit(_worker_measure, spec, ref, _fp16_quality(spec, fp16)): i
        for i, spec in enumerate(specs)
    }
    rows: list[Row | None] = [None] * len(specs)
    while todo:
        done, _ = wait(todo, return_when=FIRST_COMPLETED)
        for f in done:
            i = todo.pop(f)
            spec = specs[i]
            try:
                rows[i], secs = f.result()
            except BrokenProcessPool as e:
                rows[i] = Row(spec.text, spec.name, dict(spec.params), context)
                rows[i].error = f"the worker process measuring it died ({e})"
                secs = 0.0
            tick(f"{spec.text} ({secs:.0f}s)", 1)
            if finished is not None:
                finished([r for r in rows if r is not None])
    return rows


def write_json(path: str, rows: list[Row], info: dict) -> None:
    """A JSON list of rows, one per spec; each carries the run's settings under ``run``."""
    out = [{**r.to_json(), "run": info} for r in rows]
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp, target)  # a reader (or a stop) never sees half a file
