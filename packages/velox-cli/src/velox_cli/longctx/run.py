"""Run the long-context suite: every spec on every prompt, scored against the fp16 run.

For each prompt (:mod:`velox_cli.longctx.tasks`) the fp16 cache runs first: its greedy answer
is scored and its tokens, with their log-probabilities, are the reference. Then each spec's
caches take the same prompt:

- ``question="after"`` (the default): kvpress's protocol. The context is prefilled (in
  ``chunk``-token pieces, as mlx-lm prefills) and compressed as the cache compresses it, then
  the question is prefilled on top and held whole (:func:`prompt_caches`): the context is
  compressed without knowing the question, and a ``budget=P%`` share is of the context's
  tokens, as kvpress's compression ratio is;
- ``question="inside"``: context and question are one prompt, prefilled and compressed
  together, so a method that votes with the newest queries (SnapKV) sees the question.

``cut`` says when a retention policy cuts what it compresses (the context, or the whole
prompt inside): ``"once"`` (the default), at its end, the chunks held until then (each
policy's ``prefill="prompt"``), as kvpress compresses after one forward pass and the papers
compress a prompt once; ``"chunks"``, each prefill chunk as the next arrives (a policy's
default ``prefill="chunks"``, what mlx-lm's chunked prefill gives: peak memory of the budget
plus one chunk). A chunk cut before the next chunk attends changes the keys the layers above
compute for the rest of the context (docs/long-context.md, "KNorm on 8 prompts").

After the prompt a copy of the caches answers greedily (``max_new`` tokens; scored by string
match) and the caches themselves are teacher-forced along the fp16 answer: KL(fp16 || spec)
and top-1 agreement over the answer tokens. The bytes are counted (:func:`held_bytes`) on
the caches that answered, after the answer: what a user's decode holds, every deferred cut
made (a retention policy cuts a prefill chunk's tokens when the next tokens arrive).
Attention is routed to velox caches (:func:`velox_core.routed`).

Specs are those of ``velox bench`` (baselines, methods, ``A+B`` compositions), and a
``budget`` may be a share of the prompt: ``snapkv:budget=25%`` keeps a quarter of each
prompt's context (question after) or of the whole prompt (question inside).

The work is prompt-major: one worker process per CPU core (on MLX's CPU backend) takes whole
prompts and runs fp16 then every spec on each, so the reference never leaves its process.
"""

from __future__ import annotations

import copy
import faulthandler
import multiprocessing
import os
import re
import signal
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from velox_core import routed

from ..evaluate import after_prefill, greedy, held_bytes, prefill, teacher_force
from ..scoring import kl_rows
from ..specs import Spec, build_caches, parse
from .cells import Cell, Trial, aggregate, wilson
from .tasks import Prompt, TaskSpec, make_prompts, parse_task

__all__ = [
    "CUTS",
    "QUESTION_MODES",
    "Cell",
    "EvalSettings",
    "Trial",
    "aggregate",
    "budget_tokens",
    "finished_prompts",
    "held_bytes",
    "prompt_caches",
    "resolve_spec",
    "run_eval",
    "spec_check",
    "wilson",
]

QUESTION_MODES = ("after", "inside")
# when a retention policy cuts the compressed part of a prompt: once at its end, or per chunk
CUTS = ("once", "chunks")
_SHARE = re.compile(r"budget=(\d+(?:\.\d+)?)%")


def resolve_spec(text: str, tokens: int) -> str:
    """``text`` with every ``budget=P%`` replaced by that share of ``tokens`` (at least 16)."""
    return _SHARE.sub(lambda m: f"budget={max(16, round(float(m.group(1)) / 100 * tokens))}", text)


def spec_check(text: str) -> Spec:
    """Parse and validate a suite spec (a ``budget=P%`` share needs ``0 < P <= 100``)."""
    for m in _SHARE.finditer(text):
        if not 0 < float(m.group(1)) <= 100:
            raise ValueError(f"{text!r}: a budget share must be in (0, 100]%, got {m.group(0)}")
    parse(resolve_spec(text, 4096))  # validates names and parameters
    return Spec(text, parse(resolve_spec(text, 4096)).name)


