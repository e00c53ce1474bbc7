"""A saved cache on disk: KVTC against velox's ``save_cache`` (issue 51).

    python benchmarks/kvtc_disk.py [--tokens 8192] [--prompts 2] [--steps 32]
        [--ratios 16 20 24 32] [--specs uniform:bits=4 uniform:bits=2] [--json PATH]

For each prompt (``--tokens`` tokens of the held-out text, starting at evenly spaced offsets,
as ``velox bench`` cuts its samples) the reference model (velox_cli's default: the model in
``shared/``, computing in float32, caches stored in float16) prefills an mlx-lm ``KVCache``
in chunks of 1,024 tokens. That cache is written by ``velox_core.save_cache`` (the fp16
file) and by ``velox_kvtc.save`` at each ``--ratio`` (the shipped KVTC basis,
``shared/artifacts/kvtc-reference-model.safetensors``); each ``--spec`` is a velox cache
prefilled on the same prompt and written by ``save_cache``. Every file is loaded back and
decoded from, against the fp16 cache:

* **KL** and **top-1**: mean KL(p_fp16 || p_loaded) of the next-token distributions and
  agreement of their argmax, over ``--steps`` teacher-forced tokens of the text that follows
  the prompt (the decode path, as ``velox bench`` measures);
* **same tokens**: how many of ``--steps`` greedy tokens equal the fp16 cache's greedy
  tokens, the first step where they differ, and the fp16 logit margin (top-1 minus top-2)
  at that step (a small margin is a near-tie that any change of the cache can flip);
* **bytes**: the file's size; **x fp16**: the fp16 file's size over it; for KVTC also
  **x with basis**: with the basis's bytes (which every cache of the model shares) added once;
* save and load seconds (wall time on this machine, ``mx.eval`` included).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from _common import write_json
from mlx_lm.models.cache import KVCache

import velox_kvtc
from velox_cli.bench import load_model
from velox_cli.data import load_text
from velox_core import load_cache, make_cache, routed, save_cache
from velox_core.artifacts import token_stream
from velox_kvtc import SINKS, WINDOW
from velox_kvtc.features import to_rows

CHUNK = 1024


def _prefill(model, caches, ids: np.ndarray) -> None:
    with routed(model):
        for c in range(0, ids.size, CHUNK):
            model(mx.array(ids[c : c + CHUNK])[None], cache=caches)
            mx.eval([x.state for x in caches])


def _fp16_caches(model, ids: np.ndarray) -> list:
    caches = [KVCache() for _ in model.layers]
    _prefill(model, caches, ids)
    for c in caches:  # the model computes in float32 on a CPU; the cache stores float16
        k, v = c.keys_and_values()
        c.state = (k.astype(mx.float16), v.astype(mx.float16), c.offset)
    return caches


def _logprobs(model, caches, tokens: list[int]) -> mx.array:
    with routed(model):
        logits = model(mx.array(tokens)[None], cache=caches)[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _greedy(model, caches, first: int, steps: int) -> tuple[list[int], list[float]]:
    out, margins, y = [], [], mx.array([[first]])
    with routed(model):
        for _ in range(steps):
            logits = model(y, cache=caches)[0, -1].astype(mx.float32)
            top = mx.sort(logits)[-2:]
            margins.append(float(top[1] - top[0]))
            y = mx.argmax(logits)[None, None]
            out.append(int(y.item()))
    return out, margins


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _quality(model, load, text: list[int], ref: dict) -> dict:
    """``load()`` gives fresh caches; KL/top-1 over ``text``, greedy tokens against ``ref``."""
    lp = _logprobs(model, load(), text)
    kl = float(mx.mean(mx.sum(mx.exp(ref["lp"]) * (ref["lp"] - lp), axis=-1)))
    top1 = float(mx.mean(mx.argmax(lp, axis=-1) == mx.argmax(ref["lp"], axis=-1)))
    tokens, _ = _greedy(model, load(), text[0], len(ref["tokens"]))
    same = sum(a == b for a, b in zip(tokens, ref["tokens"]))
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref["tokens"])) if a != b), None)
    return {
        "kl": kl,
        "top1": top1,
        "same_tokens": same,
        "first_divergence": first,
        "fp16_margin_there": None if first is None else ref["margins"][first],
    }


def _fp16_row(model, caches, f: Path, text: list[int], steps: int) -> tuple[dict, dict]:
    _, save_s = _timed(lambda: save_cache(f, caches))
    _, load_s = _timed(lambda: mx.eval([[c.keys, c.values] for c in load_cache(f)]))
    ref = {"lp": _logprobs(model, load_cache(f), text)}
    ref["tokens"], ref["margins"] = _greedy(model, load_cache(f), text[0], steps)
    row = {
        "cache": "fp16 (save_cache)",
        "bytes": os.path.getsize(f),
        "x_fp16": 1.0,
        "save_s": save_s,
        "load_s": load_s,
        "kl": 0.0,
        "top1": 1.0,
        "same_tokens": steps,
        "first_divergence": None,
        "fp16_margin_there": None,
    }
    return row, ref


def _coded_errors(caches, loaded, basis) -> dict:
    """Root-mean-square error of the coded rows (RoPE undone), relative to their spread
    around the basis's mean, per side."""
    ropes = [basis.ropes[i] for i in basis.layers]
    kv = [[c.keys_and_values() for c in cs] for cs in (caches, loaded)]
    t = kv[0][0][0].shape[2]
    a, b = to_rows(kv[0], ropes, SINKS, t - WINDOW), to_rows(kv[1], ropes, SINKS, t - WINDOW)
    out = {}
    for side, x, y in zip(("key", "value"), a, b):
        spread = mx.sum(mx.square(x - basis.means[side]))
        out[f"{side}_rel_err"] = float(mx.sqrt(mx.sum(mx.square(x - y)) / spread))
    return out


