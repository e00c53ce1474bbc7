"""Where the tensor-core decode kernel spends its time (CUDA GPU): source variants and timers.

Without a GPU profiler on the machine, this script answers "what limits the kernel" by
measurement. It builds ``metal/decode_attention_mma.cu`` as the library does (same template,
launch bounds and splits), then:

* **variants**: the kernel alone, merging its own splits (a fill and the kernel, as the
  library launches it up to 16k tokens; past them the library merges in a second launch),
  in device time against fp16 ``mx.fast.scaled_dot_product_attention`` in the same run
  (``gpu_attention.device_time``: calls in series, the sum of their CUPTI kernel durations,
  least of three passes; it needs torch, present on the lent machine; the script sets
  ``MLX_USE_CUDA_GRAPHS=0`` before MLX starts), as shipped and with one part removed by a
  text edit of the source: no copies (computing on whatever shared memory holds), no key
  MMAs or no value MMAs (each replaced by a fold that keeps its inputs live), no value step
  at all, no exponentials, the copies alone, no key decode or no value decode (the code
  words go into the MMAs unmasked); plus template settings (the weights' residual, the
  software pipeline, the value scales folded into the weights, the key scales folded out of
  the score MMA, the code words through ldmatrix). The edited kernels compute wrong results
  on purpose: only their time is of interest. An edit that no longer matches the source
  stops the run with the text it looked for.
* **timers**: the shipped kernel with ``%globaltimer`` and ``clock64`` read at its start,
  around its tile loop and at its end, and its SM (``%smid``; one thread per threadgroup
  writes them over its ``ml_part`` row): the kernel's span on the GPU, the threadgroups'
  start spread, prologue / loop / epilogue time, the SM clock under load, the time per loop
  step, and where the loop times differ: by the number of threadgroups an SM ran, and across
  the (batch, head) rows (the threadgroups an SM holds at once run at different speeds).

Run on the GPU machine from the repository root::

    source .gpu/wheels/activate && python3 benchmarks/gpu_decode_profile.py

``--shapes 1x131072,8x131072`` (batch x context, 32 query heads, 8 KV heads, head dim 128),
``--bits 4,2``, ``--skip variants``, ``--skip timers`` or ``--skip outlier``.

* **outlier** (``--fractional 3.5``): TurboQuant's fractional widths through their own
  kernel (velox-turboquant's ``metal/decode_attention_outlier.metal``), as shipped and
  without its scoring loop, its value loop or both (``outlier_variants``). Writes
``$OUT/gpu_decode_profile.json`` (``./out`` without ``$OUT``). About a minute per shape on
an H200, first-call compiles included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")  # calls in series: device time per call

import mlx.core as mx
import numpy as np

import velox_core.kernels.build as build
from velox_core import Uniform
from velox_core.kernels import mma as kmma

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_attention import device_time, env  # the benchmarks' device-time rule, settings

SOURCE = "decode_attention_mma.cu"
_ORIGINAL = build.kernel_source
_VARIANTS: dict[str, str] = {}


def _kernel_source(name: str, package: str = "velox_core") -> str:
    if name.startswith("variant:"):
        return _VARIANTS[name.split(":", 1)[1]]
    return _ORIGINAL(name, package)


def install() -> None:
    """Route ``variant:<name>`` sources to the edited kernels (KernelSpec.body reads sources
    through ``velox_core.kernels.build.kernel_source``)."""
    src = _ORIGINAL(SOURCE)
    _VARIANTS.update(make_variants(src))
    _VARIANTS["timed"] = timed_source(src)
    _VARIANTS.update(outlier_variants(_ORIGINAL(OUTLIER_SOURCE, "velox_turboquant")))
    build.kernel_source = _kernel_source


def edit(src: str, old: str, new: str) -> str:
    if old not in src:
        raise SystemExit(f"the kernel source changed: variant edit not found:\n{old}")
    return src.replace(old, new, 1)


def edit_all(src: str, pattern: str, repl: str, count: int) -> str:
    """Every match of the regular expression ``pattern`` replaced; exactly ``count`` expected."""
    out, n = re.subn(pattern, repl, src)
    if n != count:
        raise SystemExit(f"the kernel source changed: {n} matches of {pattern!r}, not {count}")
    return out


def between(src: str, start: str, end: str, new: str) -> str:
    if start not in src or end not in src:
        raise SystemExit(f"the kernel source changed: markers not found: {start!r} {end!r}")
    return src[: src.index(start)] + new + src[src.index(end) :]


def make_variants(src: str) -> dict[str, str]:
    """The kernel source with one part removed, by name."""
    v = {"shipped": src}
    s = edit(
        src,
        "auto issue = [&](int tile, int stage) {\n",
        "auto issue = [&](int tile, int stage) {\n"
        "  if (tile >= 0 || stage >= 0) {\n    return;\n  }\n",
    )
    v["no copies"] = edit(s, "    vx_mbar_wait(my_bar + k", "    if (0) vx_mbar_wait(my_bar + k")
    # every score MMA (one chain per group with the key fold, two chains without; the same
    # three shapes again for per-channel keys)
    v["no key MMAs"] = edit_all(
        src,
        r"vx_mma16816\((sc\[u\]\[[^\]]+\]), af\[0\], af\[1\], af\[2\], af\[3\], [^;]+\);",
        r"\1[0] += __uint_as_float(af[0] ^ af[1] ^ af[2] ^ af[3]);",
        8,
    )
    s = src
    for old in (
        "        vx_mma16816(oacc[j], af[0], af[1], af[2], af[3], pf[u][0], pf[u][1]);",
        "        vx_mma16816(oacc[j], af[0], af[1], af[2], af[3], pb[u][0][0], pb[u][0][1]);",
        "        vx_mma16816(oacc[j], af[0], af[1], af[2], af[3], pb[u][1][0], pb[u][1][1]);",
    ):
        s = edit(s, old, "        oacc[j][0] += __uint_as_float(af[0] ^ af[1] ^ af[2] ^ af[3]);")
    v["no value MMAs"] = s
    consume = "  oacc[0][0] += __uint_as_float(pb[0][0][0] ^ pb[0][0][1] ^ st[O_VC + lane]);\n"
    v["no value step"] = between(
        src, "  // values: the lane's words", "  __syncwarp();  // every lane is done", consume
    )
    v["no key decode"] = edit(
        src,
        "af[n + 2 * uu] = KIL ? vx_code_sub(x, pos & 7, KBITS)",
        "af[n + 2 * uu] = KIL ? x",
    )
    v["no value decode"] = edit(
        src,
        "af[e] = vx_code_sub(y, bit & 7, VBITS);\n          continue;",
        "af[e] = y;\n          continue;",
    )
    v["no exponentials"] = edit(
        src,
        "      p4[i] = v4[u][i] ? vx_exp2_ftz(s4[u][i] - mrow[i & 1]) : 0.0f;",
        "      p4[i] = v4[u][i] ? (s4[u][i] - mrow[i & 1]) : 0.0f;",
    )
    copies = between(
        v["no value step"],
        "auto score_step = [&](const unsigned int* st, int tb, float (&sc)[NSUB][2][4]) {\n",
        "// the tile's copies have landed",
        "auto score_step = [&](const unsigned int* st, int tb, float (&sc)[NSUB][2][4]) {\n"
        "  sc[0][0][0] = __uint_as_float(st[O_KC + lane] ^ st[O_KS + (lane & 7)]);\n};\n",
    )
    v["copies alone"] = copies
    return v


TIMED = """
VX_BARRIER();
if (tid == 0) {
  unsigned long long gt3;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt3));
  float* w = ml_part + row0 * 2;
  w[0] = __uint_as_float((unsigned)gt0);
  w[1] = __uint_as_float((unsigned)(gt0 >> 32));
  w[2] = __uint_as_float((unsigned)gt1);
  w[3] = __uint_as_float((unsigned)gt2);
  w[4] = __uint_as_float((unsigned)gt3);
  w[5] = (float)(ck1 - ck0);
  w[6] = (float)nmine;
  unsigned int smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  w[7] = (float)smid;
}
"""


def timed_source(src: str) -> str:
    """The shipped kernel with timers; thread 0 writes them and its SM id over its
    threadgroup's ml_part row block (needs MROWS >= 4: 8 floats)."""
    gt = 'unsigned long long gt{0}; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt{0}));\n'
    s = edit(
        src,
        "const int ntiles = t1 > t0 ? (t1 - t0 + TILE - 1) / TILE : 0;\n",
        "const int ntiles = t1 > t0 ? (t1 - t0 + TILE - 1) / TILE : 0;\n" + gt.format(0),
    )
    s = edit(
        s,
        "for (int k = 0; k < nmine; ++k) {\n",
        gt.format(1) + "long long ck0 = clock64();\nfor (int k = 0; k < nmine; ++k) {\n",
    )
    s = edit(
        s, "vx_cp_wait<0>();\n", "vx_cp_wait<0>();\nlong long ck1 = clock64();\n" + gt.format(2)
    )
    return s.rstrip() + "\n" + TIMED


