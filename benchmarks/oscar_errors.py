"""Per-layer coding error of OSCAR and the 2-bit baselines on a model's real keys and values.

One long-context prompt (velox eval's generator: a task's needles in the prose haystack, the
question after) runs once through the model with exact caches; each velox-cached layer's
post-RoPE keys and values (as its cache gets them) and its queries are captured. Every spec's
cache for that layer (``make_cache`` as ``velox eval`` makes it: the artifacts it finds, the
CPU's storage dtype) is then fed the first ``n`` captured tokens (the context cut to whole
128-token groups, so KIVI's and KVarN's groups are all coded) and read back decoded; the
rest of the context and the question stay exact for every spec. Per layer and spec:

* ``key_mse``, ``value_mse``: relative squared error ``|x - x_hat|^2 / |x|^2`` of the ``n``
  coded tokens (``exact_tokens``: how many of them came back as given, rounded to the
  storage dtype: sinks, a window);
* ``attn_kl``: KL of the question's attention weights (its queries over every earlier
  token, the model's scale) with the coded keys against the exact ones, mean over query
  heads and question tokens;
* ``out_err``: the attention output's relative squared error with both sides coded;
  ``out_err_k``, ``out_err_v`` with one;
* ``bits``: the cache's held bytes over the ``n`` tokens' key and value entries, in bits an
  element (OSCAR's rotations included).

``--centred SPEC ...`` also runs those specs on keys minus their mean over the ``n`` coded
tokens (added back after decoding): a diagnostic for methods without such an option (the
softmax ignores a shift common to every key, so this is the part of the key error such a
shift removes); OSCAR's own ``centre=true`` takes off the mean fitted with its rotations.

Per layer it also reports how much of the keys' energy the queries read (``anisotropy``,
the mean over KV heads): with ``C_Q`` the query covariance and ``S`` the key covariance
over the tokens, the logits vary across tokens by ``tr(C_Q S)``. An error spread evenly over
the channels (a rotated per-token code) with ``|e|^2 = eps |k|^2`` moves them by
``eps E|k|^2 tr(C_Q) / D``: ``iso = E|k|^2 tr(C_Q) / (D tr(C_Q S))`` is that noise over the
signal per unit relative MSE (``iso_centred`` with ``E|k - mean|^2``); an error shaped like
each channel's own spread (a per-channel code) gives ``channel = E|k|^2 tr(C_Q diag S) /
(tr(S) tr(C_Q S))``.

    python benchmarks/oscar_errors.py --model gemma3 --length 1024 \\
        --json docs/data/oscar-errors-gemma3.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import mlx.core as mx
import numpy as np

from velox_cli.bench import load_model
from velox_cli.evaluate import held_bytes
from velox_cli.longctx.tasks import make_prompts
from velox_cli.specs import build_caches, parse
from velox_core import RetentionPolicy, VeloxCache, make_cache, routed

SPECS = (
    "oscar:bits=8,sinks=0,window=0",
    "oscar:bits=2,sinks=0,window=0",
    "oscar:bits=2,sinks=0,window=0,group=32",
    "oscar:bits=2,sinks=0,window=0,centre=true",
    "oscar:bits=2,sinks=0,window=0,rotation=hadamard,centre=true",
    "oscar:bits=2,sinks=0,window=0,key_clip=1,value_clip=1",
    "oscar:bits=2,sinks=0,window=0,rotation=hadamard",
    "oscar:bits=2,sinks=0,window=0,rotation=hadamard,key_clip=1,value_clip=1",
    "oscar:key_bits=3,value_bits=2,sinks=0,window=0",
    "oscar:key_bits=4,value_bits=2,sinks=0,window=0",
    "uniform:bits=2,group=128",
    "kivi:bits=2,group=128,window=0",
    "turboquant:bits=2",
    "turboquant:bits=3",
    "kvarn:bits=2,sinks=0",
)
# keys centred on the coded tokens' own mean: OSCAR without its fitted mean, and the other
# rotated per-token codes, which have no such option
CENTRED = ("oscar:bits=2,sinks=0,window=0", "turboquant:bits=2", "kvarn:bits=2,sinks=0")
BLOCK = 128  # KIVI's and KVarN's token groups: the coded prefix is a whole number of them


class _Capture(RetentionPolicy):
    """Keeps every token and records the queries of each attention call (and the scale)."""

    name = "oscar-errors-capture"

    def __init__(self, store: dict, layer: int):
        super().__init__()
        self.store, self.layer = store, layer

    def observe(self, view, queries: mx.array, scale: float) -> None:
        qs, _ = self.store.get(self.layer, ([], scale))
        qs.append(queries.astype(mx.float32))
        self.store[self.layer] = (qs, scale)


def capture(model, context: list[int], question: list[int], chunk: int):
    """Each velox-cached layer's queries ``(Hq, T, D)``, keys and values ``(H, T, D)`` (the
    model's dtype) and attention scale."""
    store: dict = {}
    caches = make_cache(model, lambda i: VeloxCache(policy=_Capture(store, i)))
    ids = context + question
    with routed(model):
        for s in range(0, len(context), chunk):
            model(mx.array(context[s : s + chunk])[None], cache=caches)
        model(mx.array(question)[None], cache=caches)
    out = {}
    for i, (qs, scale) in store.items():
        k, v = caches[i].keys_and_values()
        q = mx.concatenate(qs, axis=2)[0]
        mx.eval(q, k, v)
        assert q.shape[1] == len(ids) == k.shape[2], (q.shape, k.shape, len(ids))
        out[i] = (q, k[0], v[0], scale)
    return out


