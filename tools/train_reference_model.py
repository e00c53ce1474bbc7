"""Train the reference model: a small Llama (RoPE, GQA, head_dim 128) on CPython's stdlib.

    python tools/reference_corpus.py build            # here: file list, tokenizer, tokens
    python tools/train_reference_model.py --tokens out/corpus --out shared/reference-model

Runs wherever MLX runs; on an NVIDIA GPU (MLX's CUDA backend) the default budget trains in
about 8 minutes, on a CPU it is slow. Training has two phases: most steps at 2,048 tokens,
then the rest at 8,192 tokens (the trained context). 70% of the training windows carry
synthetic long-range recall pairs drawn like the evaluation's (``velox_cli.evaluate``): a line
``NAME = 12345`` early in the window and ``assert NAME == 12345`` later, so the model learns to
retrieve a value defined thousands of tokens before. With ``--budget`` the step counts are
fixed from the measured speed of the first steps and recorded in ``train.json``; pass
``--steps1/--steps2`` to repeat a run exactly.

The result is an mlx-lm model directory: ``config.json``, ``model.safetensors`` (float16),
the tokenizer files, ``train.json`` (the run), loadable with ``mlx_lm.load``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "vocab_size": 8192,
    "rope_theta": 100000.0,
    "rope_traditional": False,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "float16",
}
# The reference model's sibling, for cross-model KV transfer (velox-transfer): the same
# family, tokenizer, data and RoPE, another depth, width and KV-head count.
SIBLING = {
    **CONFIG,
    "hidden_size": 192,
    "num_hidden_layers": 4,
    "intermediate_size": 576,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
}
SIZES = {"reference": CONFIG, "sibling": SIBLING}


class Recall:
    """Synthetic long-range recall pairs, shared by training and evaluation."""

    def __init__(self, tokenizer, words: list[str], seed: int):
        self.tok, self.words, self.rng = tokenizer, words, np.random.default_rng(seed)

    def pair(self) -> tuple[list[int], list[int], list[int]]:
        """(definition tokens, query tokens, answer tokens) for a fresh name and value."""
        a, b = self.rng.choice(len(self.words), size=2, replace=False)
        name = f"{self.words[a]}_{self.words[b]}".upper()
        value = str(int(self.rng.integers(10000, 100000)))
        enc = self.tok.encode
        return (
            enc(f"\n{name} = {value}\n").ids,
            enc(f"\nassert {name} ==").ids,
            enc(f" {value}\n").ids,
        )


def words_from(tokens: np.ndarray, tokenizer, n: int = 2000) -> list[str]:
    """Lowercase alphabetic vocabulary entries of 4-8 letters: the recall names' words."""
    vocab = tokenizer.get_vocab()
    out = sorted(
        w[1:]
        for w in vocab
        if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower() and 4 <= len(w) - 1 <= 8
    )
    return out[:n]