def launcher(
    variant: str,
    q,
    keys,
    values,
    p_residual=None,
    pipeline=None,
    value_fold=None,
    fuse=True,
    key_fold=None,
    ldsm=None,
):
    """A call of the tensor-core kernel (source ``variant``) as the library launches it: by
    default merging its own splits into a ``q.dtype`` output (``FUSE`` 1, one zeroed output,
    what a cache without fp16 segments runs up to 16k tokens); ``fuse=False``: the partials
    alone (the kernel's two outputs, as past 16k tokens); ``ldsm`` given:
    ``VELOX_DECODE_LDSM`` for the plan. Returns the call (it returns the kernel's first
    output) and the launch's settings, ``layout`` among them (with ``fuse``:
    :func:`velox_core.kernels.mma.mma_layout`; else None)."""
    b, h, m, d = q.shape
    out_dtype = q.dtype if fuse else None
    with env(**({} if ldsm is None else {"VELOX_DECODE_LDSM": int(ldsm)})):
        launch = kmma.mma_launch(
            q.shape,
            q.dtype,
            keys,
            values,
            None,
            d**-0.5,
            p_residual,
            pipeline,
            value_fold,
            out_dtype=out_dtype,
            key_fold=key_fold,
        )
    base = launch.spec
    tag = f"{abs(hash(variant)) % 10**8}"
    spec = dataclasses.replace(base, name=f"{base.name}_v{tag}", source="variant:" + variant)
    kernel = spec.kernel()
    tmpl, splits, nt = launch.template, launch.splits, launch.nwarps * 32
    kc, ka, kb, kl = kmma.mma_inputs(keys)
    vc, va, vb, vl = kmma.mma_inputs(values)
    inputs = [q, kc, ka, kb, vc, va, vb, kl, vl]
    layout = kmma.mma_layout(b, h, splits, m, d, out_dtype) if fuse else None
    # merging: one zeroed workspace; else the partials' two outputs, (m, l) and o
    shapes = [(layout.size,)] if fuse else [(b, h, splits, m, 2), (b, h, splits, m, d)]

    def call():
        return kernel(
            inputs=inputs,
            template=tmpl,
            grid=(splits * nt, b * h, 1),
            threadgroup=(nt, 1, 1),
            output_shapes=shapes,
            output_dtypes=[mx.float32] * len(shapes),
            init_value=0 if fuse else None,
        )[0]

    t = dict(tmpl)
    info = dict(
        splits=splits,
        stages=t["NSTAGE"],
        subtiles=t["NSUB"],
        p_residual=t["PLO"],
        pipeline=t["PIPE"],
        value_fold=t["VFOLD"],
        key_fold=t["KFOLD"],
        ldsm=t["LDSM"],
        fuse=t["FUSE"],
    )
    return call, {**info, "layout": layout}