def _kvtc_row(model, caches, basis, ratio: float, f: Path, text, ref, fp16: int) -> dict:
    sizes, save_s = _timed(lambda: velox_kvtc.save(f, caches, basis=basis, ratio=ratio))
    load = lambda: velox_kvtc.load(f, basis=basis)  # noqa: E731
    _, load_s = _timed(lambda: mx.eval([[c.keys, c.values] for c in load()]))
    errors = _coded_errors(caches, load(), basis)
    row = {
        "cache": f"kvtc ratio={ratio:g}",
        "bytes": sizes.total,
        "x_fp16": fp16 / sizes.total,
        "x_fp16_with_basis": fp16 / (sizes.total + sizes.basis),
        "basis_bytes": sizes.basis,
        "exact_bytes": sizes.exact,
        "codes_bytes": sizes.codes,
        "scales_bytes": sizes.scales,
        **errors,
        "save_s": save_s,
        "load_s": load_s,
    }
    return {**row, **_quality(model, load, text, ref)}


def _velox_row(model, spec: str, store, ids, f: Path, text, ref, fp16: int) -> dict:
    caches = make_cache(model, spec, storage_dtype=store)
    _prefill(model, caches, ids)
    _, save_s = _timed(lambda: save_cache(f, caches))
    load = lambda: load_cache(f, model=model)  # noqa: E731
    _, load_s = _timed(lambda: mx.eval([c.state[1:] for c in load()]))
    size = os.path.getsize(f)
    row = {
        "cache": f"{spec} (save_cache)",
        "bytes": size,
        "x_fp16": fp16 / size,
        "save_s": save_s,
        "load_s": load_s,
    }
    return {**row, **_quality(model, load, text, ref)}


