"""The suite's operating points: the specs ``velox eval`` runs when none are given.

Every installed method at two compression points, about 4x and about 8x fewer held bytes
than fp16, and compositions (eviction x quantization) that reach 8x-16x; the ratio each
reaches is measured on every prompt (``vs fp16`` in the table), never assumed. A budget is
a share of each prompt (``budget=25%``), so eviction compresses the same at every length.
Methods whose package is not installed are left out; ``velox eval --methods`` runs any
other spec. Channel group sizes are set for head dim 128 and above; on a model whose head
dim they do not divide (SmolLM2's 64) they are cut to the largest divisor (``fit_groups``).
"""

from __future__ import annotations

import math
import re

from velox_core import methods

__all__ = ["BASELINES", "CUDA_LEFT_OUT", "POINTS", "default_specs", "fit_groups"]

BASELINES = ("fp16", "mlx-q8", "mlx-q4")

# point -> method name -> specs (a composition is listed under its first method)
POINTS: dict[str, dict[str, tuple[str, ...]]] = {
    "4x": {
        "uniform": ("uniform:bits=4",),
        "kivi": ("kivi:bits=4,group=64,window=0",),
        "kitty": ("kitty",),
        "zipcache": ("zipcache",),
        "gear": ("gear:bits=2,rank=2,outliers=0.01",),
        "kvsink": ("kvsink:bits=2,group=32,window=128",),
        "kvarn": ("kvarn:key_bits=4,value_bits=2",),
        "xquant": ("xquant:bits=4,group=128,window=0,share_from=None",),
        "nsnquant": ("nsnquant:bits=4",),
        "oscar": ("oscar:bits=4",),
        "spectral": ("spectral",),
        "turboquant": ("turboquant:bits=4", "turboquant:bits=3.5"),
        "polarquant": ("polarquant",),
        "qjl": ("qjl:sketch=320,outlier_bits=8,group=128,value_bits=2,window=384",),
        "skvq": ("skvq:bits=4,key_group=64,value_group=128,window=0,sinks=0",),
        "kvquant": ("kvquant:bits=4",),
        "vecinfer": ("vecinfer:bits=4,vector=2,window=32",),
        "rabitq": ("rabitq:bits=4",),
        "svdq": ("svdq:schedule=8-8-4-4-2-2-1-1,center=True",),
        "agetiered": ("agetiered:recent_bits=8,middle_bits=6,old_bits=3,recent=64,middle=1216",),
        "commvq": ("commvq:key_bits=2,value_bits=4",),
        "palu": ("palu:ratio=0.5,bits=4",),
        "xkv": ("xkv:layer_group=2,key_rank=192,value_rank=256",),
        "minicache": ("minicache:t=0.5,gamma=0.05",),
        "streamingllm": ("streamingllm:budget=25%",),
        "snapkv": ("snapkv:budget=25%",),
        "pyramidkv": ("pyramidkv:budget=25%",),
        "squeeze": ("squeeze:budget=25%,every=None",),
        "rocketkv": ("rocketkv:budget=25%",),
        "chunkkv": ("chunkkv:budget=25%",),
        "tova": ("tova:budget=25%",),
        "h2o": ("h2o:budget=25%",),
        "keyformer": ("keyformer:budget=25%",),
        "morphkv": ("morphkv:budget=25%",),
        "cam": ("cam:budget=25%",),
        "kvzip": ("kvzip:budget=25%",),
        "knorm": ("knorm:budget=25%",),
        "curdkv": ("curdkv:budget=25%",),
        "expected-attention": ("expected-attention:budget=25%",),
        "qfilters": ("qfilters:budget=25%",),
        "nestedkv": ("nestedkv:budget=25%",),
        "adakv": ("adakv:budget=25%",),
        "anchorkv": ("anchorkv:theta=0.25",),
    },
    "8x": {
        "uniform": ("uniform:bits=2",),
        "kivi": ("kivi:bits=2,group=32,window=128",),
        "kvarn": ("kvarn:bits=2,sinks=0",),
        "xquant": ("xquant:window=0", "xquant:bits=1,window=0,share_from=None"),
        "nsnquant": ("nsnquant:bits=2",),
        "oscar": ("oscar:bits=2",),
        "spectral": ("spectral:signal_bits=3,noise_bits=1,variance=0.9",),
        "turboquant": ("turboquant:bits=2", "turboquant:bits=2.5"),
        "polarquant": ("polarquant:bits=3,levels=6",),
        "qjl": ("qjl:key_bits=1,value_bits=2,outlier_bits=8,group=64,window=0",),
        "skvq": ("skvq:bits=2,key_group=64,value_group=128,window=128,sinks=5",),
        "kvquant": ("kvquant:bits=2",),
        "vecinfer": ("vecinfer:bits=2",),
        "rabitq": ("rabitq:bits=2",),
        "svdq": ("svdq:schedule=8-4-2-1-1-0-0-0",),
        "agetiered": ("agetiered:recent_bits=8,middle_bits=4,old_bits=2,recent=64,middle=128",),
        "streamingllm": ("streamingllm:budget=12.5%",),
        "snapkv": (
            "snapkv:budget=12.5%",
            "snapkv:budget=50%+uniform:bits=4",
            "snapkv:budget=50%+turboquant:bits=4",
        ),
        "pyramidkv": ("pyramidkv:budget=12.5%",),
        "squeeze": ("squeeze:budget=12.5%,every=None",),
        "rocketkv": ("rocketkv:budget=12.5%",),
        "chunkkv": ("chunkkv:budget=12.5%",),
        "tova": ("tova:budget=12.5%",),
        "h2o": ("h2o:budget=12.5%",),
        "keyformer": ("keyformer:budget=12.5%",),
        "morphkv": ("morphkv:budget=12.5%",),
        "cam": ("cam:budget=12.5%",),
        "kvzip": ("kvzip:budget=12.5%",),
        "knorm": ("knorm:budget=12.5%",),
        "curdkv": ("curdkv:budget=12.5%",),
        "expected-attention": ("expected-attention:budget=12.5%",),
        "qfilters": ("qfilters:budget=12.5%",),
        "nestedkv": ("nestedkv:budget=12.5%",),
        "adakv": ("adakv:budget=12.5%",),
        "anchorkv": ("anchorkv:theta=0.125",),
    },
    "16x": {
        "snapkv": ("snapkv:budget=25%+uniform:bits=4", "snapkv:budget=50%+uniform:bits=2"),
        "streamingllm": ("streamingllm:budget=25%+uniform:bits=4",),
    },
}


