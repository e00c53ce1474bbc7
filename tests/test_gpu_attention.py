"""Decode and encode kernels on a GPU against the reference MLX path (``-m gpu``; skipped
where MLX runs on the CPU). Also runs as a script, one line per check with its errors:
``python3 tests/test_gpu_attention.py`` (``--quick``: tiny shapes, a smoke test;
``--json PATH``: each check's row with its errors).

- decode: a kernel's partial ``(o, m, l)`` against one computed on the CPU from the decoded
  keys and values (plain float32 matmuls, so no TF32 or reduced-precision GPU product enters
  the reference); a side the tensor-core kernel decodes (its scales not folded) is first
  rounded to fp16, the precision the kernel computes with, and the error against the
  unrounded float32 reference is reported beside (``out_rel_vs_fp32``). Shapes: Uniform
  2/3/4/8 bits, TurboQuant 2/3/4 bits and fractional widths, QJL and VecInfer keys, B=2, odd
  T, T not a multiple of the split, grouped-query blocks, bf16 scales, folds switched off.
- cache: a cache filled chunk by chunk (its coded segment a slice of a larger buffer),
  attended at decode steps with kernels and with kernels off.
- encode: the fused encode's records against the reference encode's, bit for bit where the
  reference is exact (affine, codebook), within the reference's rounding where it is a GPU
  matmul (VQ distances, sign sketches).
- the fp16 MMA on subnormal codes that the tensor-core kernel's folds rely on (CUDA).

Every check is one :class:`Case` of :func:`checks` (its name is the test's id); a check
function returns ``(passed, errors)``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from velox_core.cache.attention import Segment, fused_partial
from velox_core.kernels import backend, use_kernels
from velox_core.kernels.config import configured

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(backend() == "cpu", reason="MLX runs on the CPU here")
needs_cuda = pytest.mark.skipif(
    backend() != "cuda", reason="the tensor-core kernel's folds run on CUDA only"
)

# velox-qjl's recommended "4-bit" keys (METHOD.recommended[0], without its value settings)
QJL_4BIT = {"sketch": 320, "outlier_bits": 8, "group": 128}


def lazy(target: str, *args, **kwargs) -> Callable[[], object]:
    """A maker of ``module:Name(*args, **kwargs)``, imported when called: collecting the
    checks imports no method package."""
    module, _, name = target.partition(":")

    def make():
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return make


def kernels(enabled: bool):
    """The kernels on or off for a ``with`` block (``KernelConfig.enabled``)."""
    return configured(enabled=enabled)


# =============================================================================================
# references and errors
# =============================================================================================


def partial_errors(got, ref) -> dict:
    """Errors of a partial ``(o, m, l)`` against the reference. A partial's ``m`` may lie below
    its scores' max (the tensor-core kernel raises it lazily), so ``o`` and ``l`` are compared
    after moving them to the reference's ``m``; ``m_excess`` is how far ``m`` lies above the
    true max (it must not: the weights would underflow)."""
    o, m, l = (x.astype(mx.float32) for x in got)
    ro, rm, rl = (x.astype(mx.float32) for x in ref)
    w = mx.exp(m - rm)
    out, rout = o / l, ro / rl
    return {
        "out_rel": (mx.max(mx.abs(out - rout)) / mx.max(mx.abs(rout))).item(),
        "m_excess": max(0.0, mx.max(m - rm).item() - 1e-3 * max(1.0, mx.max(mx.abs(rm)).item())),
        "l_rel": (mx.max(mx.abs(l * w - rl)) / mx.max(mx.abs(rl))).item(),
        "o_rel": (mx.max(mx.abs(o * w - ro)) / mx.max(mx.abs(ro))).item(),
    }


def dense_partial(q, kc, kp, vc, vp, fp16: tuple[bool, bool] = (False, False)):
    """The reference partial from decoded float32 keys and values (plain MLX matmuls on the
    CPU, so that no TF32 or reduced-precision GPU matmul enters the reference); with
    ``fp16`` (keys, values) a side's decoded values are first rounded to float16, the
    precision of an fp16 cache and of the tensor-core kernel's decoded fragments (a side whose
    scales the kernel folds is not decoded, so not rounded)."""
    with mx.stream(mx.cpu):
        k, v = kc.decode(kp), vc.decode(vp)
        if fp16[0]:
            k = k.astype(mx.float16).astype(mx.float32)
        if fp16[1]:
            v = v.astype(mx.float16).astype(mx.float32)
        s = q @ mx.swapaxes(k, -1, -2)
        m = mx.max(s, axis=-1, keepdims=True)
        p = mx.exp(s - m)
        out = p @ v, m, mx.sum(p, axis=-1, keepdims=True)
        mx.eval(out)
    return out


def mma_plan(codec_k, kp, codec_v, vp, q) -> dict | None:
    """The tensor-core kernel's template constants for this decode, or None where it does not
    go through that kernel (CUDA; affine 2/4/8 bits, or TurboQuant_mse's 2/4-bit codebook
    codes...)."""
    from velox_core import Uniform
    from velox_core.cache.attention import kernel_sides
    from velox_core.kernels import mma as kmma
    from velox_core.kernels import mma_support as kmsup
    from velox_turboquant import TurboQuant

    if backend() != "cuda" or not kmsup.mma_enabled():
        return None
    if not isinstance(codec_k, (Uniform, TurboQuant)):
        return None
    with kernels(True):
        got = kernel_sides(codec_k, kp, codec_v, vp, q.shape)
    sides = None if got is None else (got[0].record, (got[0].values or got[1]).record)
    dim = q.shape[-1]
    if sides is None or not kmma.mma_supported(q.shape[2], dim, *sides):
        return None
    launch = kmma.mma_launch(q.shape, q.dtype, *sides)
    return None if launch is None else dict(launch.template)


def sketch_mma_taken(codec_k, kp, codec_v, vp, q) -> bool:
    """Whether QJL keys go through the tensor-core sketch kernel for this decode
    (``velox_qjl.sketch_mma``)."""
    from velox_core.cache.attention import kernel_sides
    from velox_qjl import QJL

    if not isinstance(codec_k, QJL):
        return False
    with kernels(True):
        sides = kernel_sides(codec_k, kp, codec_v, vp, q.shape)
    return sides is not None and sides[0].record.sketch.mma


@contextlib.contextmanager
def fp16_levels(*codecs):
    """The codecs' Lloyd-Max levels rounded to fp16 for the while (TurboQuant's quantizers):
    the precision the tensor-core kernel's register tables hold them at, for its reference."""
    saved = []
    for c in codecs:
        for _, quant in getattr(c, "parts", []):
            if getattr(quant, "levels", None) is not None:
                saved.append((quant, quant.levels))
                quant.levels = quant.levels.astype(mx.float16).astype(mx.float32)
    try:
        yield
    finally:
        for quant, lev in saved:
            quant.levels = lev


