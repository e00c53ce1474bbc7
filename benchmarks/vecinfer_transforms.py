"""VecInfer's dual transformation on a model's own keys: outliers, score and attention error.

Prefills ``--context`` held-out tokens through the model with fp16 velox caches, recording
each layer's post-RoPE keys, values and queries; then, per layer, codes the keys with
``velox_vecinfer.VecInfer`` fitted on the first ``--calibration`` tokens, with each of the
four transform settings (none, smooth, Hadamard, both), and prints the mean over layers of:
the kurtosis of the transformed keys (3 for a Gaussian; large for outliers), the relative
error of the scaled scores ``q . k_hat`` against ``q . k``, and the relative error of causal
attention outputs (fp16 values) against exact keys. CPU or GPU; the reference model by default.

    python benchmarks/vecinfer_transforms.py [--context 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import mlx.core as mx
import numpy as np

from velox_cli.bench import load_model
from velox_cli.data import load_text, token_stream
from velox_core import VeloxCache, make_cache, routed
from velox_vecinfer import VecInfer

SETTINGS = {
    "none": {"smooth": False, "hadamard": False},
    "smooth": {"hadamard": False},
    "hadamard": {"smooth": False},
    "both": {},
}


class Recording(VeloxCache):
    """An fp16 velox cache that keeps the queries it attends with."""

    def attend(self, queries, scale, mask=None, sinks=None):
        self.queries = queries
        return super().attend(queries, scale, mask, sinks)


def kurtosis(x: mx.array) -> float:
    x = x.astype(mx.float32)
    x = x - mx.mean(x, axis=(2, 3), keepdims=True)
    return float(mx.mean(mx.mean(x**4, axis=(2, 3)) / mx.mean(x * x, axis=(2, 3)) ** 2))


def rel(a: mx.array, b: mx.array) -> float:
    return float(mx.sqrt(mx.sum((a - b) ** 2) / mx.sum(b * b)))


def layer_errors(cache: Recording, bits, vector: int, calibration: int) -> dict[str, tuple]:
    k, v = cache.keys_and_values()
    q = cache.queries.astype(mx.float32)
    b, hq, t, d = q.shape
    h = k.shape[1]
    r = hq // h
    qg = q.reshape(b, h, r * t, d) / math.sqrt(d)
    causal = mx.tril(mx.ones((t, t), dtype=mx.bool_))[None, None, None]

    def attend(s):
        s = mx.where(causal, s.reshape(b, h, r, t, t), -mx.inf)
        return mx.softmax(s, axis=-1) @ v.astype(mx.float32)[:, :, None]

    exact = qg @ mx.swapaxes(k.astype(mx.float32), -1, -2)
    ref = attend(exact)
    out = {}
    for name, kw in SETTINGS.items():
        codec = VecInfer(bits=bits, vector=vector, **kw)
        codec.fit(k[:, :, :calibration])
        s = codec.scores(qg, codec.encode(k))
        out[name] = (kurtosis(codec.transform(k)), rel(s, exact), rel(attend(s), ref))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="mlx-lm model (default: the reference model)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--calibration", type=int, default=256)
    ap.add_argument("--widths", nargs="+", default=["2:4", "4:2"], help="bits:vector pairs")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model, tok, store, path = load_model(a.model)
    tokens = token_stream(tok, load_text(None))[: a.context]
    caches = make_cache(model, lambda i: Recording(), storage_dtype=store)
    with routed(model):
        mx.eval(model(mx.array(tokens.astype(np.int32))[None], cache=caches))
    rows = []
    print(f"{path} | {a.context} tokens | calibration {a.calibration} | mean over layers")
    head = ("bits", "vector", "transform", "kurtosis", "score err", "attn err")
    print("{:>5} {:>6} {:>9} {:>9} {:>10} {:>9}".format(*head))
    for width in a.widths:
        bits, vector = (float(x) for x in width.split(":"))
        bits = int(bits) if bits.is_integer() else bits
        per = [layer_errors(c, bits, int(vector), a.calibration) for c in caches]
        for name in SETTINGS:
            k, s, o = (float(np.mean([p[name][i] for p in per])) for i in range(3))
            rows.append(
                {
                    "bits": bits,
                    "vector": int(vector),
                    "transform": name,
                    "kurtosis": k,
                    "score_error": s,
                    "attention_error": o,
                }
            )
            print(f"{bits:>5} {int(vector):>6} {name:>9} {k:9.2f} {s:10.4f} {o:9.4f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"model": path, "context": a.context, "calibration": a.calibration, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