def _attention(q, k, v, scale, first: int):
    """Softmax weights and outputs of query rows ``first..T-1`` over their causal prefix.

    Shapes: q ``(Hq, T, D)``, k and v ``(H, T, D)`` float32; returns ``(Hq, n, T)``, ``(Hq, n,
    D)``."""
    hq, t = q.shape[0], q.shape[1]
    rep = hq // k.shape[0]
    k, v = mx.repeat(k, rep, axis=0), mx.repeat(v, rep, axis=0)
    s = (q[:, first:] @ mx.swapaxes(k, -1, -2)) * scale
    pos = mx.arange(t)
    mask = pos[None, :] <= mx.arange(first, t)[:, None]
    s = mx.where(mask[None], s, -mx.inf)
    logp = s - mx.logsumexp(s, axis=-1, keepdims=True)
    p = mx.exp(logp)
    return logp, p @ v


def _rel(a, b) -> float:
    return float((mx.sum((a - b) ** 2) / mx.sum(b * b)).item())


def layer_errors(q, k, v, kh, vh, scale, first: int, n: int) -> dict:
    """The errors of one layer's coded keys and values (their first ``n`` tokens coded)."""
    k, v, kh, vh = (x.astype(mx.float32) for x in (k, v, kh, vh))
    lp, o = _attention(q, k, v, scale, first)
    lph, ok = _attention(q, kh, v, scale, first)
    _, ov = _attention(q, k, vh, scale, first)
    _, okv = _attention(q, kh, vh, scale, first)
    p = mx.exp(lp)
    kl = mx.sum(mx.where(p > 0, p * (lp - lph), 0.0), axis=-1)
    return {
        "key_mse": _rel(kh[:, :n], k[:, :n]),
        "value_mse": _rel(vh[:, :n], v[:, :n]),
        "attn_kl": float(mx.mean(kl).item()),
        "out_err": _rel(okv, o),
        "out_err_k": _rel(ok, o),
        "out_err_v": _rel(ov, o),
    }


def coded(model, store, spec: str, layer: int, k, v, n: int, centred: bool = False):
    """The layer's cache for ``spec`` (storage dtype ``store``, as ``velox eval`` makes it),
    fed the first ``n`` tokens of ``k`` and ``v`` ``(H, T, D)`` in one update (``centred``:
    the keys less their mean, added back after decoding). Returns the keys and values with
    those ``n`` decoded and the rest exact, the cache's held bytes, and how many of the
    ``n`` keys came back as given (rounded to the storage dtype: sinks, a window)."""
    cache = build_caches(parse(spec), model, store)[layer]
    shift = mx.mean(k[:, :n], axis=1, keepdims=True) if centred else mx.zeros((1, 1, 1))
    given = k[:, :n] - shift
    cache.update_and_fetch(given[None], v[None, :, :n])
    kh, vh = cache.keys_and_values()
    rounded = given.astype(store or given.dtype).astype(kh.dtype)
    exact = int(mx.sum(mx.all(kh[0] == rounded, axis=(0, 2))).item())
    kh = mx.concatenate([kh[0].astype(k.dtype) + shift, k[:, n:]], axis=1)
    vh = mx.concatenate([vh[0].astype(v.dtype), v[:, n:]], axis=1)
    mx.eval(kh, vh)
    return kh, vh, held_bytes(cache), exact