def batches(
    train: np.ndarray,
    recall: Recall,
    seq: int,
    batch: int,
    rng: np.random.Generator,
    p: float = 0.7,
):
    """Endless (inputs, targets) batches of random windows, most with recall pairs inserted."""
    while True:
        rows = []
        for _ in range(batch):
            pieces = []
            if rng.random() < p:
                for _ in range(int(rng.integers(1, 4))):
                    d, q, a = recall.pair()
                    pieces.append((d, q + a))
            extra = sum(len(d) + len(qa) for d, qa in pieces)
            start = int(rng.integers(0, len(train) - seq - 1))
            window = list(train[start : start + seq + 1 - extra])
            for d, qa in pieces:
                i = int(rng.integers(0, max(1, len(window) // 2)))
                window[i:i] = d
                j = int(rng.integers(i + len(d), len(window) + 1))
                window[j:j] = qa
            rows.append(window[: seq + 1])
        x = mx.array(np.asarray(rows, dtype=np.int32))
        yield x[:, :-1], x[:, 1:]


def build_model(config: dict):
    from mlx_lm.models import llama

    return llama.Model(llama.ModelArgs.from_dict(config))


def loss_fn(model, x, y):
    logits = model(x)
    return nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean")


def evaluate(model, data: np.ndarray, seq: int, n: int) -> float:
    total, count = 0.0, 0
    for i in range(n):
        s = i * seq
        if s + seq + 1 > len(data):
            break
        x = mx.array(data[s : s + seq + 1].astype(np.int32))[None]
        loss = loss_fn(model, x[:, :-1], x[:, 1:])
        total += float(loss.item()) * seq
        count += seq
    return math.exp(total / max(count, 1))


def train(args) -> None:
    from tokenizers import Tokenizer

    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    tokens = np.load(args.tokens / "train.npy")
    heldout = np.load(args.tokens / "heldout.npy")
    tok_dir = args.tokenizer or args.out
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    if tok_dir != args.out:  # the sibling shares the reference model's tokenizer files
        args.out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tok_dir / name, args.out / name)
    recall = Recall(tok, words_from(tokens, tok), args.seed)
    model = build_model(SIZES[args.size])
    model.set_dtype(mx.float32)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {n_params / 1e6:.2f}M parameters, device {mx.default_device()}", flush=True)

    def step_fn(model, opt):
        state = [model.state, opt.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(x, y):
            loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            opt.update(model, grads)
            return loss

        return step

    phases = [(args.seq1, args.batch1, args.steps1), (args.seq2, args.batch2, args.steps2)]
    # fix step counts from the measured speed when a time budget is given
    if args.budget:
        probe_opt = optim.AdamW(learning_rate=1e-4, weight_decay=0.0)
        shares = (0.5, 0.5)
        for k, (seq, batch, _) in enumerate(phases):
            step = step_fn(model, probe_opt)
            it = batches(tokens, recall, seq, batch, rng)
            times = []
            for _ in range(10):  # the first steps compile the graph and JIT the GPU kernels
                x, y = next(it)
                t = time.perf_counter()
                mx.eval(step(x, y))
                times.append(time.perf_counter() - t)
            per = float(np.median(times[-5:]))
            phases[k] = (seq, batch, max(10, int(shares[k] * args.budget / per)))
            print(
                f"phase {k}: {per:.3f} s/step at {seq}x{batch} -> {phases[k][2]} steps", flush=True
            )
        mx.random.seed(args.seed)  # start over from the seeded initialization
        model = build_model(SIZES[args.size])
        model.set_dtype(mx.float32)
    total = sum(s for _, _, s in phases)
    warm = max(1, min(200, total // 10))
    sched = optim.join_schedules(
        [
            optim.linear_schedule(1e-5, args.lr, warm),
            optim.cosine_decay(args.lr, total - warm, args.lr / 20),
        ],
        [warm],
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.1, betas=[0.9, 0.95])
    step = step_fn(model, opt)
    log, done, t0 = [], 0, time.perf_counter()
    for seq, batch, steps in phases:
        it = batches(tokens, recall, seq, batch, rng)
        for i in range(steps):
            x, y = next(it)
            loss = step(x, y)
            mx.eval(loss, model.parameters(), opt.state)
            done += 1
            if done % 50 == 0 or i == steps - 1:
                el = time.perf_counter() - t0
                row = {
                    "step": done,
                    "seq": seq,
                    "loss": round(float(loss.item()), 4),
                    "elapsed_s": round(el, 1),
                }
                log.append(row)
                print(json.dumps(row), flush=True)
    ppl = {s: evaluate(model, heldout, s, 8) for s in (2048, 8192)}
    print(f"held-out perplexity: {ppl}", flush=True)
    save(
        model,
        args.out,
        {
            "phases": [{"seq": s, "batch": b, "steps": n} for s, b, n in phases],
            "lr": args.lr,
            "seed": args.seed,
            "parameters": n_params,
            "train_tokens": len(tokens),
            "seconds": round(time.perf_counter() - t0, 1),
            "heldout_perplexity": {str(k): round(v, 3) for k, v in ppl.items()},
            "log": log,
            "device": str(mx.default_device()),
            "size": args.size,
        },
        SIZES[args.size],
    )


def save(model, out: Path, run: dict, config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.set_dtype(mx.float16)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "train.json").write_text(json.dumps(run, indent=1) + "\n")
    print(f"saved {out}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=Path, default=Path("out/corpus"))
    ap.add_argument("--out", type=Path, default=Path("shared/reference-model"))
    ap.add_argument(
        "--budget", type=float, default=0.0, help="seconds of training (sets the steps)"
    )
    ap.add_argument("--size", choices=sorted(SIZES), default="reference")
    ap.add_argument(
        "--tokenizer", type=Path, default=None, help="directory of tokenizer.json (default: --out)"
    )
    ap.add_argument("--steps1", type=int, default=3000)
    ap.add_argument("--steps2", type=int, default=600)
    ap.add_argument("--seq1", type=int, default=2048)
    ap.add_argument("--batch1", type=int, default=32)
    ap.add_argument("--seq2", type=int, default=8192)
    ap.add_argument("--batch2", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    train(ap.parse_args(argv))


if __name__ == "__main__":
    main()