def shape_data(b: int, t: int, bits: int):
    hq, hk, d = 32, 8, 128
    k1, k2, k3 = mx.random.split(mx.random.key(t + b), 3)
    k = mx.random.normal((b, hk, t, d), key=k1).astype(mx.float16)
    v = mx.random.normal((b, hk, t, d), key=k2).astype(mx.float16)
    q = mx.random.normal((b, hq, 1, d), key=k3).astype(mx.float16)
    codec = Uniform(bits)
    kp, vp = codec.encode(k), codec.encode(v)
    mx.eval(k, v, q, kp.data, vp.data)
    keys, values = codec.kernel_codes(kp), codec.kernel_codes(vp)  # AffineCodes
    return k, v, q, q.reshape(b, hk, hq // hk, d), keys, values


def section_variants(b: int, t: int, bits: int, rows: list) -> None:
    k, v, q, qg, keys, values = shape_data(b, t, bits)
    fp16 = device_time(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=128**-0.5))[0]
    rows.append(
        dict(section="variants", batch=b, context=t, bits=bits, what="fp16 sdpa", device_us=fp16)
    )
    print(f"  B{b} T{t} fp16 sdpa {fp16:.1f} us", flush=True)
    runs = [(n, {}) for n in _VARIANTS if n != "timed" and not n.startswith("outlier-")]
    runs += [("shipped", dict(p_residual=True)), ("shipped", dict(pipeline=False))]
    runs += [("shipped", dict(value_fold=False)), ("shipped", dict(key_fold=False))]
    runs += [("shipped", dict(ldsm=False))]
    for name, kw in runs:
        call, info = launcher(name, qg, keys, values, **kw)
        info.pop("layout")
        us = device_time(call)[0]
        label = name + "".join(f" {k}={int(v)}" for k, v in kw.items())
        rows.append(
            dict(
                section="variants",
                batch=b,
                context=t,
                bits=bits,
                what=label,
                device_us=us,
                x_fp16=fp16 / us,
                **info,
            )
        )
        print(
            f"  B{b} T{t} {bits}-bit {label:28s} {us:7.1f} us  x{fp16 / us:.2f} vs fp16", flush=True
        )