def compare_records(ref, got, prefix: str = "") -> tuple[bool, dict]:
    """Whether two ``Packed`` records are identical, and each array's mismatch count (or its
    shape/dtype difference), keyed ``<prefix><array>_mismatch``."""
    errs, ok = {}, True
    for key, r in ref.data.items():
        g = got.data[key]
        if g.shape != r.shape or g.dtype != r.dtype:
            ok = False
            errs[prefix + key] = f"shape/dtype {g.shape} {g.dtype} vs {r.shape} {r.dtype}"
            continue
        diff = mx.sum(g != r).item()
        errs[f"{prefix}{key}_mismatch"] = int(diff)
        ok = ok and diff == 0
    return ok, errs


# =============================================================================================
# the checks: each returns (passed, errors)
# =============================================================================================


def decode_check(keys, values, b, h, t, m, dtype=mx.float16, seed=0, tol=1e-3):
    """Fused decode attention over K/V (b, h, t, 128) in ``dtype`` coded by ``keys()`` and
    ``values()`` (codec makers), ``m`` query rows per KV head, against :func:`dense_partial`:
    every error of :func:`partial_errors` finite and at most ``tol``."""
    codec_k, codec_v = keys(), values()
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    k = mx.random.normal((b, h, t, 128), key=k1).astype(dtype)
    v = mx.random.normal((b, h, t, 128), key=k2).astype(dtype)
    q = mx.random.normal((b, h, m, 128), key=k3) * 0.3
    with kernels(False):
        for c in (codec_k, codec_v):
            c.check(128, dtype)
        kp, vp = codec_k.encode(k), codec_v.encode(v)
        mx.eval(kp.data, vp.data)
    with kernels(True):
        plan = mma_plan(codec_k, kp, codec_v, vp, q)
        got = fused_partial(q, Segment(codec_k, kp, codec_v, vp))
    if got is None:
        return False, {"error": "kernel declined (no kernel sides: the reference path)"}
    mx.eval(got)
    mma = plan is not None
    rounded = (mma and not plan["KFOLD"], mma and not plan["VFOLD"])
    sides = ((codec_k, mma and plan["KCB"]), (codec_v, mma and plan["VCB"]))
    tables = [c for c, on in sides if on]
    with fp16_levels(*tables):  # codebook levels as the tensor-core kernel holds them
        ref = dense_partial(q, codec_k, kp, codec_v, vp, fp16=rounded)
    errs = partial_errors(got, ref)
    sketch = sketch_mma_taken(codec_k, kp, codec_v, vp, q)
    errs["kernel"] = "tensor-core" if mma else "tensor-core sketch" if sketch else "portable"
    if mma:
        errs["folds"] = f"keys {plan['KFOLD']} values {plan['VFOLD']}"
        if tables:
            errs["codebook"] = f"keys {plan['KCB']} values {plan['VCB']} (fp16 levels)"
    errs["out_rel_vs_fp32"] = (
        partial_errors(got, dense_partial(q, codec_k, kp, codec_v, vp))["out_rel"]
        if any(rounded) or tables
        else errs["out_rel"]
    )
    nums = {k2: v2 for k2, v2 in errs.items() if k2 in ("out_rel", "m_excess", "l_rel", "o_rel")}
    ok = all(math.isfinite(v2) and v2 <= tol for v2 in nums.values())
    return ok, errs