SPLITS = ("auto", "prompts", "specs")


@dataclass
class EvalSettings:
    """What to run: tasks, lengths, prompts per cell, where the question goes, the
    haystack, the prompt template (raw text or the chat template), prefill chunk, seed and
    worker processes (0: one per CPU core on MLX's CPU backend, 1 on a GPU) and how work is
    split among them (``prompts``: whole prompts, each worker running every spec; ``specs``:
    each worker a share of the specs on every prompt, so each compiles its kernels once;
    ``auto``: prompts on a CPU, specs on a GPU), and when retention policies cut (``cut``:
    :data:`CUTS`, the module's docstring)."""

    tasks: list[str] = field(default_factory=lambda: ["passkey"])
    lengths: list[int] = field(default_factory=lambda: [4096])
    prompts: int = 8
    question: str = "after"
    haystack: str = "prose"
    template: str = "raw"
    chunk: int = 2048
    seed: int = 0
    jobs: int = 0
    split: str = "auto"
    cut: str = "once"

    def check(self) -> list[TaskSpec]:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.cut not in CUTS:
            raise ValueError(f"cut must be one of {', '.join(CUTS)}, got {self.cut!r}")
        if self.question not in QUESTION_MODES:
            raise ValueError(
                f"question must be one of {', '.join(QUESTION_MODES)}, got {self.question!r}"
            )
        for name in ("prompts", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lengths or any(n < 256 for n in self.lengths):
            raise ValueError(f"lengths must be at least 256 tokens, got {self.lengths}")
        if self.jobs < 0:
            raise ValueError(f"jobs must be 0 (auto) or positive, got {self.jobs}")
        return [parse_task(t) for t in self.tasks]


def window_bytes(caches: list) -> int:
    """Of the caches' :func:`held_bytes`, those of the layers that keep the model's own
    sliding-window cache (mlx-lm's ``RotatingKVCache``: Gemma 3's local layers, which
    ``make_cache`` leaves as they are): the same for fp16 and every spec on a prompt."""
    return sum(held_bytes(c) for c in caches if isinstance(c, RotatingKVCache))


def budget_tokens(prompt: Prompt, mode: str) -> int:
    """The tokens a ``budget=P%`` share is taken of: the context alone with the question
    after it (kvpress's compression ratio is of the context), the whole prompt inside."""
    return len(prompt.context) if mode == "after" else prompt.tokens


def prompt_caches(
    model, caches: list, prompt: Prompt, mode: str, chunk: int, tokenizer=None, cut: str = "once"
) -> mx.array:
    """Prefill the prompt into ``caches``; the logits of its last position.

    ``mode="inside"``: context and question as one prompt. With ``cut="once"`` it is
    compressed once at its end (each retention policy's ``prefill="prompt"``: the chunks
    accumulate and the cut comes at the first answer token, voted by the prompt's last
    queries, so the question chooses what is kept: kvpress's query-aware setting and the
    papers' protocol); with ``cut="chunks"`` each chunk is cut as the next arrives.
    ``mode="after"``: kvpress's protocol. The context is prefilled, then the question; a
    retention policy cuts the context back to its budget as the question arrives (voted by
    the context's own newest queries), and the question is held whole. With ``cut="once"``
    the context's chunks accumulate until then (``prefill="prompt"`` while the context is
    stored, ``"chunks"`` as the question arrives, so the cut the context owes is made then);
    with ``cut="chunks"`` each of its chunks is also cut as the next arrives. Left alone, a
    policy would cut once more at the first answer token, after the question's chunk: voted
    by the question's queries and trimming the question's length off the context, so the
    context would no longer be compressed without knowing the question. So once the question
    is stored, each policy drops that cut (``RetentionPolicy.hold_stored``) and its
    ``budget`` is raised by the question's length; decode then runs as the spec says
    (``every`` cuts, if set, from the raised budget).

    A method with a step after the prefill (:func:`velox_cli.evaluate.after_prefill`:
    KVzip's reconstruction, which needs ``tokenizer``) takes it once the context is stored
    (``after``; the whole prompt ``inside``), before the question.
    """
    if cut not in CUTS:
        raise ValueError(f"cut must be one of {', '.join(CUTS)}, got {cut!r}")
    policies = [p for p in (getattr(c, "policy", None) for c in caches) if p is not None]
    for policy in policies:  # the protocol decides when a prompt's chunks are cut
        policy.prefill = "prompt" if cut == "once" else "chunks"
    if mode == "inside":
        tokens = prompt.context + prompt.question
        logits = prefill(model, caches, tokens, chunk)
        after_prefill(model, tokenizer, caches, tokens)
        return logits
    prefill(model, caches, prompt.context, chunk)
    after_prefill(model, tokenizer, caches, prompt.context)
    for policy in policies:  # the cut the context owes: made as the question arrives
        policy.prefill = "chunks"
    logits = prefill(model, caches, prompt.question, chunk)
    for policy in policies:
        if policy.budget is not None:
            policy.hold_stored()  # no cut after the question's chunk
            policy.budget += len(prompt.question)  # decode cuts (``every``) keep it too
    return logits


def _greedy_logprobs(model, caches, logits: mx.array, n: int) -> tuple[list[int], np.ndarray]:
    """``n`` greedy tokens and the log-probabilities that chose each (rows ``(n, V)``)."""
    ids, rows = [], []
    for i in range(n):
        lp = logits.astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        y = mx.argmax(lp, axis=-1)
        mx.eval(lp, y)
        rows.append(np.array(lp))
        ids.append(int(y.item()))
        if i + 1 < n:
            logits = model(y[:, None], cache=caches)[:, -1]
    return ids, np.concatenate(rows, axis=0)


def _cut(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


def run_prompt(model, tokenizer, store, prompt: Prompt, i: int, specs: list[Spec], s) -> list:
    """fp16 then every spec on one prompt: one :class:`Trial` each (fp16 first)."""
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    base = dict(
        task=prompt.task, length=prompt.length, index=i, depth=prompt.depth, tokens=prompt.tokens
    )
    t0 = time.perf_counter()
    caches = build_caches(Spec("fp16", "fp16"), model, store)
    with routed(model):
        logits = prompt_caches(model, caches, prompt, s.question, s.chunk, cut=s.cut)
        ref_ids, ref_lp = _greedy_logprobs(model, caches, logits, prompt.max_new)
        ref_bytes = sum(held_bytes(c) for c in caches)
        ref_window = window_bytes(caches)
    del caches
    ref_ids = _cut(ref_ids, eos) or ref_ids[:1]
    ref_lp = ref_lp[: len(ref_ids)]
    ref_text = tokenizer.decode(ref_ids)
    fp16 = Trial("fp16", **base, score=prompt.score(ref_text), output=ref_text, kl=0.0, top1=1.0)
    fp16.bytes, fp16.window_bytes = ref_bytes, ref_window
    fp16.seconds = time.perf_counter() - t0
    trials = [fp16]
    for spec in specs:
        if spec.text == "fp16":
            continue
        t = Trial(spec.text, **base)
        t0 = time.perf_counter()
        try:
            share_of = budget_tokens(prompt, s.question)
            caches = build_caches(parse(resolve_spec(spec.text, share_of)), model, store)
            with routed(model):
                logits = prompt_caches(model, caches, prompt, s.question, s.chunk, tokenizer, s.cut)
                twin = copy.deepcopy(caches)  # answers greedily; the caches are teacher-forced
                out = greedy(model, twin, logits, prompt.max_new)
                t.bytes = sum(held_bytes(c) for c in twin)
                t.window_bytes = window_bytes(twin)
                del twin
                lp = teacher_force(model, caches, logits, ref_ids)
            del caches
            t.output = tokenizer.decode(_cut(out, eos))
            t.score = prompt.score(t.output)
            t.kl = float(np.mean(kl_rows(ref_lp, lp)))
            t.top1 = float(np.mean(np.argmax(lp, axis=-1) == np.asarray(ref_ids)))
        except Exception as e:  # one broken method must not lose the others' results
            t.error = f"{type(e).__name__}: {e}"
        t.seconds = time.perf_counter() - t0
        trials.append(t)
        mx.clear_cache()
    return trials


def finished_prompts(trials: list[Trial], specs: list[str]) -> int:
    """How many prompts ``trials`` hold every spec's trial for, fp16's included: with
    ``--split specs`` each worker reports its share of a prompt's specs as it finishes them,
    so a prompt some shares answered is not yet finished."""
    want = {*specs, "fp16"}
    got: dict[tuple[str, int, int], set[str]] = {}
    for t in trials:
        got.setdefault((t.task, t.length, t.index), set()).add(t.spec)
    return sum(want <= s for s in got.values())


def spread_order(n: int) -> list[int]:
    """``range(n)`` reordered so that every prefix is spread over it: the ends first, then
    each time the index farthest from those taken (prompt ``i``'s needle sits at depth
    ``i / (n - 1)``, so a prefix of the order samples every depth)."""
    if n <= 2:
        return list(range(n))
    order = [0, n - 1]
    while len(order) < n:
        order.append(max(range(n), key=lambda i: (min(abs(i - j) for j in order), -i)))
    return order


_WORKER: dict[str, Any] = {}


def _worker_init(path: str, parent: int) -> None:
    from ..bench import _die_with_parent, load_model

    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the workers
    # `kill -USR1 <worker>` prints where it is (every thread's Python stack) to its stderr:
    # what a share that finishes no prompt is running (benchmarks/longctx_gpu.sh sends it)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    model, tokenizer, store, _ = load_model(path)
    _WORKER.update(model=model, tokenizer=tokenizer, store=store)


def _worker_run(prompt: Prompt, i: int, specs: list[Spec], s: EvalSettings) -> list[Trial]:
    w = _WORKER
    return run_prompt(w["model"], w["tokenizer"], w["store"], prompt, i, specs, s)


def _run_by_specs(
    path: str,
    work: list[tuple[Prompt, int]],
    specs: list[Spec],
    settings: EvalSettings,
    jobs: int,
    tick: Callable[[str, float], None],
    on_trials: Callable[[list[Trial]], None] | None,
) -> list[Trial]:
    """``work`` with the specs dealt out to ``jobs`` worker processes, one share each, every
    worker running every prompt (fp16 first, as the reference of its share). On a GPU the
    first use of each method compiles its kernels, in every process that uses it: a worker
    that keeps to its share compiles each kernel once, where workers that take whole prompts
    would each compile them all. fp16's trial (the same in every share) is kept from the
    first share that finishes each prompt."""
    from ..bench import _end_workers

    shares = [specs[k::jobs] for k in range(jobs)]
    ctx = multiprocessing.get_context("spawn")
    pools = [
        ProcessPoolExecutor(
            1, mp_context=ctx, initializer=_worker_init, initargs=(path, os.getpid())
        )
        for _ in shares
    ]
    trials: list[Trial] = []
    left = {(i, p.task, p.length): len(shares) for p, i in work}
    have_fp16: set[tuple[int, str, int]] = set()
    try:
        todo = {
            pool.submit(_worker_run, p, i, share, settings): (p, i)
            for p, i in work
            for pool, share in zip(pools, shares)
        }
        while todo:
            done, _ = wait(todo, return_when=FIRST_COMPLETED)
            for f in done:
                p, i = todo.pop(f)
                key = (i, p.task, p.length)
                got = [t for t in f.result() if t.spec != "fp16" or key not in have_fp16]
                have_fp16.add(key)
                trials += got
                if on_trials is not None:
                    on_trials(got)
                left[key] -= 1  # the bar moves by each share's part of a prompt
                tick(
                    f"{p.task} @ {p.length} #{i} ({len(shares) - left[key]}/{len(shares)})",
                    1 / len(shares),
                )
    except BaseException:  # an interrupt (or an error) must not wait for running prompts
        for pool in pools:
            _end_workers(pool)
        raise
    for pool in pools:
        pool.shutdown(wait=True)
    return trials


def run_eval(
    specs: list[Spec],
    model_path: str | None,
    settings: EvalSettings,
    progress: Callable[[str, float], None] | None = None,
    on_trials: Callable[[list[Trial]], None] | None = None,
) -> tuple[list[Trial], dict]:
    """Every spec on every prompt of every task and length. ``progress(description,
    advance)`` is called as prompts complete, ``on_trials(trials)`` with each prompt's
    trials (so a run stopped midway keeps what it measured). Returns the trials and the
    run's settings."""
    from ..bench import _usable_cpus, load_model

    tasks = settings.check()
    tick = progress or (lambda desc, n=1: None)
    model, tokenizer, store, path = load_model(model_path)
    made = [
        make_prompts(
            tokenizer,
            task,
            length,
            settings.prompts,
            haystack=settings.haystack,
            seed=settings.seed,
            template=settings.template,
        )
        for length in settings.lengths
        for task in tasks
    ]
    # prompt index first, depths spread: a run stopped midway holds the same number of
    # prompts (give or take one) in every task and length, at depths spread over the
    # context, rather than all of some cells and none of others
    work = [(ps[i], i) for i in spread_order(settings.prompts) for ps in made]
    from velox_core.kernels import backend

    own = [s for s in specs if s.text != "fp16"]
    split = settings.split
    if split == "auto":
        split = "prompts" if backend() == "cpu" or not own else "specs"
    units = len(work) if split == "prompts" else len(own)
    jobs = max(1, min(settings.jobs or (_usable_cpus() if backend() == "cpu" else 1), units))
    trials: list[Trial] = []
    t_start = time.perf_counter()
    if jobs > 1 and split == "specs":
        del model
        trials = _run_by_specs(str(path), work, own, settings, jobs, tick, on_trials)
    elif jobs <= 1:
        for p, i in work:
            tick(f"{p.task} @ {p.length} #{i}", 0)
            done = run_prompt(model, tokenizer, store, p, i, specs, settings)
            trials += done
            if on_trials is not None:
                on_trials(done)
            tick(f"{p.task} @ {p.length} #{i}", 1)
    else:
        from ..bench import _end_workers

        del model
        pool = ProcessPoolExecutor(
            jobs,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(str(path), os.getpid()),
        )
        try:
            todo = {pool.submit(_worker_run, p, i, specs, settings): (p, i) for p, i in work}
            while todo:
                done, _ = wait(todo, return_when=FIRST_COMPLETED)
                for f in done:
                    p, i = todo.pop(f)
                    done = f.result()
                    trials += done
                    if on_trials is not None:
                        on_trials(done)
                    tick(f"{p.task} @ {p.length} #{i}", 1)
        except BaseException:  # an interrupt (or an error) must not wait for running prompts
            _end_workers(pool)
            raise
        pool.shutdown(wait=True)
    info = {
        "model": str(path),
        "backend": backend(),
        "tasks": [t.label for t in tasks],
        "lengths": list(settings.lengths),
        "prompts": settings.prompts,
        "question": settings.question,
        "haystack": settings.haystack,
        "template": settings.template,
        "chunk": settings.chunk,
        "cut": settings.cut,
        "seed": settings.seed,
        "jobs": jobs,
        "split": split if jobs > 1 else None,
        "storage_dtype": None if store is None else str(store),
        "seconds": round(time.perf_counter() - t_start, 1),
        "specs": [s.text for s in specs],
    }
    order = {t: k for k, t in enumerate(["fp16", *[s.text for s in specs]])}
    trials.sort(key=lambda t: (t.length, t.task, t.index, order.get(t.spec, 0)))
    return trials, info
