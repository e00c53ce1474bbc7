"""Where velox's and transformers' Gemma 3 keys part, as KNorm ranks them.

``benchmarks/kvpress_compare.py --model gemma3`` finds velox's KNorm keeping kvpress's
positions in layer 5 but fewer of them in layers 11 and 17. KNorm ranks each key by its L2
norm alone, so the kept sets differ only where the keys do. This script prefills one of the
suite's prompts (the context only, as both halves of that benchmark compress it) and takes
every layer's keys after RoPE (the keys a cache stores and KNorm ranks) from:

- transformers (in ``--kvpress-python``'s environment): the GGUF loaded as kvpress_compare's
  kvpress half loads it (float32, SDPA), the context in one forward pass; the keys from a
  hook on each layer's ``k_norm`` (before RoPE, which leaves a key's norm as it is) and the
  global layers' cached keys (after RoPE);
- velox, several ways (each a run of the context through mlx-lm's model under velox's
  routing, with a hook on each layer's RoPE taking the keys as they are computed):

  * ``velox``: as kvpress_compare runs it: ``velox_cli.bench.load_model`` (on a CPU: the
    weights as converted, computing in float32, caches storing the converted dtype;
    Gemma 3 is converted to bfloat16), KNorm's caches at the benchmark's budget on the
    global layers, the context prefilled in ``--chunk``-token chunks (each chunk cut back
    to the budget as the next arrives: ``prefill="chunks"``);
  * ``velox one chunk``: the same in one chunk (the cut comes after the whole context, as
    kvpress's);
  * ``velox float32``: the GGUF converted in float32 and caches storing float32, one chunk.

For each velox run and layer, against transformers: the largest relative difference of the
key norms, their Spearman rank correlation, the mean relative L2 distance of the keys
(global layers: transformers' sliding-layer keys are taken before RoPE) and the Jaccard
index of the two lowest-norm sets of kvpress's size (``int(n (1 - ratio))``), velox's norms
taken from its keys rounded to its storage dtype (what KNorm scores).

    python benchmarks/gemma3_key_drift.py --kvpress-python "$KVPRESS_PY" \\
        --json docs/data/gemma3-key-drift.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- transformers' keys (runs in kvpress's environment) -----------------------------------------


def _hf_worker(job_path: str, out_path: str) -> None:
    """Prefills the job's context in transformers (float32) and saves every layer's keys:
    ``pre`` (L, n, D) from ``k_norm`` (before RoPE), ``post`` (G, n, D) the global layers'
    cached keys, ``layers`` the global layers' indices."""
    import torch
    from kvpress_compare import load_job_model  # this script's folder is on sys.path
    from transformers import DynamicCache

    job, model = load_job_model(job_path)
    layers = model.model.layers
    pre: list = [None] * len(layers)

    def hook(i):
        def take(_module, _inputs, out):
            pre[i] = out[0, 0].detach().float().numpy().copy()  # (n, D): one KV head

        return take

    handles = [lay.self_attn.k_norm.register_forward_hook(hook(i)) for i, lay in enumerate(layers)]
    glob = [i for i, lay in enumerate(layers) if not getattr(lay.self_attn, "is_sliding", False)]
    ids = torch.tensor([job["context"]], dtype=torch.long)
    t = time.perf_counter()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    for h in handles:
        h.remove()
    _log(f"transformers: context prefilled ({time.perf_counter() - t:.0f} s)")
    post = np.stack([cache.layers[i].keys[0, 0].float().numpy() for i in glob])
    np.savez(out_path, pre=np.stack(pre), post=post, layers=np.array(glob))


# -- velox's keys --------------------------------------------------------------------------