def cache_check(make, t=5000, steps=3, tol=2e-3, dtype=mx.float16):
    """A cache (``make()``) filled chunk by chunk (its coded segment is a slice of a larger
    buffer), attended at decode steps with and without kernels (keys, values and queries in
    ``dtype``: a bfloat16 model's cache keeps bfloat16 scales): the worst step's relative
    error at most ``tol``."""
    k1, k2 = mx.random.split(mx.random.key(7), 2)
    k = mx.random.normal((2, 8, t + steps, 128), key=k1).astype(dtype)
    v = mx.random.normal((2, 8, t + steps, 128), key=k2).astype(dtype)
    with kernels(True):
        cache = make()
        for i in range(0, t, 1024):
            cache.update_and_fetch(k[:, :, i : min(t, i + 1024)], v[:, :, i : min(t, i + 1024)])
    worst = 0.0
    for s in range(steps):
        with kernels(True):
            cache.update_and_fetch(k[:, :, t + s : t + s + 1], v[:, :, t + s : t + s + 1])
        q = mx.random.normal((2, 32, 1, 128), key=mx.random.key(1000 + s)).astype(dtype)
        with kernels(True):
            got = cache.attend(q, 1 / math.sqrt(128)).astype(mx.float32)
        with kernels(False):
            ref = cache.attend(q, 1 / math.sqrt(128)).astype(mx.float32)
        worst = max(worst, (mx.max(mx.abs(got - ref)) / mx.max(mx.abs(ref))).item())
    return worst <= tol and math.isfinite(worst), {"out_rel": worst}


def encode_check(make, dtype=mx.float16, rows=(2, 8, 777)):
    """Codes (and scales/zeros or norms) of the fused encode of ``make()`` against the
    reference, bit for bit."""
    codec = make()
    x = mx.random.normal((*rows, 128), key=mx.random.key(3)) * 3.0
    x = mx.where(mx.arange(128) % 13 == 0, x * 10.0, x).astype(dtype)
    codec.check(128, dtype)
    with kernels(False):
        ref = codec.encode(x)
        mx.eval(ref.data)
    with kernels(True):
        got = codec.encode(x)
        mx.eval(got.data)
    return compare_records(ref, got)


