"""Prefill-to-decode hand-off of a compressed cache between two processes (issue 54).

Run on two processes of the ring backend (this machine twice)::

    mlx.launch --backend ring -n 2 python benchmarks/handoff.py --tokens 8192

Rank 0 prefills the prompt (the reference model by default) into each cache spec and sends
the caches to rank 1 (``velox_core.send_cache``: the arrays as stored, plus a JSON header);
rank 1 rebuilds them (``recv_cache``) and decodes. For each spec it reports the bytes moved,
the send time, the prefill time (what re-running the prefill on the receiver costs instead)
and whether the receiver's tokens equal the sender's. ``fp16`` is mlx-lm's KVCache holding
float16 keys and values (what sending an uncompressed cache moves).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from velox_core import make_cache, recv_cache, routed, send_cache
from velox_core.mlx_lm import _model_type


def _caches(model, spec: str, store):
    if spec == "fp16":
        return [KVCache() for _ in model.layers]
    return make_cache(model, spec, storage_dtype=store)


def _prefill(model, caches, ids: mx.array, chunk: int) -> float:
    start = time.perf_counter()
    with routed(model):
        for c in range(0, ids.shape[0], chunk):
            model(ids[None, c : c + chunk], cache=caches)
            mx.eval([x.state for x in caches])
    return time.perf_counter() - start


def _to_fp16(caches) -> None:
    """An fp16 KVCache's contents (the model computes in float32 on a CPU)."""
    for c in caches:
        if type(c) is KVCache and c.keys is not None and c.keys.dtype != mx.float16:
            n = c.offset
            c.state = (
                c.keys[..., :n, :].astype(mx.float16),
                c.values[..., :n, :].astype(mx.float16),
                n,
            )


def _decode(model, caches, last: mx.array, n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    with routed(model):
        return [int(t) for t, _ in generate_step(last, model, prompt_cache=caches, max_tokens=n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="mlx-lm model (default: the reference model)")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens prefilled")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    ap.add_argument("--decode", type=int, default=16, help="tokens decoded after the hand-off")
    ap.add_argument(
        "--specs", nargs="+", default=["fp16", "uniform:bits=4", "streamingllm:budget=2048,bits=4"]
    )
    ap.add_argument("--json", default=None, help="also write the rows to this file (rank 0)")
    args = ap.parse_args()

    from velox_cli.bench import load_model

    g = mx.distributed.init(strict=True)
    if g.size() != 2:
        raise SystemExit("run on two processes: mlx.launch --backend ring -n 2 python ...")
    model, _, store, path = load_model(args.model)
    store = store or mx.float16
    vocab = model.args.vocab_size  # a seeded random prompt: the hand-off does not read text
    ids = np.random.default_rng(0).integers(0, vocab, args.tokens + 1).astype(np.int32)
    prompt, last = mx.array(ids[:-1]), mx.array(ids[-1:])
    rows = []
    for spec in args.specs:
        if g.rank() == 0:
            caches = _caches(model, spec, store)
            prefill_s = _prefill(model, caches, prompt, args.chunk)
            _to_fp16(caches)
            resident = sum(c.nbytes for c in caches)
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=g))  # both ready
            sent = send_cache(caches, 1, group=g)
            tokens = _decode(model, caches, last, args.decode)
            peer = mx.distributed.recv((args.decode,), mx.int32, 1, group=g)
            same = bool(mx.array_equal(peer, mx.array(tokens, dtype=mx.int32)).item())
            row = {
                "spec": spec,
                "tokens": args.tokens,
                "payload_bytes": sent.payload,
                "header_bytes": sent.header,
                "resident_bytes": resident,
                "send_s": round(sent.seconds, 4),
                "prefill_s": round(prefill_s, 3),
                "decode_identical": same,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        else:
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=g))
            start = time.perf_counter()
            caches = recv_cache(0, group=g, model=model)
            got_s = time.perf_counter() - start
            tokens = _decode(model, caches, last, args.decode)
            mx.eval(mx.distributed.send(mx.array(tokens, dtype=mx.int32), 0, group=g))
            print(json.dumps({"spec": spec, "recv_s": round(got_s, 4)}), flush=True)
    if g.rank() == 0:
        fp16 = next((r["payload_bytes"] for r in rows if r["spec"] == "fp16"), None)
        print(f"\n{args.tokens} tokens, {_model_type(model)} {path}")
        print("| spec | bytes sent | x fp16 | resident | send s | prefill s | decode same |")
        print("|---|---:|---:|---:|---:|---:|:-:|")
        for r in rows:
            total = r["payload_bytes"] + r["header_bytes"]
            ratio = f"{total / fp16:.3f}" if fp16 else "-"
            print(
                f"| {r['spec']} | {total:,} | {ratio} | {r['resident_bytes']:,} | "
                f"{r['send_s']:.3f} | {r['prefill_s']:.2f} | {r['decode_identical']} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