class _KeyTap:
    """Stands in for one attention layer's RoPE: rotates as it does and keeps what it
    returns for the keys (one KV head: the queries have more) at their absolute positions."""

    def __init__(self, rope, kv_heads: int, n: int):
        self.rope, self.kv_heads, self.n = rope, kv_heads, n
        self.keys: dict[int, np.ndarray] = {}

    def __call__(self, x, offset=0):
        import mlx.core as mx

        out = self.rope(x, offset=offset)
        if x.shape[1] == self.kv_heads:
            off = int(offset) if not isinstance(offset, mx.array) else int(offset.item())
            k = np.array(out[0].astype(mx.float32))  # (H, T, D)
            for j in range(k.shape[1]):
                if off + j < self.n:
                    self.keys[off + j] = k[:, j]
        return out

    def stacked(self) -> np.ndarray:
        """``(H, n, D)`` float32: every context position's key."""
        return np.stack([self.keys[p] for p in range(self.n)], axis=1)


def _velox_keys(model, store, context: list[int], spec: str, chunk: int) -> np.ndarray:
    """Every layer's context keys ``(L, H, n, D)`` as velox computes them when ``spec``'s
    caches (storing ``store``; None: the model's dtype) take the context in ``chunk``-token
    chunks."""
    from velox_cli.scoring import prefill
    from velox_cli.specs import build_caches, parse
    from velox_core import routed

    layers = model.layers
    taps = []
    for lay in layers:
        att = lay.self_attn
        taps.append(_KeyTap(att.rope, att.n_kv_heads, len(context)))
        att.rope = taps[-1]
    try:
        caches = build_caches(parse(spec), model, store)
        for c in caches:
            if getattr(c, "policy", None) is not None:
                c.policy.prefill = "chunks"  # kvpress_compare's protocol (question after)
        with routed(model):
            prefill(model, caches, context, chunk)
    finally:
        for lay, tap in zip(layers, taps):
            lay.self_attn.rope = tap.rope
    return np.stack([t.stacked() for t in taps])


# -- comparison ------------------------------------------------------------------------------


def _ranks(x: np.ndarray) -> np.ndarray:
    r = np.empty(len(x))
    r[np.argsort(x, kind="stable")] = np.arange(len(x))
    return r


def _lowest(norms: np.ndarray, k: int) -> set[int]:
    return set(np.argsort(norms, kind="stable")[:k].tolist())