def codebook_check(bits, rows=(2, 8, 777)):
    """TurboQuant_mse's fused search-and-pack against Codebook.encode + pack, on the same
    rotated vectors (the rotation is an MLX op either way)."""
    from velox_core.ops import pack
    from velox_turboquant import TurboQuant
    from velox_turboquant.encode import encode_codes

    codec = TurboQuant(bits)
    codec.check(128, mx.float16)
    quant = codec.parts[0][1]
    x = mx.random.normal((*rows, 128), key=mx.random.key(bits))
    y = quant.rotation.forward(x / mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True)))
    mx.eval(y)
    with kernels(True):
        got = encode_codes(quant, y)
    if got is None:
        return False, {"error": "kernel declined (encode_codes returned None)"}
    ref = pack(quant.codebook.encode(y), bits)
    diff = mx.sum(got != ref).item() if got.shape == ref.shape else -1
    return diff == 0, {"codes_mismatch": int(diff)}


def vq_encode_check(kw):
    """VecInfer's encode kernel against the reference (matmul distances, argmin, packing)
    on 8 x 8 heads x 4,096 tokens: indices may differ only where two codewords are equally
    near within rounding, so the check asks that no kernel index be farther than the
    reference's (exact float32 distances, relative 1e-5) and reports the differing share."""
    from velox_core.ops import unpack
    from velox_vecinfer import VecInfer

    x = mx.random.normal((8, 8, 4096, 128), key=mx.random.key(9)).astype(mx.float16)
    codec = VecInfer(**kw, iters=8)
    codec.fit(x[:, :, :512])
    with kernels(True):
        got = codec.encode(x).data["codes"]
    with kernels(False):
        ref = codec.encode(x).data["codes"]
    subs = 128 // codec.vector
    y = codec.transform(x).reshape(64, -1, codec.vector)
    book = codec.codebook.reshape(64, -1, codec.vector)

    def dist(words):
        idx = unpack(words, codec.index_bits, subs).reshape(64, -1).astype(mx.int32)
        c = mx.take_along_axis(book, idx[..., None], axis=1)
        return mx.sum((y - c) ** 2, axis=-1)

    dg, dr = dist(got), dist(ref)
    worse = mx.sum(dg > dr * (1 + 1e-5) + 1e-12).item()
    differ = mx.mean(
        (unpack(got, codec.index_bits, subs) != unpack(ref, codec.index_bits, subs)).astype(
            mx.float32
        )
    ).item()
    return worse == 0, {"farther": int(worse), "differing_share": differ}


def sketch_encode_check(make):
    """A sketch-coding encode kernel against the reference on 8 x 8 heads x 4,096 tokens:
    QJL's keys (sign-sketch matmuls, norms, packing; the outlier indices are the same MLX ops
    on both paths) or TurboQuant_prod's (Lloyd-Max codes, then the residual's sign sketch and
    norm). A sign bit may differ only where ``S x`` is within the reference matmul's rounding
    of 0 (TF32 on a GPU), so the check passes when at most 1e-3 of the bits differ, indices
    and codes are equal and the norms agree within float16 rounding, and reports each."""
    from velox_core.ops import unpack

    x = mx.random.normal((8, 8, 4096, 128), key=mx.random.key(11)).astype(mx.float16)
    codec = make()
    codec.check(128, mx.float16)
    with kernels(True):
        got = codec.encode(x).data
    with kernels(False):
        ref = codec.encode(x).data
    errs, ok = {}, True
    for key, r in ref.items():
        g = got[key]
        field = key.rsplit(".", 1)[-1]  # a fractional record's parts: "hi.signs", ...
        if g.shape != r.shape or g.dtype != r.dtype:
            errs[key] = f"shape/dtype {g.shape} {g.dtype} vs {r.shape} {r.dtype}"
            ok = False
        elif field in ("sign", "osign", "signs"):
            n = r.shape[-1] * 32
            share = mx.mean((unpack(g, 1, n) != unpack(r, 1, n)).astype(mx.float32)).item()
            errs[f"{key}_differing"] = share
            ok = ok and share <= 1e-3
        elif field in ("idx", "codes", "mask"):
            diff = mx.sum(g != r).item()
            errs[f"{key}_mismatch"] = int(diff)
            ok = ok and diff == 0
        else:
            gf, rf = g.astype(mx.float32), r.astype(mx.float32)
            rel = (mx.max(mx.abs(gf - rf)) / mx.max(mx.abs(rf))).item()
            errs[f"{key}_rel"] = rel
            ok = ok and rel <= 1e-3
    return ok, errs