def disk_args(description: str) -> argparse.ArgumentParser:
    """The options of every disk benchmark: the model, the prompts, the decode steps, --json."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default=None, help="mlx-lm model (default: the reference model)")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--prompts", type=int, default=2, help="prompts (held-out text offsets)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps compared")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    return ap


def disk_rows(args, prefix: str, basis: str | None = None, coded=None) -> tuple[list[dict], str]:
    """The rows of each of ``args.prompts`` prompts, each printed as a JSON line as it comes,
    and the model's path.

    A prompt's rows: the fp16 file's, then ``coded(model, caches, text, ref, fp16, tmp)``'s
    (when given), KVTC's at each of ``args.ratios`` (``basis``: the artifact, default the
    model's) and a velox cache's for each of ``args.specs``; files go to a fresh temporary
    folder named ``prefix...``."""
    model, tokenizer, store, path = load_model(args.model)
    store = store or mx.float16
    stream = token_stream(tokenizer, load_text(None))
    need = args.tokens + args.steps
    starts = np.linspace(0, len(stream) - need, num=args.prompts).astype(int)
    kvtc = velox_kvtc.load_basis(basis or velox_kvtc.resolve_basis(model)) if args.ratios else None
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    rows = []
    for p, a in enumerate(starts):
        ids = stream[a : a + args.tokens]
        text = [int(t) for t in stream[a + args.tokens : a + need]]
        caches = _fp16_caches(model, ids)
        row, ref = _fp16_row(model, caches, tmp / "fp16.safetensors", text, args.steps)
        fp16 = row["bytes"]
        out = [row]
        if coded is not None:
            out += coded(model, caches, text, ref, fp16, tmp)
        for ratio in args.ratios:
            f = tmp / f"kvtc-{ratio:g}.kvtc"
            out.append(_kvtc_row(model, caches, kvtc, ratio, f, text, ref, fp16))
        for spec in args.specs:
            f = tmp / "velox.safetensors"
            out.append(_velox_row(model, spec, store, ids, f, text, ref, fp16))
        for row in out:
            rows.append({"prompt": p, "start": int(a), **row})
            print(json.dumps(rows[-1]), flush=True)
    return rows, path


def print_table(args, path: str, rows: list[dict], extra: dict) -> None:
    """The rows as a Markdown table, ``extra``'s columns (header -> a row's cell) after
    ``x fp16``; written to ``args.json`` as well where it is set."""
    print(f"\n{args.tokens}-token prompts x {args.prompts}, {path}, {args.steps} decode steps")
    heads = ["prompt", "cache", "bytes", "x fp16", *extra, "KL", "top-1"]
    heads += ["same tokens (first diff: fp16 margin)", "save s", "load s"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "|".join(["---", "---", *["---:"] * (len(extra) + 4), "---", "---:", "---:"]) + "|")
    for r in rows:
        first = r["first_divergence"]
        diff = "" if first is None else f" ({first}: {r['fp16_margin_there']:.2f})"
        cells = [str(r["prompt"]), r["cache"], f"{r['bytes']:,}", f"{r['x_fp16']:.2f}"]
        cells += [cell(r) for cell in extra.values()]
        cells += [f"{r['kl']:.4f}", f"{r['top1']:.3f}", f"{r['same_tokens']}/{args.steps}{diff}"]
        cells += [f"{r['save_s']:.2f}", f"{r['load_s']:.2f}"]
        print("| " + " | ".join(cells) + " |")
    write_json(args.json, rows)


def main() -> None:
    ap = disk_args(__doc__.split("\n\n")[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[16, 20, 24, 32])
    ap.add_argument("--specs", nargs="*", default=["uniform:bits=4", "uniform:bits=2"])
    ap.add_argument("--basis", default=None, help="KVTC artifact (default: the model's)")
    args = ap.parse_args()
    rows, path = disk_rows(args, "kvtc-disk-", args.basis)

    print_table(
        args,
        path,
        rows,
        {
            "x with basis": lambda r: (
                f"{r['x_fp16_with_basis']:.2f}" if "x_fp16_with_basis" in r else "-"
            ),
            "K / V error": lambda r: (
                f"{r['key_rel_err']:.3f} / {r['value_rel_err']:.3f}" if "key_rel_err" in r else "-"
            ),
        },
    )


if __name__ == "__main__":
    main()