def layer_stats(vx: np.ndarray, vx_stored: np.ndarray, hf: np.ndarray, k: int) -> dict:
    """One layer's keys ``(n, D)``: velox's (as computed and as stored) against
    transformers'; ``k`` the kept count."""
    nv = np.linalg.norm(vx.astype(np.float64), axis=-1)
    ns = np.linalg.norm(vx_stored.astype(np.float64), axis=-1)
    nh = np.linalg.norm(hf.astype(np.float64), axis=-1)
    a, b = _lowest(ns, k), _lowest(nh, k)
    cut = np.sort(nh)[k - 1]
    rel = np.abs(nv - nh) / nh
    return {
        "norm_max_rel_diff": float(rel.max()),
        "norm_median_rel_diff": float(np.median(rel)),
        "norm_spearman": float(np.corrcoef(_ranks(nv), _ranks(nh))[0, 1]),
        "key_mean_rel_l2": float(np.mean(np.linalg.norm(vx.astype(np.float64) - hf, axis=-1) / nh)),
        "jaccard_lowest": len(a & b) / len(a | b),
        # transformers' norms within velox's median difference of the cut: the near ties
        "near_cut": int(np.sum(np.abs(nh - cut) <= np.median(np.abs(nv - nh)))),
        "norm_cv": float(nh.std() / nh.mean()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--task", default="multikey:keys=2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=0, help="which prompt of the task (0-based)")
    ap.add_argument("--ratio", type=float, default=0.75, help="kvpress's compression ratio")
    ap.add_argument("--chunk", type=int, default=2048, help="velox's prefill chunk (velox run)")
    ap.add_argument("--haystack", default="prose")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--kvpress-python", default=sys.executable)
    ap.add_argument("--json")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _hf_worker(*a.worker)
        return 0
    if not 0 < a.ratio < 1:
        ap.error(f"--ratio must be in (0, 1), got {a.ratio}")

    import mlx.core as mx
    import mlx_lm

    from velox_cli.bench import load_model
    from velox_cli.longctx.run import budget_tokens, resolve_spec
    from velox_cli.longctx.tasks import make_prompts, parse_task
    from velox_cli.models import gguf_path, resolve

    model, tokenizer, store, _ = load_model(a.model)
    prompt = make_prompts(
        tokenizer, parse_task(a.task), a.length, a.prompt + 1, haystack=a.haystack, seed=a.seed
    )[a.prompt]
    context = list(prompt.context)
    n = len(context)
    k = int(n * (1 - a.ratio))  # kvpress's compute_n_kept
    share = f"{round(100 * (1 - a.ratio), 6):g}"
    spec = resolve_spec(f"knorm:budget={share}%", budget_tokens(prompt, "after"))
    _log(f"{a.task} #{a.prompt}: {n} context tokens, {k} kept (velox: {spec})")

    tmp = Path(tempfile.mkdtemp(prefix="gemma3-keys-"))
    job = {"gguf": str(gguf_path(a.model)), "context": context, "threads": a.threads}
    (tmp / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VELOX_BLAS_ACTIVE")}
    env["TQDM_DISABLE"] = "1"  # torch brings its own BLAS; no progress bars
    out = tmp / "hf.npz"
    proc = subprocess.Popen(
        [a.kvpress_python, os.path.abspath(__file__), "--worker", str(tmp / "job.json"), str(out)],
        env=env,
    )

    runs: dict[str, tuple[np.ndarray, object]] = {}
    t = time.perf_counter()
    runs["velox"] = (_velox_keys(model, store, context, spec, a.chunk)[:, 0], store)
    _log(f"velox: chunks of {a.chunk} ({time.perf_counter() - t:.0f} s)")
    runs["velox one chunk"] = (_velox_keys(model, store, context, spec, n)[:, 0], store)
    _log(f"velox: one chunk ({time.perf_counter() - t:.0f} s)")
    del model
    m32, _ = mlx_lm.load(str(resolve(a.model, dtype="float32")))
    m32.set_dtype(mx.float32)
    keys32 = _velox_keys(m32, mx.float32, context, spec, n)[:, 0]
    runs["velox float32"] = (keys32, mx.float32)
    _log(f"velox: float32 ({time.perf_counter() - t:.0f} s)")

    if proc.wait() != 0:
        raise SystemExit("the transformers worker failed")
    with np.load(out) as z:
        pre, post, glob = z["pre"], z["post"], z["layers"].tolist()
    rope_check = {
        int(g): float(
            np.max(np.abs(np.linalg.norm(post[j], axis=-1) / np.linalg.norm(pre[g], axis=-1) - 1))
        )
        for j, g in enumerate(glob)
    }
    result: dict = {
        "model": a.model,
        "task": a.task,
        "length": a.length,
        "prompt": a.prompt,
        "context_tokens": n,
        "kept": k,
        "ratio": a.ratio,
        "chunk": a.chunk,
        "velox_spec": spec,
        "velox_storage": str(store),
        "global_layers": glob,
        # transformers: the largest relative change RoPE makes to a key's norm
        "hf_rope_norm_change": rope_check,
        "runs": {},
    }
    for name, (keys, dtype) in runs.items():
        stored = np.array(mx.array(keys).astype(dtype).astype(mx.float32))
        per = {}
        for layer in range(keys.shape[0]):
            hf = post[glob.index(layer)] if layer in glob else pre[layer]
            per[str(layer)] = layer_stats(keys[layer], stored[layer], hf, k)
            if layer not in glob:  # transformers' keys before RoPE: norms compare, not vectors
                per[str(layer)]["key_mean_rel_l2"] = None
        result["runs"][name] = per
    for name, per in result["runs"].items():
        _log(f"-- {name}")
        _log("layer  max rel  spearman  jaccard  near cut")
        for layer, s in per.items():
            mark = "*" if int(layer) in glob else " "
            _log(
                f"{layer:>4}{mark} {s['norm_max_rel_diff']:8.4f} {s['norm_spearman']:9.5f} "
                f"{s['jaccard_lowest']:8.3f} {s['near_cut']:9d}"
            )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
