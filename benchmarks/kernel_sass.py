"""The tensor-core decode kernel's machine code, without a GPU: registers and its loop's
instructions by opcode.

Builds ``metal/decode_attention_mma.cu`` for one shape as the library plans it
(``mma_launch``: the launch settings are the environment's ``VELOX_DECODE_*``, as for a call;
without a CUDA device the folds follow their settings), writes the full source MLX would hand
NVRTC, compiles it with ``nvcc -cubin`` (the register count and spills from ``ptxas -v``),
disassembles it with ``cuobjdump -sass`` and counts the instructions of the main loop: the
code from the target of the first backward branch after the last ``HMMA`` to that branch, cold
paths (the copies that are not bulk copies, the rescale) included. A per-step instruction
count is the measure the kernel's changes are made against (docs/performance.md).

Needs ``nvcc`` (CUDA 12 or later) and ``cuobjdump`` on the PATH or given; no GPU::

    python3 benchmarks/kernel_sass.py --bits 2 --subtiles 4
    VELOX_DECODE_LDSM=0 python3 benchmarks/kernel_sass.py --bits 2
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from velox_core.kernels import mma as kmma
from velox_core.kernels import records as krec
from velox_core.kernels.build import ArgInfo, cuda_source
from velox_testing.emulate import shim_dir

_INSN = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)\s*$")


def parse_sass(text: str) -> list[tuple[int, str]]:
    """(address, instruction) pairs of a ``cuobjdump -sass`` listing."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSN.match, text.splitlines()) if m]


def opcode(insn: str) -> str:
    """An instruction's opcode without its predicate and modifiers (``@!P1 LDS.64 ...``:
    ``LDS``)."""
    body = re.sub(r"^@!?U?P\w+\s+", "", insn)
    return body.split()[0].split(".")[0]


def main_loop(insns: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The instructions of the loop that holds the last ``HMMA``: from the target of the first
    backward branch after it to that branch."""
    last = max((i for i, (_, s) in enumerate(insns) if opcode(s) == "HMMA"), default=None)
    if last is None:
        raise ValueError("no HMMA in the listing: not the tensor-core kernel")
    for i in range(last, len(insns)):
        addr, s = insns[i]
        m = _BRANCH.search(s)
        if m and int(m.group(1), 16) < addr:
            top = int(m.group(1), 16)
            start = next(j for j, (a, _) in enumerate(insns) if a == top)
            return insns[start : i + 1]
    raise ValueError("no backward branch after the last HMMA")


def build(args) -> tuple[str, list[tuple[str, object]]]:
    """The full CUDA source of the planned kernel, and its template."""

    def codes(bits: int, group: int) -> krec.CodeRecord:  # 16 tokens of zeros: only shapes matter
        words = mx.zeros((1, 1, 16, args.dim * bits // 32), mx.uint32)
        if group <= 0:  # codebook codes (TurboQuant_mse): one norm a token, 2**bits levels
            lev = mx.zeros((1 << bits,), mx.float32)
            norm = mx.zeros((1, 1, 16), mx.float16)
            sym = group < 0  # symmetric levels (Lloyd-Max's): half-table lookups at 4 bits
            return krec.CodebookCodes(
                bits=bits, dim=args.dim, codes=words, norm=norm, levels=lev, symmetric=sym
            )
        z = mx.zeros((1, 1, 16, args.dim // group), mx.float16)
        return krec.AffineCodes(bits=bits, group=group, codes=words, scale=z, zero=z)

    keys, values = codes(args.kbits, args.kgroup), codes(args.vbits, args.vgroup)
    if not kmma.mma_supported(args.rows, args.dim, keys, values):
        raise SystemExit("the tensor-core kernel does not take this shape (mma_supported)")
    qd = getattr(mx, args.query)
    out = None if args.merge == "separate" else qd
    launch = kmma.mma_launch((1, 1, args.rows, args.dim), qd, keys, values, out_dtype=out)
    if launch is None:
        raise SystemExit("no ring fits in shared memory for this shape")
    spec, tmpl = launch.spec, launch.template
    big = 1 << 20
    infos = [ArgInfo(args.query, 4, big)]
    infos += [ArgInfo("uint32", 4, big), ArgInfo("float16", 4, big), ArgInfo("float16", 4, big)]
    infos += infos[1:]
    infos += [ArgInfo("float32", 1, 16)] * 2  # the levels (codebook sides; else dummies)
    outs = ["float32"] * len(spec.outputs)  # without the merge: the partials' two outputs
    return cuda_source(spec, infos, outs, list(tmpl))[0], list(tmpl)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bits", type=int, default=4, help="key and value bits (2, 4 or 8)")
    p.add_argument("--kbits", type=int, default=None)
    p.add_argument("--vbits", type=int, default=None)
    p.add_argument(
        "--kgroup",
        type=int,
        default=64,
        help="0: codebook keys (TurboQuant_mse), -1: symmetric levels",
    )
    p.add_argument(
        "--vgroup", type=int, default=64, help="0: codebook values, -1: symmetric levels"
    )
    p.add_argument("--rows", type=int, default=4, help="query rows per KV head")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--query", default="float16", choices=("float16", "float32", "bfloat16"))
    p.add_argument("--merge", default="kernel", choices=("kernel", "separate"))
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--nvcc", default=shutil.which("nvcc"))
    p.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    p.add_argument("--top", type=int, default=24, help="opcodes to list")
    args = p.parse_args()
    args.kbits = args.kbits or args.bits
    args.vbits = args.vbits or args.bits
    if not args.nvcc or not args.cuobjdump:
        print("kernel_sass.py needs nvcc and cuobjdump (on the PATH, or --nvcc / --cuobjdump)")
        return 2
    src, tmpl = build(args)
    t = dict(tmpl)
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        cu.write_text(src)
        cmd = [args.nvcc, "-std=c++17", f"-arch={args.arch}", "-Xptxas", "-v"]
        cmd += ["-I", str(shim_dir() / "cuda"), "-cubin", str(cu), "-o", str(cubin)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            print(res.stderr[-4000:])
            return 1
        regs = [ln.strip() for ln in res.stderr.splitlines() if "registers" in ln or "spill" in ln]
        sass = subprocess.run(
            [args.cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    loop = main_loop(parse_sass(sass))
    counts = collections.Counter(opcode(s) for _, s in loop)
    keys = ("NSUB", "NSTAGE", "NWARPS", "KFOLD", "VFOLD", "LDSM", "PIPE", "FUSE", "QLO")
    keys += ("KCB", "VCB")
    print("template:", ", ".join(f"{k}={t[k]}" for k in keys))
    print("\n".join(regs[-2:]))
    print(f"main loop: {len(loop)} instructions, one step of {16 * t['NSUB']} tokens a warp")
    print("  " + ", ".join(f"{k} {v}" for k, v in counts.most_common(args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