OUTLIER_SOURCE = "decode_attention_outlier.metal"
_SCORES = "for (int base = 0; base < GROUP; base += TPP) {"
_VALUES = "for (int tok = ts; tok < GROUP; tok += VTS) {"


def outlier_variants(src: str) -> dict[str, str]:
    """The outlier kernel (TurboQuant's fractional widths) without its scoring loop, its
    value loop, or both; without the two transforms' butterflies; without its threadgroup
    barriers (text edits; results wrong on purpose)."""
    no_scores = edit(src, _SCORES, _SCORES.replace("base < GROUP", "base < 0"))
    no_values = edit(src, _VALUES, _VALUES.replace("tok < GROUP", "tok < 0"))
    neither = edit(no_scores, _VALUES, _VALUES.replace("tok < GROUP", "tok < 0"))
    no_fly = edit_all(src, r"hs < (K|V)BK; hs <<= 1", "hs < 0; hs <<= 1", 2)
    no_bar = "#undef VX_BARRIER\n#define VX_BARRIER()\n" + src
    return {
        "outlier-shipped": src,
        "outlier-no-scores": no_scores,
        "outlier-no-values": no_values,
        "outlier-neither": neither,
        "outlier-no-butterflies": no_fly,
        "outlier-no-barriers": no_bar,
    }


