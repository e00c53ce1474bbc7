"""The spectral quantizer's error by position: key bases fitted at the calibration's positions
against bases fitted for positions the keys are moved to.

A post-RoPE key's law depends on its position (the channel pairs RoPE turns slowly hardly move
over one calibration sequence), so ``velox fit spectral`` turns each calibration key to a
position drawn from ``[0, --positions)``. This script fits the reference model's artifact
twice on the same calibration as ``tools/fit_reference.py spectral`` (``--positions 0``: the
keys where the calibration made them, and the default 16,384), prefills the first ``--context``
tokens of the held-out text into the default spectral caches of each artifact and into fp16
caches, and prints, per layer and span of positions, the relative error of the coded keys and
values (``||x_hat - x|| / ||x||`` over the span's tokens and both KV heads).

    python benchmarks/spectral_positions.py [--context 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from reference_calibration import SEQ_LEN, calibration_ids, load_reference  # noqa: E402

import velox_core  # noqa: E402
from velox_core.artifacts import token_stream  # noqa: E402
from velox_spectral import SpectralCache, fit_spectral, save_bases  # noqa: E402


def errors(model, ids: mx.array, artifact: str, spans) -> list[list[tuple[float, float]]]:
    """Per layer, per span: the coded keys' and values' relative errors."""
    ref = [KVCache() for _ in model.layers]
    caches = velox_core.make_cache(model, SpectralCache(artifact=artifact))
    t = ids.shape[1]
    for a in range(0, t, 512):
        model(ids[:, a : a + 512], cache=ref)
    with velox_core.routed(model):
        for a in range(0, t, 512):
            model(ids[:, a : a + 512], cache=caches)
    out = []
    for c, r in zip(caches, ref):
        got = [x.astype(mx.float32) for x in c.keys_and_values()]
        want = [x[..., :t, :].astype(mx.float32) for x in (r.keys, r.values)]
        row = []
        for lo, hi in spans:
            row.append(
                tuple(
                    float(
                        mx.linalg.norm(g[:, :, lo:hi] - w[:, :, lo:hi])
                        / mx.linalg.norm(w[:, :, lo:hi])
                    )
                    for g, w in zip(got, want)
                )
            )
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096, help="held-out tokens coded")
    p.add_argument("--json", help="write the errors as JSON")
    args = p.parse_args()
    model, tokenizer = load_reference()
    ids, _ = calibration_ids(tokenizer, 16384, 1024, 0)
    with gzip.open(ROOT / "shared" / "data" / "heldout.jsonl.gz", "rt") as f:
        docs = [json.loads(line)["text"] for line in f]
    held = mx.array(token_stream(tokenizer, docs)[: args.context])[None]
    edges = [16, *range(1024, args.context, 1024), args.context]
    spans = list(itertools.pairwise(edges))
    result = {"context": args.context, "spans": spans, "fits": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for positions in (0, 16384):
            art = fit_spectral(model, ids, seq_len=SEQ_LEN, positions=positions)
            path = str(save_bases(art, Path(tmp) / f"p{positions}.safetensors"))
            result["fits"][positions] = errors(model, held, path, spans)
    head = " | ".join(f"{lo}-{hi}" for lo, hi in spans)
    print(f"relative error of keys / values by position (default caches): | {head}")
    for positions, layers in result["fits"].items():
        for i, row in enumerate(layers):
            cells = " | ".join(f"{k:.3f} / {v:.3f}" for k, v in row)
            print(f"positions={positions} layer {i} | {cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