def subnormal_mma_check():
    """The tensor-core kernel's folds put codes into fp16 MMAs as subnormals (code x 2^(o-24),
    the masked bits alone): the library's probe (one MMA of such codes times ones, against the
    exact row sums: ``velox_core.kernels.mma_support.run_subnormal_probe``) for three salts, and
    the verdict the launch plan takes (``mma_subnormals_exact``)."""
    from velox_core.kernels import mma as kmma
    from velox_core.kernels import mma_support as kmsup

    worst = max(kmsup.run_subnormal_probe(salt) for salt in (0, kmsup.SUBNORMAL_SALT, 11))
    return worst <= 1e-6 and kmma.mma_subnormals_exact(), {"max_rel": worst}


# =============================================================================================
# the cases
# =============================================================================================


@dataclasses.dataclass(frozen=True)
class Case:
    """One check: its name (the test's id), the check function and its arguments, the kernel
    settings in force while it runs (``KernelConfig`` fields), and whether it needs CUDA."""

    name: str
    check: Callable[..., tuple[bool, dict]]
    kwargs: dict = dataclasses.field(default_factory=dict)
    settings: dict = dataclasses.field(default_factory=dict)
    cuda_only: bool = False


def checks(quick: bool = False) -> list[Case]:
    """Every check in order (``quick``: the long contexts cut to about a thousand tokens)."""
    f16, bf16, f32 = mx.float16, mx.bfloat16, mx.float32
    t_big = 2000 if quick else 40_961
    t_cache = 1200 if quick else 5000
    t_long = 1200 if quick else 40_961
    t_tq = t_big // 2 + 1

    def u(*a, **k):
        return lazy("velox_core:Uniform", *a, **k)

    def tq(*a, **k):
        return lazy("velox_turboquant:TurboQuant", *a, **k)

    def decode(name, keys, values, shape, settings=None, **kw):
        """A decode check over K/V ``shape`` = (batch, KV heads, tokens, query rows a head)."""
        b, h, t, m = shape
        kw.update(keys=keys, values=values, b=b, h=h, t=t, m=m)
        return Case(name, decode_check, kw, settings or {})

    def cache(name, make, t, settings=None, **kw):
        return Case(name, cache_check, {"make": make, "t": t, **kw}, settings or {})

    folds_off = {"key_fold": False, "value_fold": False}  # both sides decoded per code
    out = [
        Case("fp16 MMA takes subnormal codes exactly (folds)", subnormal_mma_check, cuda_only=True)
    ]
    for bits in (2, 4, 8):
        out += [
            decode(
                f"uniform{bits} decode B1 H8 M4 T{t_big}",
                u(bits),
                u(bits),
                (1, 8, t_big, 4),
                seed=bits,
            ),
            decode(
                f"uniform{bits} decode B2 H8 M4 T1023 (odd)",
                u(bits),
                u(bits),
                (2, 8, 1023, 4),
                seed=10 + bits,
            ),
        ]
    out += [
        decode("uniform3 decode B2 H4 M4 T777 (2 row blocks)", u(3, 32), u(3, 32), (2, 4, 777, 4)),
        decode("uniform4 decode B1 H2 M1 T333 (MHA)", u(4), u(4), (1, 2, 333, 1)),
        # the tensor-core kernel with the value scales applied per code
        decode(
            f"uniform4 decode B1 H8 M4 T{t_big} (values unfolded)",
            u(4),
            u(4),
            (1, 8, t_big, 4),
            {"value_fold": False},
            seed=41,
        ),
        decode(
            f"uniform2 decode B1 H8 M4 T{t_big} (keys and values unfolded)",
            u(2),
            u(2),
            (1, 8, t_big, 4),
            folds_off,
            seed=42,
        ),
        # 2-bit values in groups of 32 (four a token, folded through bytes)
        decode("uniform2 decode g32 values, g128 keys", u(2, 128), u(2, 32), (1, 4, 3001, 4)),
        # 4-bit values in groups of 32: folded in 16-bit units only (ldmatrix)
        decode("uniform4 decode g32 values (unit fold)", u(4), u(4, 32), (1, 4, 3001, 4)),
        decode("uniform4 decode B2 H8 M8 T5000 (GQA 8)", u(4), u(4), (2, 8, 5000, 8)),
        decode("uniform4/2 decode M6 g32 (K4 V2 bits)", u(4, 32), u(2, 32), (1, 4, 3001, 6)),
        # KIVI's keys: per-channel scales for each group of 32 tokens
        decode(
            "uniform4 per-channel keys decode B2 H8 M4 T4096",
            u(4, 32, axis="channel"),
            u(4),
            (2, 8, 4096, 4),
        ),
        decode("uniform4 decode bf16 scales T4097", u(4), u(4), (2, 8, 4097, 4), dtype=bf16),
    ]
    for bits in (2, 3, 4):
        out.append(
            decode(
                f"turboquant{bits} decode B2 H8 M4 T{t_tq}",
                tq(bits),
                tq(bits, seed=1),
                (2, 8, t_tq, 4),
                seed=20 + bits,
            )
        )
    out.append(decode("turboquant4 decode B1 H8 M1 T999", tq(4), tq(4, seed=1), (1, 8, 999, 1)))
    for bits in (2, 4):  # prod keys: Lloyd-Max codes and the residual's QJL sketch
        out.append(
            decode(
                f"turboquant{bits} prod keys decode B2 H8 M4 T{t_tq}",
                tq(bits, "prod"),
                tq(bits, seed=1),
                (2, 8, t_tq, 4),
                seed=30 + bits,
            )
        )
    for label, kw, m, t in (  # QJL keys (sign sketches, outlier blocks), 2-bit values
        ("m 256, 8 outliers x 32 bits", {}, 4, t_big),
        ("m 320, 8 x 8 bits, blocks of 128 (straddling)", QJL_4BIT, 4, t_big),
        ("m 320, 8 x 8 bits, portable kernel", QJL_4BIT, 4, 5000),
        ("m 128, no outliers", {"bits": 1, "outliers": 0}, 4, 3001),
        ("m 256, GQA 8 (two row blocks)", {}, 8, 5000),
        ("m 256, 16 outliers x 16 bits, 1 row", {"outliers": 16, "outlier_bits": 16}, 1, 5000),
        ("m 384, m_o 128 (own columns), 4-bit values", {"bits": 3, "outlier_bits": 16}, 4, 5000),
        ("m 224, m_o 32 (64- and 32-bit parts)", {"sketch": 224, "outlier_bits": 4}, 4, 5000),
    ):
        values = u(4 if "4-bit values" in label else 2, 32)
        portable = {"mma": False} if "portable" in label else None
        out.append(
            decode(
                f"qjl decode {label}",
                lazy("velox_qjl:QJL", **kw),
                values,
                (1, 8, t // 128 * 128, m),
                portable,
                seed=50 + m,
            )
        )
    out += [
        cache("QJLCache (window 128, 4 sinks)", lazy("velox_qjl:QJLCache", sinks=4), t_cache),
        # bf16 norms, scales and zeros, bf16 outputs (the bf16 rows' bound)
        cache(
            "QJLCache bf16 (window 128)", lazy("velox_qjl:QJLCache"), t_cache, tol=1e-2, dtype=bf16
        ),
    ]
    plain = {"smooth": False, "hadamard": False}  # VecInfer's values: no transform
    for label, kkw, vkw, m in (  # VQ codes: codebooks in threadgroup memory, both sides
        ("2 bits (256 x 4) keys and values", {}, plain, 4),
        ("16 x 2 keys, 256 x 2 values", {"vector": 2}, {"bits": 4, "vector": 2, **plain}, 4),
        ("2 bits, GQA 8 (two row blocks)", {}, plain, 8),
        ("2 bits, transformed values", {}, {}, 4),
    ):
        keys = lazy("velox_vecinfer:VecInfer", **kkw, iters=8)
        values = lazy("velox_vecinfer:VecInfer", **vkw, iters=8)
        out.append(decode(f"vecinfer decode {label}", keys, values, (2, 8, 3001, m), seed=60 + m))
    for name, kw in (
        ("VecInferCache (window 128, 4 sinks)", {"window": 128, "sinks": 4}),
        ("VecInferCache (no fp16 segments)", {}),
    ):
        out.append(cache(name, lazy("velox_vecinfer:VecInferCache", iters=8, **kw), t_cache))
    uc = "velox_core:UniformCache"
    out.append(
        cache(
            "UniformCache 4-bit window+sinks (buffer slice)",
            lazy(uc, bits=4, window=32, sinks=4),
            t_cache,
        )
    )
    # a bfloat16 model's cache: bfloat16 scales and zeros into the tensor-core kernel (KSBF,
    # VSBF), a bfloat16 query and output (tolerance: bfloat16's 2^-9 rounding of the outputs)
    for bits, t, kw in ((4, 5000, {"window": 32, "sinks": 4}), (2, 40_961, {})):
        t = 1200 if quick else t
        name = f"UniformCache {bits}-bit bf16 T{t}" + (" window+sinks" if kw else "")
        out.append(cache(name, lazy(uc, bits=bits, **kw), t, tol=1e-2, dtype=bf16))
    out += [
        decode(
            f"uniform4 decode B1 H8 M4 T{t_big} bf16 scales",
            u(4),
            u(4),
            (1, 8, t_big, 4),
            dtype=bf16,
            seed=70,
        ),
        # bf16 scales decoded to fp16 pairs
        decode(
            "uniform2 decode B2 H8 M4 T3001 bf16 scales (keys and values unfolded)",
            u(2),
            u(2),
            (2, 8, 3001, 4),
            folds_off,
            dtype=bf16,
            seed=71,
        ),
    ]
    # no fp16 segments: the kernel merges its splits (by default up to 16k tokens), or a
    # second launch does (past them)
    for bits, t, fuse in ((4, 5000, None), (2, 40_961, True), (2, 40_961, False)):
        t = 1200 if quick else t
        merged = fuse is True or (fuse is None and t <= 16384)
        how = "splits merged in the kernel" if merged else "separate merge"
        settings = None if fuse is None else {"fuse": fuse}
        out.append(cache(f"UniformCache {bits}-bit T{t}, {how}", lazy(uc, bits=bits), t, settings))
    # 3 bits: the portable kernel; 4 bits (and 2, below): the tensor-core kernel with the
    # symmetric levels' lookups, against the reference path's float32 levels
    tqc = "velox_turboquant:TurboQuantCache"
    for name, kw in (
        ("TurboQuantCache 3-bit (buffer slice)", {"bits": 3, "window": 16}),
        (
            "TurboQuantCache 3-bit prod keys (buffer slice)",
            {"bits": 3, "key_variant": "prod", "window": 16, "sinks": 4},
        ),
        ("TurboQuantCache 4-bit window+sinks", {"bits": 4, "window": 32, "sinks": 4}),
    ):
        out.append(cache(name, lazy(tqc, **kw), t_cache))
    out.append(cache("TurboQuantCache 2-bit bf16", lazy(tqc, bits=2), t_long, tol=1e-2, dtype=bf16))
    # fractional widths: the outlier kernel (channels split per group of 64 tokens)
    t_out = 1280 if quick else 20_480
    for kb, vb, dtype, m in ((3.5, 3.5, f16, 4), (2.5, 4, bf16, 4), (3.25, 3.25, f16, 8)):
        dname = str(dtype).replace("mlx.core.", "")
        name = f"turboquant{kb}/{vb} decode B2 H8 M{m} T{t_out} {dname} (outlier kernel)"
        out.append(decode(name, tq(kb), tq(vb, seed=1), (2, 8, t_out, m), dtype=dtype, seed=83))
    out += [
        cache(
            "TurboQuantCache 3.5-bit window+sinks (outlier kernel)",
            lazy(tqc, bits=3.5, window=32, sinks=4),
            t_cache,
        ),
        cache(
            "TurboQuantCache 2.5-bit bf16 (outlier kernel)",
            lazy(tqc, bits=2.5),
            t_long,
            tol=1e-2,
            dtype=bf16,
        ),
    ]
    for bits in (2, 3, 4, 5, 8):
        out.append(Case(f"uniform{bits} encode fp16 (bit exact)", encode_check, {"make": u(bits)}))
    out += [
        Case(
            "uniform4 encode bf16 clip 0.9 (bit exact)",
            encode_check,
            {"make": u(4, clip=0.9), "dtype": bf16},
        ),
        Case(
            "uniform8 encode fp32 g32 (bit exact)", encode_check, {"make": u(8, 32), "dtype": f32}
        ),
    ]
    for bits in (2, 3, 4):
        out.append(Case(f"turboquant{bits} encode (bit exact)", codebook_check, {"bits": bits}))
    for kw in ({}, {"bits": 3, "vector": 2}):
        out.append(Case(f"vecinfer encode {kw or 'bits 2, vector 4'}", vq_encode_check, {"kw": kw}))
    for label, kw in (
        ("m 256, 8 outliers", {}),
        ("m 320 (recommended)", QJL_4BIT),
        ("no outliers", {"outliers": 0}),
    ):
        make = lazy("velox_qjl:QJL", **kw)
        out.append(Case(f"qjl encode {label}", sketch_encode_check, {"make": make}))
    for bits in (1, 3, 3.5):
        make = tq(bits, "prod")
        out.append(Case(f"turboquant{bits} prod encode", sketch_encode_check, {"make": make}))
    return out


def run_check(case: Case) -> tuple[bool, dict]:
    """``case``'s check with its settings in force; fails where the kernels are not active
    (both arms would run the reference, and the check would prove nothing)."""
    with configured(**case.settings):
        with kernels(True):
            active = use_kernels()
        if not active:
            return False, {"error": f"kernels not active on backend {backend()!r}"}
        return case.check(**case.kwargs)


def detail(errs: dict) -> str:
    """A check's errors on one line."""
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in errs.items())