def section_outlier(b: int, t: int, bits: float, rows: list) -> None:
    """Device time of a fractional TurboQuant decode (``joint_attention``: the outlier kernel
    and the merge) as shipped and with its scoring or value loop removed: what the loops
    cost, and what the rest (staging, the query's placement and butterflies, the softmax,
    the values' butterflies and gather, the barriers) does."""
    from velox_core.cache.attention import Segment, joint_attention
    from velox_turboquant import TurboQuant
    from velox_turboquant import outlier as ok

    hk, hq, d = 8, 32, 128
    k1, k2, k3 = mx.random.split(mx.random.key(t + b), 3)
    k = mx.random.normal((b, hk, t, d), key=k1).astype(mx.float16)
    v = mx.random.normal((b, hk, t, d), key=k2).astype(mx.float16)
    q = mx.random.normal((b, hk, hq // hk, d), key=k3).astype(mx.float16)
    kc, vc = TurboQuant(bits), TurboQuant(bits, seed=1)
    kc.check(d, mx.float16)
    vc.check(d, mx.float16)
    kp, vp = kc.encode(k), vc.encode(v)
    mx.eval(kp.data, vp.data)
    shipped = ok.OUTLIER
    try:
        for name in outlier_variants(build.kernel_source(OUTLIER_SOURCE, "velox_turboquant")):
            ok.OUTLIER = dataclasses.replace(
                shipped, name=f"{shipped.name}_{name.replace('-', '_')}", source="variant:" + name
            )
            us = device_time(
                lambda: joint_attention(q, [Segment(kc, kp, vc, vp)], mx.float16, d**-0.5)
            )[0]
            rows.append(
                dict(section="outlier", batch=b, context=t, bits=bits, what=name, device_us=us)
            )
            print(f"  B{b} T{t} {bits}-bit {name:28s} {us:7.1f} us", flush=True)
    finally:
        ok.OUTLIER = shipped


def timer_summary(w: np.ndarray, splits: int) -> dict:
    """The timed kernel's per-threadgroup words (rows in launch order, (batch, head) major:
    ``timed_source``'s eight floats) summed up: span, start spread, median prologue / loop /
    epilogue (µs), the slowest loop, SM clock, steps per warp and cycles per step, and where
    the loop times differ: the median loop of the SMs that ran each number of threadgroups,
    and the (batch, head) rows' median loops (percentiles 0, 10, 50, 90, 100)."""
    u = w[:, :8].view(np.uint32).astype(np.int64)
    start = (u[:, 1] << 32) | u[:, 0]

    def gap(x, y):
        return ((y - x) % (1 << 32)).astype(np.float64)

    pro, loop, epi = gap(u[:, 0], u[:, 2]), gap(u[:, 2], u[:, 3]), gap(u[:, 3], u[:, 4])
    st = (start - start.min()).astype(np.float64)
    end = st + pro + loop + epi
    tiles = np.maximum(w[:, 6].astype(np.float64), 1)
    sm = w[:, 7].astype(np.int64)
    per_sm = np.bincount(sm)
    by_count = {
        int(c): float(np.median(loop[per_sm[sm] == c]) / 1e3) for c in np.unique(per_sm[sm])
    }
    rows_bh = loop.reshape(-1, splits)
    pct = [0, 10, 50, 90, 100]
    return dict(
        threadgroups=len(st),
        span_us=end.max() / 1e3,
        start_spread_us=st.max() / 1e3,
        prologue_us=np.median(pro) / 1e3,
        loop_us=np.median(loop) / 1e3,
        loop_max_us=loop.max() / 1e3,
        epilogue_us=np.median(epi) / 1e3,
        sm_ghz=float(np.median(w[:, 5] / np.maximum(loop, 1))),
        tiles_per_warp=float(np.median(tiles)),
        cycles_per_tile_per_warp=float(np.median(w[:, 5] / tiles)),
        sms=int(np.count_nonzero(per_sm)),
        loop_us_by_sm_threadgroups=by_count,
        loop_us_by_row_pct=[float(x) / 1e3 for x in np.percentile(np.median(rows_bh, 1), pct)],
    )


def section_timers(b: int, t: int, bits: int, rows: list) -> None:
    _, _, _, qg, keys, values = shape_data(b, t, bits)
    call, info = launcher("timed", qg, keys, values)
    layout = info.pop("layout")
    for _ in range(3):
        ws = call()
        mx.eval(ws)
    mx.synchronize()
    m = qg.shape[2]
    # the timers, written over the partials' (m, l) rows (mma_layout's offsets)
    ml = ws[layout.ml_off : layout.ml_off + layout.b * layout.h * layout.splits * m * 2]
    w = np.array(ml).reshape(-1, 2 * m)[:, :8].copy()
    row = dict(section="timers", batch=b, context=t, bits=bits)
    row.update(timer_summary(w, info["splits"]), **info)
    row = {k: (float(x) if isinstance(x, np.floating) else x) for k, x in row.items()}
    rows.append(row)
    by = ", ".join(f"{k} a SM: {v:.1f}" for k, v in row["loop_us_by_sm_threadgroups"].items())
    rpct = " / ".join(f"{x:.1f}" for x in row["loop_us_by_row_pct"])
    print(
        f"  B{b} T{t} {bits}-bit timers: span {row['span_us']:.1f} us, prologue "
        f"{row['prologue_us']:.1f}, loop {row['loop_us']:.1f} (max {row['loop_max_us']:.1f}; "
        f"{row['tiles_per_warp']:.0f} steps of {16 * row['subtiles']} tokens a warp, "
        f"{row['cycles_per_tile_per_warp']:.0f} cycles each), epilogue "
        f"{row['epilogue_us']:.1f}; SM clock {row['sm_ghz']:.2f} GHz; median loop by "
        f"threadgroups {by}; rows' loops (pct 0/10/50/90/100) {rpct}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1x131072,8x131072", help="BxT items")
    parser.add_argument("--bits", default="4,2", help="code widths (2, 4 or 8)")
    parser.add_argument("--skip", default="", help="variants, timers and/or outlier")
    parser.add_argument(
        "--fractional", default="3.5", help="TurboQuant widths for the outlier section"
    )
    args = parser.parse_args()
    try:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
        bits = [int(x) for x in args.bits.split(",")]
        fractional = [float(x) for x in args.fractional.split(",")]
    except ValueError:
        parser.error("--shapes takes BxT items (1x131072) and --bits integers")
    if any(len(s) != 2 or min(s) < 1 for s in shapes) or any(x not in kmma.MMA_BITS for x in bits):
        parser.error(f"--shapes takes BxT items and --bits values in {kmma.MMA_BITS}")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    from velox_core.kernels import backend

    if backend() != "cuda":
        print("gpu_decode_profile.py needs MLX's CUDA backend (the kernel is CUDA-only)")
        return 2
    install()
    rows: list = []
    print(f"SMs: {kmma.sm_count()}; MLX {mx.__version__}", flush=True)
    out = Path(os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_decode_profile.json"
    device = {"mlx": mx.__version__, "sm_count": kmma.sm_count()}
    for b, t in shapes:
        for w in bits:
            if "variants" not in skip:
                section_variants(b, t, w, rows)
            if "timers" not in skip:
                section_timers(b, t, w, rows)
            path.write_text(json.dumps({"device": device, "rows": rows}, indent=1))  # so far
        if "outlier" not in skip:
            for fb in fractional:
                section_outlier(b, t, fb, rows)
            path.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
