"""GPU benchmark of velox's kernels: decode-attention speed, encode cost, end to end.

Run from the repository root on the GPU machine::

    python3 benchmarks/gpu_attention.py            # the full run
    python3 benchmarks/gpu_attention.py --quick    # tiny shapes: a smoke test, any device

The kernels' correctness against the reference MLX path is checked by
``tests/test_gpu_attention.py`` (``python3 -m pytest -q -m gpu tests/test_gpu_attention.py``).

Sections (each guarded: a failure is printed with its traceback and the run goes on):

  b. decode attention, 32 query heads / 8 KV heads / head dim 128 / fp16, contexts 4k-128k,
     batch 1 and 8: fp16 ``mx.fast.scaled_dot_product_attention``, mlx-lm's quantized SDPA
     (``mx.quantize``, group 64) at 2/4/8 bits, velox Uniform 2/4/8 bits and TurboQuant 3/4
     bits through their fused kernels; ms per step (median of repeats, every output
     evaluated), GB/s on the bytes read (codes + scales + query), ratios; a device copy for the
     achievable bandwidth; a small sweep of the kernel's launch settings; encode cost.
  b3. device time per call (``device``): each method's calls launched one after another
     (``MLX_USE_CUDA_GRAPHS=0``, in a child process), every kernel's duration read from a
     CUPTI timeline (``torch.profiler``, where torch is installed): the GPU time one call
     occupies as a model's layers run it, in series, with MLX's dispatch taken out; the
     ratio against fp16 SDPA's device time in the same child (bf16 rows: the same K/V and
     query in bf16, a bf16 model's cache, also against bf16 SDPA's).
  c. end to end: decode tokens/s of the reference model (shared/reference-model) at a 32k
     context, fp16 KVCache vs mlx-lm QuantizedKVCache 4-bit vs velox UniformCache 4-bit and
     TurboQuantCache 4-bit:
     step by step (building each step's graph, then evaluating it; the building time is
     reported) and as mlx-lm's ``generate_step`` runs (the next step built while the device
     evaluates this one).
  d. JSON to $OUT/gpu_attention.json (./out/ without $OUT) and a compact table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import mlx.core as mx

T_START = time.perf_counter()
BUDGET_S = 420.0  # sections stop starting new shapes past this (compiles and slack)

OPTIONS: dict = {}  # --contexts / --batches

RESULTS: dict = {
    "bandwidth": {},
    "attention": [],
    "tuning": [],
    "encode": [],
    "e2e": [],
    "device_time": [],
    "skipped": [],
    "errors": [],
}


def elapsed() -> float:
    return time.perf_counter() - T_START


def over_budget(section: str) -> bool:
    budget = OPTIONS.get("budget", BUDGET_S)
    if elapsed() > budget:
        RESULTS["skipped"].append(f"{section} (time budget)")
        print(f"  [skip] {section}: {elapsed():.0f}s elapsed, over the {budget:.0f}s budget")
        return True
    return False


def guarded(name: str):
    """Run a section; print any exception with its traceback and carry on."""

    def deco(fn):
        def run(*a, **k):
            try:
                return fn(*a, **k)
            except Exception as exc:
                tb = traceback.format_exc()
                print(f"  [error] {name}: {type(exc).__name__}: {exc}\n{tb}")
                RESULTS["errors"].append({"section": name, "error": repr(exc), "traceback": tb})
                return None

        return run

    return deco


@contextlib.contextmanager
def kernels(enabled: bool):
    """The kernels on or off for the block (``KernelConfig.enabled``)."""
    from velox_core.kernels.config import configured

    with configured(enabled=enabled):
        yield


@contextlib.contextmanager
def env(**values):
    """The kernel settings ``values`` (their ``VELOX_*`` names, velox_core.kernels.config's
    ENVIRONMENT) in force for the block: the configuration read from the environment with
    them, restored after."""
    from velox_core.kernels.config import KernelConfig, configured

    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        cfg = KernelConfig.from_environ()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with configured(cfg):
        yield


def in_env(call, **values):
    """``call`` with the environment settings ``values`` in force while it builds its graph
    (a method row timed with a kernel setting changed, e.g. ``VELOX_DECODE_MMA=0``)."""

    def wrapped():
        with env(**values):
            return call()

    return wrapped


def timeit(fn, warmup: int, reps: int, inner: int) -> float:
    """Median seconds per call: ``inner`` calls per repeat, all outputs evaluated together."""
    return timeit_split(fn, warmup, reps, inner)[0]


def timeit_split(fn, warmup: int, reps: int, inner: int) -> tuple[float, float]:
    """Median seconds per call, whole (building the calls' graphs in Python, then evaluating
    them) and of the evaluation alone (dispatch and device). A model's decode loop builds the
    next step's graph while the device runs the current one (mlx-lm's generate uses
    ``async_eval``), so the evaluation alone is what a step costs when the device is the
    bottleneck; the whole time is what it costs when the host is."""
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    whole, evals = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(inner)]
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t2 = time.perf_counter()
        whole.append((t2 - t0) / inner)
        evals.append((t2 - t1) / inner)
    return statistics.median(whole), statistics.median(evals)


def nbytes(*arrays) -> int:
    return sum(a.nbytes for a in arrays)


# =============================================================================================
# b. decode attention speed
# =============================================================================================


@guarded("bandwidth")
def section_bandwidth(quick: bool) -> None:
    print("\n== b0. device bandwidth ==")
    n = (1 << 22) if quick else (1 << 29)  # 2 GiB of float32 on the GPU
    x = mx.random.uniform(shape=(n,))
    mx.eval(x)
    copy = timeit(lambda: x * 1.0, 2, 5, 1 if not quick else 2)
    read = timeit(lambda: mx.sum(x), 2, 5, 1 if not quick else 2)
    gb = x.nbytes / 1e9
    RESULTS["bandwidth"] = {
        "copy_GBps": 2 * gb / copy,  # read + write
        "read_GBps": gb / read,
        "bytes": x.nbytes,
    }
    print(f"  copy {2 * gb / copy:8.0f} GB/s (read+write)   read (sum) {gb / read:8.0f} GB/s")
    mx.clear_cache()


# velox-qjl's recommended "4-bit" keys (METHOD.recommended[0], without its value settings)
QJL_4BIT = {"sketch": 320, "outlier_bits": 8, "group": 128}


def encode_rows(codec, x):
    """``codec.encode(x)`` one batch row at a time (a fractional TurboQuant encode of a whole
    (8, 8, 131072, 128) tensor failed to launch on the H200: MLX's ops on it exceed a launch
    limit; a cache encodes prefill chunks, far smaller), joined along the batch axis."""
    from velox_core import Packed

    parts = [codec.encode(x[i : i + 1]) for i in range(x.shape[0])]
    for p in parts:
        mx.eval(p.data)
    if len(parts) == 1:
        return parts[0]
    data = {n: mx.concatenate([p.data[n] for p in parts], axis=0) for n in parts[0].data}
    mx.eval(data)
    return Packed(data, parts[0].tokens, parts[0].block, parts[0].per_block)


def make_methods(
    b: int,
    t: int,
    seed: int,
    bits_mlx,
    bits_uniform,
    bits_tq,
    portable_row=False,
    qjl: bool = False,
    vecinfer: bool = False,
    bf16: bool = False,
):
    """Per-method (name, bits, call, bytes_read) closures over one shape's K/V (``qjl``: QJL
    keys with 2-bit values, the paper's sketch and velox-qjl's recommended "4-bit" one;
    ``vecinfer``: VecInfer's 2-bit keys and values, 256 codewords of 4 channels, fitted on
    the first 512 tokens as a cache's calibration would; ``bf16``: the same K/V and query in
    bfloat16, a bfloat16 model's: bfloat16 SDPA and velox 2- and 4-bit codes with bfloat16
    scales, and the 4-bit ones through the portable kernel)."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from velox_core import Uniform
    from velox_core.cache.attention import Segment, joint_attention, partial
    from velox_turboquant import TurboQuant

    hq, hk, d = 32, 8, 128
    scale = 1 / math.sqrt(d)
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    k = mx.random.normal((b, hk, t, d), key=k1).astype(mx.float16)
    v = mx.random.normal((b, hk, t, d), key=k2).astype(mx.float16)
    q = mx.random.normal((b, hq, 1, d), key=k3).astype(mx.float16)
    mx.eval(k, v, q)
    methods = []
    qbytes = q.nbytes

    def joint_call(kc, kp, vc, vp, q=q):
        """What a cache's ``attend()`` runs on its coded segment: the codec's kernels (query
        rotation or sketch where the codec has one, the decode kernel, the merge that
        normalizes), the queries unscaled, the output in the query's dtype."""

        def call():
            qg = q.reshape(b, hk, hq // hk, d)
            out = joint_attention(qg, [Segment(kc, kp, vc, vp)], q.dtype, scale)
            if out is None:
                raise RuntimeError("kernel declined")
            return out.reshape(b, hq, 1, d)

        return call

    def reference_call(kc, kp, vc, vp):
        """What the codec computes without its kernels (``partial`` on the coded segment,
        the kernels off, the query scaled in float32): the path the kernels replace."""
        seg = Segment(kc, kp, vc, vp)
        qf = q.reshape(b, hk, hq // hk, d).astype(mx.float32) * scale

        def call():
            with kernels(False):
                o, _, l = partial(qf, seg)
                return (o / l).reshape(b, hq, 1, d)

        return call

    methods.append(
        (
            "fp16 sdpa",
            16,
            lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
            nbytes(k, v) + qbytes,
        )
    )
    for bits in bits_mlx:
        qk = mx.quantize(k, group_size=64, bits=bits)
        qv = mx.quantize(v, group_size=64, bits=bits)
        mx.eval(qk, qv)
        qm = mx.array(q)

        def call(qk=qk, qv=qv, bits=bits, qm=qm):
            return quantized_scaled_dot_product_attention(
                qm, qk, qv, scale=scale, mask=None, group_size=64, bits=bits
            )

        methods.append((f"mlx-lm q{bits}", bits, call, nbytes(*qk, *qv) + qbytes))
    if bf16:
        kb, vb, qb = (x.astype(mx.bfloat16) for x in (k, v, q))
        mx.eval(kb, vb, qb)
        methods.append(
            (
                "bf16 sdpa",
                16,
                lambda: mx.fast.scaled_dot_product_attention(qb, kb, vb, scale=scale),
                nbytes(kb, vb) + qbytes,
            )
        )
        for bits in (2, 4):
            codec = Uniform(bits)
            kp, vp = codec.encode(kb), codec.encode(vb)
            mx.eval(kp.data, vp.data)
            call = joint_call(codec, kp, codec, vp, qb)
            nb = kp.nbytes + vp.nbytes + qbytes
            methods.append((f"velox uniform{bits} bf16", bits, call, nb))
            if bits == 4:
                portable = in_env(call, VELOX_DECODE_MMA=0)
                methods.append((f"velox uniform{bits} bf16 portable", bits, portable, nb))

    for bits in bits_uniform:
        codec = Uniform(bits)
        kp, vp = codec.encode(k), codec.encode(v)
        mx.eval(kp.data, vp.data)

        call = joint_call(codec, kp, codec, vp)
        methods.append((f"velox uniform{bits}", bits, call, kp.nbytes + vp.nbytes + qbytes))
        if bits == 4 and portable_row:
            nb = kp.nbytes + vp.nbytes + qbytes
            portable = in_env(call, VELOX_DECODE_MMA=0)
            methods.append((f"velox uniform{bits} portable", bits, portable, nb))
            # a whole cache (4 fp16 sinks, a 128-token fp16 window, the coded body) attended
            # the way a model's layer does it
            from velox_core import UniformCache

            cache = UniformCache(bits=bits, window=128, sinks=4)
            cache.update_and_fetch(k, v)
            mx.eval(cache.state)
            methods.append(
                (
                    f"velox uniform{bits} cache",
                    bits,
                    lambda cache=cache: cache.attend(q, scale),
                    cache.nbytes + qbytes,
                )
            )
    for bits in bits_tq:
        kc, vc = TurboQuant(bits), TurboQuant(bits, seed=1)
        kc.check(d, mx.float16)
        vc.check(d, mx.float16)
        kp, vp = encode_rows(kc, k), encode_rows(vc, v)

        call = joint_call(kc, kp, vc, vp)
        methods.append((f"velox turboquant{bits}", bits, call, kp.nbytes + vp.nbytes + qbytes))
        if isinstance(bits, float) and b == 1:
            # fractional widths before the outlier kernel: the codec's reference path (the
            # query rotated per group and part, the scores and the values' mix as MLX ops)
            from velox_core.cache.attention import Segment, partial

            seg = Segment(kc, kp, vc, vp)
            qf = q.reshape(b, hk, hq // hk, d).astype(mx.float32) * scale

            def tq_reference(seg=seg, qf=qf):
                o, _, l = partial(qf, seg)
                return (o / l).reshape(b, hq, 1, d)

            nb = kp.nbytes + vp.nbytes + qbytes
            methods.append((f"velox turboquant{bits} reference", bits, tq_reference, nb))
        if portable_row and bits in (2, 4):  # what 2- and 4-bit codes took before KCB / VCB
            nb = kp.nbytes + vp.nbytes + qbytes
            portable = in_env(call, VELOX_DECODE_MMA=0)
            methods.append((f"velox turboquant{bits} portable", bits, portable, nb))
            # the lookups of any levels, which the symmetric levels' replaced (KCB / VCB 1)
            general = in_env(call, VELOX_DECODE_SYMMETRIC=0)
            methods.append((f"velox turboquant{bits} general levels", bits, general, nb))
    if qjl:
        from velox_core import Uniform
        from velox_core.cache.attention import kernel_sides
        from velox_qjl import QJL

        for label, kw in (("qjl m256", {}), ("qjl m320", QJL_4BIT)):
            kc, vc = QJL(**kw), Uniform(2, 32)
            kc.check(d, mx.float16)
            tq = t // 128 * 128
            kp, vp = kc.encode(k[:, :, :tq]), vc.encode(v[:, :, :tq])  # (QJL: in chunks)
            mx.eval(kp.data, vp.data)

            kernel_sides(
                kc, kp, vc, vp, (b, hk, hq // hk, d)
            )  # makes the copy of S (counted in nb)
            nb = kp.nbytes + vp.nbytes + qbytes + kc.state_nbytes
            methods.append((f"velox {label}", 2, joint_call(kc, kp, vc, vp), nb))
            # the portable kernel, which the tensor-core one replaced
            portable = in_env(joint_call(kc, kp, vc, vp), VELOX_DECODE_MMA="0")
            methods.append((f"velox {label} portable", 2, portable, nb))
            if b == 1 and label == "qjl m256":
                # scores from the unpacked sign bits, then the values' mix
                reference = reference_call(kc, kp, vc, vp)
                methods.append((f"velox {label} reference", 2, reference, nb))
    if vecinfer:
        from velox_vecinfer import VecInfer

        kc, vc = VecInfer(iters=8), VecInfer(smooth=False, hadamard=False, iters=8)
        kc.fit(k[:, :, :512])
        vc.fit(v[:, :, :512])
        kp, vp = kc.encode(k), vc.encode(v)
        mx.eval(kp.data, vp.data)
        nb = kp.nbytes + vp.nbytes + qbytes + kc.state_nbytes + vc.state_nbytes
        methods.append(("velox vecinfer2", 2, joint_call(kc, kp, vc, vp), nb))
        if b == 1:
            # the transformed query against the gathered codewords, then the values'
            # codewords mixed
            vq_reference = reference_call(kc, kp, vc, vp)
            methods.append(("velox vecinfer2 reference", 2, vq_reference, nb))
    return methods


@guarded("attention")
def section_attention(quick: bool) -> None:
    print("\n== b. decode attention: 32 q heads / 8 KV heads / d 128 / fp16 ==")
    contexts = (512, 2048) if quick else (4096, 16384, 65536, 131072)
    batches = (1, 2) if quick else (1, 8)
    if OPTIONS.get("contexts"):
        contexts = OPTIONS["contexts"]
    if OPTIONS.get("batches"):
        batches = OPTIONS["batches"]
    copy_bw = RESULTS["bandwidth"].get("copy_GBps")
    shapes = OPTIONS.get("shapes") or [(b, t) for b in batches for t in contexts]
    for b, t in shapes:
        if over_budget(f"attention B{b} T{t}"):
            return
        rows = attention_shape(b, t, quick)
        ref = {r["method"]: r for r in rows if "ms" in r}
        fp16 = ref.get("fp16 sdpa")
        for r in rows:
            if "ms" not in r:
                continue
            if fp16:
                r["speedup_vs_fp16"] = fp16["ms"] / r["ms"]
                if "eval_ms" in fp16 and "eval_ms" in r:
                    r["eval_speedup_vs_fp16"] = fp16["eval_ms"] / r["eval_ms"]
            mlx = ref.get(f"mlx-lm q{r['bits']}")
            if mlx and r["method"].startswith("velox"):
                r["speedup_vs_mlx_lm"] = mlx["ms"] / r["ms"]
                if "eval_ms" in mlx and "eval_ms" in r:
                    r["eval_speedup_vs_mlx_lm"] = mlx["eval_ms"] / r["eval_ms"]
            if copy_bw:
                r["pct_copy_bw"] = 100.0 * r["GBps"] / copy_bw
        for r in rows:
            RESULTS["attention"].append(r)
            if "ms" in r:
                extra = ""
                if "speedup_vs_fp16" in r:
                    extra += f"  x{r['speedup_vs_fp16']:.2f} vs fp16"
                if "speedup_vs_mlx_lm" in r:
                    extra += f"  x{r['speedup_vs_mlx_lm']:.1f} vs mlx-lm"
                if "eval_ms" in r:
                    extra += f"  (evaluation alone {r['eval_ms']:.3f} ms"
                    if "eval_speedup_vs_fp16" in r:
                        extra += f", x{r['eval_speedup_vs_fp16']:.2f} vs fp16"
                    extra += ")"
                print(
                    f"  B{b} T{t:6d} {r['method']:20s} {r['ms']:8.3f} ms "
                    f"{r['GBps']:7.0f} GB/s{extra}"
                )
            else:
                print(f"  B{b} T{t:6d} {r['method']:20s} error: {r.get('error')}")
        mx.clear_cache()
        write_json()  # each shape's rows survive a run stopped from outside


def time_methods(methods, b: int, t: int, quick: bool) -> list[dict]:
    reps, inner = (3, 2) if quick else ((9, 10) if t <= 16384 else (7, 5))
    rows = []
    for name, bits, call, nb in methods:
        row = {"context": t, "batch": b, "method": name, "bits": bits, "bytes_read": nb}
        try:
            s, se = timeit_split(call, 3, reps, inner)
            row.update(ms=s * 1e3, GBps=nb / s / 1e9, eval_ms=se * 1e3, eval_GBps=nb / se / 1e9)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def mlx_lm_rows(b: int, t: int, quick: bool) -> list[dict]:
    """mlx-lm's quantized SDPA rows, timed in a child process on the same GPU: a fault inside
    MLX's quantized kernels (seen once at 128k tokens with MLX 0.32.4: an illegal memory
    access, which poisons the CUDA context) then costs only these rows."""
    import subprocess

    cmd = [sys.executable, __file__, "--mlx-lm", f"{b},{t}"] + (["--quick"] if quick else [])
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
        last = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
        if res.returncode == 0 and last.startswith("["):
            return [r for r in json.loads(last) if r["method"].startswith("mlx-lm")]
        err = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        msg = f"child exited {res.returncode}: {err[0][:300]}"
    except subprocess.TimeoutExpired:
        msg = "child timed out"
    return [
        {"context": t, "batch": b, "method": f"mlx-lm q{bits}", "bits": bits, "error": msg}
        for bits in (2, 4, 8)
    ]


def attention_shape(b: int, t: int, quick: bool) -> list[dict]:
    methods = make_methods(
        b, t, seed=t + b, bits_mlx=(), bits_uniform=(2, 4, 8), bits_tq=(3, 4), portable_row=True
    )
    rows = time_methods(methods, b, t, quick)
    del methods
    mx.clear_cache()
    return rows[:1] + mlx_lm_rows(b, t, quick) + rows[1:]


@guarded("tuning")
def section_tuning(quick: bool) -> None:
    """The kernel's launch settings at the longest context (to pick defaults on this GPU)."""
    print("\n== b2. decode kernel launch settings (longest context) ==")
    t = 2048 if quick else 131072
    # the tensor-core kernel's settings: (warps, 16-token tiles per step, blocks (None: splits
    # sized to whole waves of the SMs), ring stages, threadgroups per SM of the register cap,
    # fp16 weights' residual, software pipeline, value scales folded into the weights, splits
    # merged in the same launch, key scales folded out of the score MMA; 0 / None: its
    # default). Earlier sweeps (blocks 256-8192, caps
    # 0/3/4, stages 2): docs/data/*mma2*.json; 512 blocks against wave-sized splits: *mma3*.json;
    # one tile a step, the register cap lifted, no pipeline: *mma5-tuning.json
    variants = [
        (4, 4, None, 0, None, 0, 1, 1, 1, 1),  # steps of up to four tiles, the kernel's merge
        (4, 2, None, 0, None, 0, 1, 1, 1, 1),  # at most two tiles a step
        (4, 4, None, 0, None, 0, 1, 1, 0, 1),  # merged by a second launch (default past 16k)
        (4, 4, None, 0, 4, 0, 1, 1, 1, 1),  # 16 warps per SM (128 registers)
        (4, 4, None, 0, None, 0, 1, 0, 1, 1),  # value scales not folded into the weights
        (4, 4, None, 0, None, 0, 1, 1, 1, 0),  # key scales not folded out of the scores
        (4, 4, None, 0, None, 0, 1, 0, 1, 0),  # neither (the fifth session's kernel)
        (2, 4, None, 0, 6, 0, 1, 1, 1, 1),  # 2 warps, 12 per SM: four-tile steps at 4 bits
    ]
    batches = (1,) if quick else (OPTIONS.get("batches") or (1, 8))
    if quick:
        variants = variants[:2]
    for b in batches:
        for bits in (4, 2):
            if over_budget("tuning"):
                return
            methods = make_methods(b, t, seed=99, bits_mlx=(), bits_uniform=(bits,), bits_tq=())
            name, _, call, nb = methods[1]
            timeit_split(call, 3, 3, 5)  # warm the GPU, so the first variant is not the slow one
            for warps, sub, blocks, stages, smb, pres, pipe, fold, fuse, kfold in variants:
                extra = {"VELOX_DECODE_STAGES": stages} if stages else {}
                if smb is not None:
                    extra["VELOX_DECODE_MMA_SM_BLOCKS"] = smb
                if blocks is not None:
                    extra["VELOX_DECODE_BLOCKS"] = blocks
                setting = {
                    "warps": warps,
                    "subtiles": sub,
                    "blocks": "waves" if blocks is None else blocks,
                    "stages": stages or "default",
                    "sm_blocks": "default" if smb is None else smb,
                    "p_residual": pres,
                    "pipeline": pipe,
                    "value_fold": fold,
                    "fused_merge": fuse,
                    "key_fold": kfold,
                }
                label = " ".join(f"{k}={v}" for k, v in setting.items())
                row = {"method": name, "batch": b, "context": t, **setting}
                with env(
                    VELOX_DECODE_MMA_WARPS=warps,
                    VELOX_DECODE_SUBTILES=sub,
                    VELOX_DECODE_P_RESIDUAL=pres,
                    VELOX_DECODE_PIPELINE=pipe,
                    VELOX_DECODE_VFOLD=fold,
                    VELOX_DECODE_FUSE=fuse,
                    VELOX_DECODE_KFOLD=kfold,
                    **extra,
                ):
                    try:
                        s, se = timeit_split(call, 2, 5, 5 if not quick else 1)
                        host = s - se  # building the call's graph in Python
                        row.update(
                            ms=s * 1e3, GBps=nb / s / 1e9, eval_ms=se * 1e3, host_ms=host * 1e3
                        )
                        print(
                            f"  B{b} {name:16s} {label} {s * 1e3:7.3f} ms {nb / s / 1e9:7.0f} GB/s"
                            f"  (host {host * 1e3:.3f} ms per call)"
                        )
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"
                        print(f"  B{b} {name} {label}: {row['error']}")
                RESULTS["tuning"].append(row)
            del methods
            mx.clear_cache()


def device_time(call, calls: int = 20, passes: int = 3) -> tuple[float, float, dict]:
    """Device time of one ``call`` (µs): after three warm-up calls, ``calls`` calls are built
    and evaluated together under a CUPTI timeline (``torch.profiler``; ImportError without
    torch), and a call's time is the sum of its kernels' durations (fills and copies
    included), the least of ``passes`` passes. Returns it, the kernels a call launched and
    the time per kernel name. Calls run in series only where MLX launches them on the stream
    in order: with ``MLX_USE_CUDA_GRAPHS=0`` set before MLX starts."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    for _ in range(3):
        mx.eval(call())
    mx.synchronize()
    best = None
    for _ in range(passes):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs = [call() for _ in range(calls)]
            mx.eval(outs)
            mx.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        kinds = ("kernel", "gpu_memset", "gpu_memcpy")
        found = [e for e in events if e.get("cat") in kinds]
        if not found:
            raise RuntimeError(f"no {kinds} events in the timeline (CUPTI saw nothing)")
        per_name: dict = {}
        for e in found:
            per_name[e["name"]] = per_name.get(e["name"], 0.0) + e["dur"] / calls
        got = (sum(e["dur"] for e in found) / calls, len(found) / calls, per_name)
        if best is None or got[0] < best[0]:
            best = got
    return best


def device_rows(b: int, t: int, quick: bool) -> list[dict]:
    """Device time per call of each method at one shape (run in a child process started
    with ``MLX_USE_CUDA_GRAPHS=0``, so that every kernel is launched on the stream in order
    and no two calls overlap): ``calls`` calls built and evaluated together after a warm-up,
    under a CUPTI timeline (``torch.profiler``); a call's device time is the sum of its
    kernels' durations (fills and copies included), the least of three passes; ``kernels``
    how many it launched. The kernels' settings are the environment's (``VELOX_DECODE_*``,
    passed on to the child)."""
    calls = 4 if quick else 20
    methods = make_methods(
        b,
        t,
        seed=t + b,
        bits_mlx=(4,),
        bits_uniform=(2, 4),
        bits_tq=(2, 4, 2.5, 3.5),
        portable_row=True,
        qjl=True,
        vecinfer=True,
        bf16=True,
    )
    rows = []
    for name, bits, call, _ in methods:
        row = {"context": t, "batch": b, "method": name, "bits": bits}
        try:
            device_us, nk, _ = device_time(call, calls)
            row.update(device_us=device_us, kernels=nk)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)

    def base(name):
        return next((r for r in rows if r["method"] == name and "device_us" in r), None)

    fp16, bf = base("fp16 sdpa"), base("bf16 sdpa")
    for r in rows:
        if fp16 and "device_us" in r:
            r["device_speedup_vs_fp16"] = fp16["device_us"] / r["device_us"]
        if bf and "device_us" in r and "bf16" in r["method"]:
            r["device_speedup_vs_bf16"] = bf["device_us"] / r["device_us"]
    return rows


@guarded("device")
def section_device(quick: bool) -> None:
    print("\n== b3. device time per call, calls in series (CUPTI timeline, no CUDA graphs) ==")
    import subprocess

    shapes = OPTIONS.get("shapes") or ([(1, 2048)] if quick else [(1, 131072), (8, 131072)])
    for b, t in shapes:
        if over_budget(f"device B{b} T{t}"):
            return
        cmd = [sys.executable, __file__, "--device-rows", f"{b},{t}"]
        cmd += ["--quick"] if quick else []
        child_env = {**os.environ, "MLX_USE_CUDA_GRAPHS": "0"}
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, check=False, env=child_env
        )
        last = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
        if res.returncode != 0 or not last.startswith("["):
            err = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            print(f"  B{b} T{t}: child exited {res.returncode}: {err[0][:300]}")
            RESULTS["device_time"].append({"context": t, "batch": b, "error": err[0][:300]})
            continue
        for r in json.loads(last):
            RESULTS["device_time"].append(r)
            if "device_us" in r:
                x = r.get("device_speedup_vs_fp16")
                xb = r.get("device_speedup_vs_bf16")
                print(
                    f"  B{b} T{t:6d} {r['method']:22s} {r['device_us']:8.1f} us on the device, "
                    f"{r['kernels']:.0f} kernels a call"
                    + (f"  x{x:.2f} vs fp16" if x else "")
                    + (f"  x{xb:.2f} vs bf16" if xb else "")
                )
            else:
                print(f"  B{b} T{t:6d} {r['method']:22s} error: {r.get('error')}")
        write_json()


def encode_both(kc, vc, x):
    """A call that encodes ``x`` as keys (``kc``) and as values (``vc``)."""
    return lambda: (kc.encode(x).data, vc.encode(x).data)


def encode_row(method: str, shown: str, b: int, n: int, call, step_ms=None) -> None:
    """Times ``call``, an encode of ``b`` x ``n`` tokens, with the kernels on and off; records
    the row of ``method`` and prints it (as ``shown``). ``step_ms``: batch 1's decode step in
    ms by ``(attention method, context)``, for a single token's share of the step."""
    with kernels(True):
        s = timeit(call, 3, 7, 5)
    with kernels(False):
        s_ref = timeit(call, 2, 5, 3)
    row = {
        "method": method,
        "batch": b,
        "tokens": n,
        "ms": s * 1e3,
        "us_per_token": s * 1e6 / (b * n),
        "reference_ms": s_ref * 1e3,
    }
    for t in (4096, 131072):
        ms = (step_ms or {}).get((f"velox {method}", t))
        if ms and n == 1 and b == 1:
            row[f"vs_decode_step_T{t}"] = s * 1e3 / ms
    RESULTS["encode"].append(row)
    print(
        f"  {shown:12s} B{b} {n:6d} tokens  kernel {s * 1e3:8.3f} ms "
        f"({s * 1e6 / (b * n):8.3f} us/token)  reference {s_ref * 1e3:8.3f} ms"
    )


@guarded("encode")
def section_encode(quick: bool) -> None:
    """Encode cost: one decode step's new token (K and V, all heads, one layer), and bulk."""
    from velox_core import Uniform
    from velox_turboquant import TurboQuant

    print("\n== b3. encode kernels ==")
    step_ms = {
        (r["method"], r["context"]): r["ms"]
        for r in RESULTS["attention"]
        if "ms" in r and r["batch"] == 1
    }
    for label, make in (
        ("uniform4", lambda: (Uniform(4), Uniform(4))),
        ("turboquant4", lambda: (TurboQuant(4), TurboQuant(4, seed=1))),
    ):
        kc, vc = make()
        for c in (kc, vc):
            c.check(128, mx.float16)
        for b, n in ((1, 1), (8, 1), (1, 512 if quick else 16384)):
            x = mx.random.normal((b, 8, n, 128)).astype(mx.float16)
            mx.eval(x)
            encode_row(label, label, b, n, encode_both(kc, vc, x), step_ms)
    # QJL's encode: the outlier channels per block (MLX ops), then one kernel for both sign
    # sketches and norms, and the indices' packing (MLX)
    from velox_qjl import QJL

    for b, n in ((1, 32), (8, 32), (1, 512 if quick else 16384)):
        kc = QJL()
        kc.check(128, mx.float16)
        x = mx.random.normal((b, 8, n, 128)).astype(mx.float16)
        mx.eval(x)
        encode_row("qjl m256 keys", "qjl m256 k", b, n, lambda x=x, kc=kc: kc.encode(x).data)
    # VecInfer's encode: the smoothing and the Hadamard transform (MLX ops), then the VQ
    # encode kernel (nearest codeword, packing); the reference finds the nearest codeword
    # with a matmul and an argmin, then packs. Fitted on 512 tokens first.
    from velox_vecinfer import VecInfer

    for b, n in ((1, 1), (8, 1), (1, 512 if quick else 16384)):
        kc, vc = VecInfer(iters=8), VecInfer(smooth=False, hadamard=False, iters=8)
        fit = mx.random.normal((b, 8, 512, 128)).astype(mx.float16)
        kc.fit(fit)
        vc.fit(fit)
        x = mx.random.normal((b, 8, n, 128)).astype(mx.float16)
        mx.eval(x, kc.codebook, vc.codebook)
        encode_row("vecinfer2", "vecinfer2", b, n, encode_both(kc, vc, x))


# =============================================================================================
# c. end to end
# =============================================================================================


@guarded("e2e")
def section_e2e(quick: bool) -> None:
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    import velox_core
    from velox_core import UniformCache

    print("\n== c. end to end: reference model decode ==")
    if over_budget("e2e"):
        return
    try:
        model, _ = mlx_lm.load("shared/reference-model")
    except Exception as exc:  # e.g. no tokenizer backend: the weights suffice
        from mlx_lm.utils import load_model

        print(f"  mlx_lm.load failed ({type(exc).__name__}: {exc}); loading the weights only")
        model, _ = load_model(Path("shared/reference-model"))
    ctx = 1024 if quick else 32768
    steps = 8 if quick else 64
    chunk = 512 if quick else 2048
    prompt = mx.random.randint(1, 8000, (1, ctx), key=mx.random.key(0))

    def fp16():
        return velox_core.make_cache(model, default="fp16")

    def mlx_q4():
        return [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]

    def velox_u4():
        return velox_core.make_cache(model, default=UniformCache(bits=4))

    def velox_tq4():
        from velox_turboquant import TurboQuantCache

        return velox_core.make_cache(model, default=TurboQuantCache(bits=4))

    for name, make in (
        ("fp16 KVCache", fp16),
        ("velox UniformCache 4-bit", velox_u4),
        ("velox TurboQuantCache 4-bit", velox_tq4),
        ("mlx-lm QuantizedKVCache q4", mlx_q4),
    ):
        if over_budget(f"e2e {name}"):
            return
        try:
            cache = make()
            with velox_core.routed(model):
                t0 = time.perf_counter()
                for i in range(0, ctx, chunk):
                    logits = model(prompt[:, i : i + chunk], cache=cache)
                    mx.eval(logits)
                fill = time.perf_counter() - t0
                tok = mx.argmax(logits[:, -1], axis=-1)[:, None]
                for _ in range(3):  # warm-up steps
                    tok = mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)[:, None]
                    mx.eval(tok)
                build = 0.0  # building each step's graph (host), then evaluating it
                t0 = time.perf_counter()
                for _ in range(steps):
                    tb = time.perf_counter()
                    tok = mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)[:, None]
                    build += time.perf_counter() - tb
                    mx.eval(tok)
                dt = time.perf_counter() - t0
                # as mlx-lm's generate runs: the next step's graph is built while the device
                # evaluates this one (async_eval)
                gen = generate_step(tok[0], model, max_tokens=steps + 4, prompt_cache=cache)
                for i, _ in enumerate(gen):
                    if i == 3:
                        tg = time.perf_counter()
                dg = time.perf_counter() - tg
            nb = sum(getattr(c, "nbytes", 0) for c in cache)
            row = {
                "cache": name,
                "context": ctx,
                "steps": steps,
                "tokens_per_s": steps / dt,
                "ms_per_token": dt * 1e3 / steps,
                "build_ms_per_token": build * 1e3 / steps,
                "generate_tokens_per_s": steps / dg,
                "prefill_s": fill,
                "cache_bytes": nb,
            }
            print(
                f"  {name:28s} {steps / dt:8.1f} tok/s  ({dt * 1e3 / steps:.2f} ms/token, "
                f"{build * 1e3 / steps:.2f} of it building the graph; generate_step "
                f"{steps / dg:.1f} tok/s; prefill {fill:.1f}s, cache {nb / 2**20:.0f} MiB)"
            )
        except Exception as exc:
            row = {
                "cache": name,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
            print(f"  {name}: {row['error']}\n{row['traceback']}")
        RESULTS["e2e"].append(row)
        del cache
        mx.clear_cache()


# =============================================================================================
# d. output
# =============================================================================================


def device_info() -> dict:
    info = {
        "mlx": mx.__version__,
        "python": platform.python_version(),
        "device": str(mx.default_device()),
    }
    try:
        from velox_core.kernels import backend

        info["kernel_backend"] = backend()
    except Exception as exc:
        info["kernel_backend"] = repr(exc)
    try:
        info.update({k: str(v) for k, v in mx.device_info().items()})
    except Exception:
        pass
    try:
        from velox_core.kernels.mma_support import sm_count

        info["sm_count"] = sm_count()  # what sizes the tensor-core kernel's splits
    except Exception as exc:
        info["sm_count"] = repr(exc)
    return info


def write_json() -> Path:
    out = Path(os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_attention.json"
    RESULTS["elapsed_s"] = elapsed()
    path.write_text(json.dumps(RESULTS, indent=1, default=str))
    return path


def print_table() -> None:
    print("\n== summary ==")
    bw = RESULTS["bandwidth"]
    if bw:
        print(f"copy bandwidth {bw['copy_GBps']:.0f} GB/s, read {bw['read_GBps']:.0f} GB/s")
    # ms: building the call in Python and evaluating it; eval: the evaluation alone
    cols = ("ms", "GB/s", "%copy", "xfp16", "xmlx", "eval", "xfp16e", "xmlxe")
    print(
        f"{'B':>2} {'ctx':>7} {'method':20s} {cols[0]:>8} " + " ".join(f"{c:>6}" for c in cols[1:])
    )
    for r in RESULTS["attention"]:
        if "ms" not in r:
            print(f"{r['batch']:>2} {r['context']:>7} {r['method']:20s} error")
            continue
        pct = f"{r['pct_copy_bw']:.0f}" if "pct_copy_bw" in r else "-"
        xf = f"{r['speedup_vs_fp16']:.2f}" if "speedup_vs_fp16" in r else "-"
        xm = f"{r['speedup_vs_mlx_lm']:.1f}" if "speedup_vs_mlx_lm" in r else "-"
        ev = f"{r['eval_ms']:.3f}" if "eval_ms" in r else "-"
        xfe = f"{r['eval_speedup_vs_fp16']:.2f}" if "eval_speedup_vs_fp16" in r else "-"
        xme = f"{r['eval_speedup_vs_mlx_lm']:.1f}" if "eval_speedup_vs_mlx_lm" in r else "-"
        print(
            f"{r['batch']:>2} {r['context']:>7} {r['method']:20s} {r['ms']:8.3f} "
            f"{r['GBps']:6.0f} {pct:>6} {xf:>6} {xm:>6} {ev:>6} {xfe:>6} {xme:>6}"
        )
    for r in RESULTS["device_time"]:
        if "device_us" in r:
            x = r.get("device_speedup_vs_fp16")
            print(
                f"device {r['batch']:>2} {r['context']:>7} {r['method']:22s} "
                f"{r['device_us']:8.1f} us" + (f"  x{x:.2f} vs fp16" if x else "")
            )
    for r in RESULTS["e2e"]:
        if "tokens_per_s" in r:
            print(f"e2e {r['cache']:28s} {r['tokens_per_s']:8.1f} tok/s at {r['context']} tokens")
    if RESULTS["errors"]:
        print(f"section errors: {[e['section'] for e in RESULTS['errors']]}")
    print(f"elapsed {elapsed():.0f}s")


SECTIONS = {  # in run order
    "bandwidth": section_bandwidth,
    "attention": section_attention,
    "tuning": section_tuning,
    "device": section_device,
    "encode": section_encode,
    "e2e": section_e2e,
}


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: ``skip`` a set of :data:`SECTIONS` names, ``contexts`` and
    ``batches`` tuples of positive ints, ``shapes`` a list of (batch, context) pairs. A bad
    value exits with a usage error naming it and what is allowed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument(
        "--skip", default="", help="comma-separated sections to skip: " + ",".join(SECTIONS)
    )
    parser.add_argument("--contexts", default="", help="attention contexts, e.g. 16384,131072")
    parser.add_argument("--batches", default="", help="attention batch sizes, e.g. 1,8")
    parser.add_argument(
        "--shapes",
        default="",
        help="attention shapes in this order, BxT, e.g. 1x131072,8x131072 (instead of the "
        "batches x contexts grid)",
    )
    parser.add_argument(
        "--budget", type=float, default=BUDGET_S, help="seconds after which no new shape starts"
    )
    parser.add_argument("--mlx-lm", default=None, help=argparse.SUPPRESS)  # B,T: child rows
    parser.add_argument("--device-rows", default=None, help=argparse.SUPPRESS)  # B,T: child
    args = parser.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if "checks" in args.skip:
        parser.error(
            "--skip: the checks are not a section of this script; "
            "python3 -m pytest -q -m gpu tests/test_gpu_attention.py runs them"
        )
    unknown = sorted(args.skip - set(SECTIONS))
    if unknown:
        parser.error(f"--skip: unknown sections {unknown}; the sections: {','.join(SECTIONS)}")
    for name in ("contexts", "batches"):
        text = getattr(args, name)
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
            ok = all(v >= 1 for v in values)
        except ValueError:
            ok = False
        if not ok:
            parser.error(f"--{name} takes positive integers such as 1,8, got {text!r}")
        setattr(args, name, values)
    items = [x for x in args.shapes.split(",") if x.strip()]
    try:
        shapes = [tuple(int(v) for v in x.lower().split("x")) for x in items]
    except ValueError:
        parser.error(f"--shapes takes BxT items such as 1x131072, got {args.shapes!r}")
    if any(len(x) != 2 or min(x) < 1 for x in shapes):
        parser.error(f"--shapes takes BxT items such as 1x131072, got {args.shapes!r}")
    args.shapes = shapes
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_options(argv)
    OPTIONS["budget"] = args.budget
    OPTIONS["contexts"] = args.contexts
    OPTIONS["batches"] = args.batches
    OPTIONS["shapes"] = args.shapes
    if args.mlx_lm:
        b, t = (int(x) for x in args.mlx_lm.split(","))
        methods = make_methods(b, t, seed=t + b, bits_mlx=(2, 4, 8), bits_uniform=(), bits_tq=())
        print(json.dumps(time_methods(methods, b, t, args.quick)))
        return 0
    if args.device_rows:
        b, t = (int(x) for x in args.device_rows.split(","))
        print(json.dumps(device_rows(b, t, args.quick)))
        return 0
    RESULTS["device"] = device_info()
    print(f"velox gpu_attention: {RESULTS['device']}")
    for name, section in SECTIONS.items():
        if name in args.skip:
            RESULTS["skipped"].append(f"{name} (--skip)")
            continue
        section(args.quick)
        write_json()  # keep what was measured even if a later section dies
    path = write_json()
    print_table()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