# =============================================================================================
# the tests
# =============================================================================================

CHECKS = checks()


def _kernel_test(check, needs=needs_gpu):
    """A test of every case of ``check`` in :data:`CHECKS` (the case's name its id): each
    passes (:func:`run_check`); skipped where ``needs`` says this backend cannot run it."""

    cases = [pytest.param(c, id=c.name) for c in CHECKS if c.check is check]

    @needs
    @pytest.mark.parametrize("case", cases)
    def test(case: Case) -> None:
        ok, errs = run_check(case)
        assert ok, f"{case.name}: {detail(errs)}"

    return test


test_fp16_mma_takes_subnormal_codes_exactly = _kernel_test(subnormal_mma_check, needs_cuda)
test_decode_kernel_matches_the_decoded_reference = _kernel_test(decode_check)
test_cache_attention_with_kernels_matches_kernels_off = _kernel_test(cache_check)
test_affine_encode_kernel_is_bit_exact = _kernel_test(encode_check)
test_codebook_encode_kernel_is_bit_exact = _kernel_test(codebook_check)
test_vq_encode_kernel_picks_no_farther_codeword = _kernel_test(vq_encode_check)
test_sketch_encode_kernel_matches_the_reference = _kernel_test(sketch_encode_check)


def main(argv: list[str] | None = None) -> int:
    """Run every check without pytest; print one line per check with its errors, return 1 on
    any failure (0 where MLX runs on the CPU: nothing to check)."""
    parser = argparse.ArgumentParser(description="The GPU kernel checks, without pytest.")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--json", type=Path, help="write each check's row (name, status, errors)")
    args = parser.parse_args(argv)
    if backend() == "cpu":
        print("MLX runs on the CPU here: nothing to check")
        return 0
    rows = []
    for case in checks(args.quick):
        if case.cuda_only and backend() != "cuda":
            continue
        try:
            ok, errs = run_check(case)
        except Exception as exc:  # report every check
            ok, errs = False, {"error": repr(exc), "traceback": traceback.format_exc()}
        status = "PASS" if ok else "FAIL"
        shown = {k: v for k, v in errs.items() if k != "traceback"}
        print(f"  {status}  {case.name:44s} {detail(shown)}", flush=True)
        if "traceback" in errs:
            print(errs["traceback"], flush=True)
        rows.append({"name": case.name, "status": status, **errs})
    failed = [r["name"] for r in rows if r["status"] != "PASS"]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed" + (f"; FAIL: {failed}" if failed else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"checks": rows}, indent=1, default=str))
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