def anisotropy(q, k) -> dict:
    """How a key error's logit noise compares with the logits' own spread (the module's
    ``iso``, ``iso_centred`` and ``channel``), the mean over KV heads.

    Shapes: q ``(Hq, T, D)``, k ``(H, T, D)``."""
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    h, d = k.shape[0], k.shape[-1]
    out = []
    for j, kj in enumerate(k):
        qj = q[j * (q.shape[0] // h) : (j + 1) * (q.shape[0] // h)].reshape(-1, d)
        c_q = qj.T @ qj / len(qj)
        s = np.cov(kj.T, bias=True)
        signal = np.trace(c_q @ s)
        energy = np.mean(np.sum(kj * kj, axis=1))
        out.append(
            (
                energy * np.trace(c_q) / (d * signal),
                np.trace(s) * np.trace(c_q) / (d * signal),
                energy * np.trace(c_q * np.diag(np.diag(s))) / (np.trace(s) * signal),
            )
        )
    iso, centred, channel = np.mean(out, axis=0)
    return {"iso": float(iso), "iso_centred": float(centred), "channel": float(channel)}


def main(argv=None) -> list[dict]:
    """Run the measurement; returns its rows (one per spec, key treatment and layer)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model name or path (default: reference)")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--task", default="multikey:keys=2")
    ap.add_argument("--haystack", default="prose")
    ap.add_argument("--prompt", type=int, default=0, help="which prompt of --prompts")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--specs", nargs="+", default=list(SPECS))
    ap.add_argument("--centred", nargs="*", default=list(CENTRED))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    model, tokenizer, store, _ = load_model(args.model)
    prompt = make_prompts(tokenizer, args.task, args.length, args.prompts, haystack=args.haystack)[
        args.prompt
    ]
    ctx, qst = prompt.context, prompt.question
    layers = capture(model, ctx, qst, args.chunk)
    first = len(ctx)
    n = BLOCK * (first // BLOCK)
    aniso = {}
    for i, (q, k, _, _) in sorted(layers.items()):
        aniso[i] = anisotropy(q[:, :n], k[:, :n].astype(mx.float32))
        print(f"L{i:<3d} " + " ".join(f"{a} {x:.2f}" for a, x in aniso[i].items()), flush=True)
    rows = []
    runs = [(s, False) for s in args.specs] + [(s, True) for s in args.centred]
    for spec, centred in runs:
        for i, (q, k, v, scale) in sorted(layers.items()):
            kh, vh, nbytes, exact = coded(model, store, spec, i, k, v, n, centred)
            row = {"spec": spec, "layer": i, "keys": "centred" if centred else "as given"}
            row.update(layer_errors(q, k, v, kh, vh, scale, first, n))
            row["exact_tokens"] = exact
            row["bits"] = 8 * nbytes / (n * k.shape[0] * (k.shape[2] + v.shape[2]))
            rows.append(row)
            label = spec + (" (keys centred)" if centred else "")
            print(
                f"{label:64s} L{i:<3d} kmse {row['key_mse']:.4f} vmse {row['value_mse']:.4f} "
                f"kl {row['attn_kl']:.4f} out {row['out_err']:.4f} (k {row['out_err_k']:.4f}"
                f" v {row['out_err_v']:.4f}) bits {row['bits']:.2f} exact {row['exact_tokens']}",
                flush=True,
            )
    if args.json:
        info = {
            "model": args.model or "reference",
            "task": args.task,
            "length": args.length,
            "haystack": args.haystack,
            "prompt": args.prompt,
            "context_tokens": len(ctx),
            "coded_tokens": n,
            "question_tokens": len(qst),
            "compute_dtype": str(next(iter(layers.values()))[1].dtype),
            "storage_dtype": str(store),
            "machine": platform.machine(),
        }
        Path(args.json).write_text(
            json.dumps({"info": info, "anisotropy": aniso, "rows": rows}, indent=1) + "\n"
        )
    return rows


if __name__ == "__main__":
    main()
