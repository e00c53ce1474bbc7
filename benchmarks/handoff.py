"""Prefill-to-decode hand-off of a compressed cache between processes (issue 54).

Run on two or more processes of the ring backend (this machine several times)::

    mlx.launch --backend ring -n 2 python benchmarks/handoff.py --tokens 8192

Rank 0 prefills the prompt (the reference model by default) into each cache spec and sends
the caches to rank 1 (``velox_core.send_cache``: the arrays as stored, plus a JSON header),
which passes them on to rank 2, and so on (MLX's ring backend sends only between neighbours):
the disaggregated layout of one prefill process and decode processes 1..N-1. Each receiver
rebuilds them (``recv_cache``) and decodes. For each spec it reports the bytes moved per
receiver, the send time (rank 0's), the prefill time
(what re-running the prefill on a receiver costs instead) and whether every receiver's tokens
equal the sender's. ``fp16`` is mlx-lm's KVCache holding float16 keys and values (what sending
an uncompressed cache moves).
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
    if g.size() < 2:
        raise SystemExit("run on two or more processes: mlx.launch --backend ring -n 2 python ...")
    model, _, store, path = load_model(args.model)
    store = store or mx.float16
    vocab = model.args.vocab_size  # a seeded random prompt: the hand-off does not read text
    ids = np.random.default_rng(0).integers(0, vocab, args.tokens + 1).astype(np.int32)
    prompt, last = mx.array(ids[:-1]), mx.array(ids[-1:])
    rows = []
    rank, size = g.rank(), g.size()
    for spec in args.specs:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=g))  # every rank ready
        if rank == 0:
            caches = _caches(model, spec, store)
            prefill_s = _prefill(model, caches, prompt, args.chunk)
            _to_fp16(caches)
            resident = sum(c.nbytes for c in caches)
            sent = send_cache(caches, 1, group=g)
        else:
            start = time.perf_counter()
            caches = recv_cache(rank - 1, group=g, model=model)
            got_s = time.perf_counter() - start
            if rank + 1 < size:  # passed on along the ring
                send_cache(caches, rank + 1, group=g)
            print(json.dumps({"spec": spec, "rank": rank, "recv_s": round(got_s, 4)}), flush=True)
        tokens = mx.array(_decode(model, caches, last, args.decode), dtype=mx.int32)
        every = mx.distributed.all_gather(tokens[None], group=g)  # (ranks, decode)
        mx.eval(every)  # on every rank: a collective left lazy on one rank hangs the others
        if rank == 0:
            row = {
                "spec": spec,
                "tokens": args.tokens,
                "receivers": size - 1,
                "payload_bytes": sent.payload,  # per receiver: every one gets the same
                "header_bytes": sent.header,
                "resident_bytes": resident,
                "send_s": round(sent.seconds, 4),
                "prefill_s": round(prefill_s, 3),
                "decode_identical": bool(mx.all(every == tokens[None]).item()),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if g.rank() == 0:
        fp16 = next((r["payload_bytes"] for r in rows if r["spec"] == "fp16"), None)
        print(f"\n{args.tokens} tokens, {_model_type(model)} {path}, {g.size() - 1} receiver(s)")
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