# mlx-lm's QuantizedKVCache on MLX's CUDA backend (MLX 0.32.4): its quantized attention over
# a prefill chunk (512 queries over 4,096 keys of head dim 256) did not finish in over a
# minute on an H100, where one decode step takes 0.2-0.5 ms; velox eval's default grid leaves
# mlx-q8 / mlx-q4 out there (named in --methods they run)
CUDA_LEFT_OUT = ("mlx-q8", "mlx-q4")


def default_specs(
    points: list[str], head_dim: int | None = None, backend: str | None = None
) -> list[str]:
    """The baselines, then each installed method's specs at ``points`` (in that order),
    their channel groups fitted to ``head_dim`` where given (:func:`fit_groups`). On the
    ``"cuda"`` backend the baselines are fp16 alone (:data:`CUDA_LEFT_OUT`)."""
    bad = [p for p in points if p not in POINTS]
    if bad:
        raise ValueError(f"unknown operating point {bad[0]!r}; points: {', '.join(POINTS)}")
    have = set(methods())
    out = [b for b in BASELINES if backend != "cuda" or b not in CUDA_LEFT_OUT]
    for p in points:
        for name, specs in POINTS[p].items():
            if name in have:
                out += [s for s in specs if all(m.split(":")[0] in have for m in s.split("+"))]
    return out if head_dim is None else [fit_groups(s, head_dim) for s in out]


_GROUP = re.compile(r"(?<![\w])((?:key_|value_)?group)=(\d+)")


def fit_groups(spec: str, head_dim: int) -> str:
    """``spec`` with each channel group (``group``, ``key_group``, ``value_group``; not
    xKV's ``layer_group``) that does not divide ``head_dim`` cut to its greatest common
    divisor with it: ``qjl:group=128`` becomes ``qjl:group=64`` at head dim 64."""

    def cut(m: re.Match) -> str:
        g = int(m.group(2))
        return f"{m.group(1)}={g if head_dim % g == 0 else math.gcd(g, head_dim)}"

    return _GROUP.sub(cut, spec)
