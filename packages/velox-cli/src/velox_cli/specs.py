"""Method specs for the CLI: velox methods, plus the baselines ``fp16``, ``mlx-q4``, ``mlx-q8``.

A spec is ``name`` or ``name:key=value,...``. Baselines are mlx-lm's own caches: ``fp16`` is
``KVCache``, ``mlx-qB`` is ``QuantizedKVCache(group_size=64, bits=B)`` (``group`` may be
overridden, e.g. ``mlx-q4:group=32``). A composed spec ``A+B`` keeps tokens as method ``A``
does (its retention policy, sinks and window) and stores them with method ``B``'s codecs, e.g.
``qfilters:budget=1024+turboquant:bits=3``. A path ending in ``.json`` names a per-layer
allocation (``velox allocate --json``, :mod:`velox_cli.allocation`): a spec per layer, each
any of the above but another allocation, built with :func:`velox_core.make_cache`'s
``layers``.

On a CPU the model computes in float32 (MLX's float16 matrix products are slow there) while
every cache *stores* float16, as it would on a GPU: velox caches through their storage dtype,
the baselines through the two thin subclasses below, so bytes are those of a float16 cache.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from velox_core import VeloxCache, get_method, make, make_cache, methods, parse_spec
from velox_core.registry import method_params

__all__ = [
    "ALLOCATION",
    "BASELINES",
    "ComposedCache",
    "Spec",
    "StoredKVCache",
    "StoredQuantizedKVCache",
    "build_caches",
    "default_specs",
    "parse",
    "plain_caches",
    "quick_specs",
]

BASELINES = ("fp16", "mlx-q4", "mlx-q8")
ALLOCATION = "allocation"  # the name of a Spec read from a per-layer allocation file


class _Stored:
    """Deep copies (batch_generate's, the long-context suite's) share the storage dtype:
    an ``mx.Dtype`` cannot be pickled, so the default deep copy fails on it."""

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = v if isinstance(v, mx.Dtype) else copy.deepcopy(v, memo)
        return new


class StoredKVCache(_Stored, KVCache):
    """mlx-lm's KVCache keeping its tokens in ``store`` dtype, returning the model's dtype."""

    def __init__(self, store: mx.Dtype = mx.float16):
        super().__init__()
        self.store = store

    def update_and_fetch(self, keys, values):
        dt = keys.dtype
        k, v = super().update_and_fetch(keys.astype(self.store), values.astype(self.store))
        return k.astype(dt), v.astype(dt)


class StoredQuantizedKVCache(_Stored, QuantizedKVCache):
    """mlx-lm's QuantizedKVCache quantizing ``store``-dtype tokens (so scales are float16)."""

    def __init__(self, group_size: int = 64, bits: int = 4, store: mx.Dtype = mx.float16):
        super().__init__(group_size=group_size, bits=bits)
        self.store = store

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(keys.astype(self.store), values.astype(self.store))


@dataclass
class Spec:
    """A parsed spec: a baseline or an installed method with its parameters."""

    text: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def baseline(self) -> bool:
        return self.name in BASELINES

    @property
    def label(self) -> str:
        return self.text


class ComposedCache(VeloxCache):
    """The cache of a composed spec: a :class:`VeloxCache` of A's policy, sinks and window and
    B's codecs, which refuses a split model wherever A or B would (their classes' answers)."""

    parts: tuple = ()  # ((cache class, config) of A, of B)

    def split_refusal(self, config: dict, by_heads: bool, pipelined: bool) -> str:
        """The first of A's and B's reasons (velox_core.split asks the cache, not its class:
        this instance method answers for the parts)."""
        for cls, cfg in self.parts:
            reason = cls.split_refusal(cfg, by_heads, pipelined)
            if reason:
                return reason
        return ""

    def fresh(self) -> ComposedCache:
        out = super().fresh()
        out.parts = self.parts
        return out


def split_specs(text: str) -> list[str]:
    """The specs of one comma-separated string whose specs may carry comma-separated
    parameters of their own (a benchmark's ``--caches``): a piece whose text before its first
    ``=`` holds no ``:`` or ``+`` is a parameter of the spec before it.

    ``"fp16,kivi:bits=2,group=32,snapkv:kernel=15,budget=25%+uniform:bits=8"`` gives
    ``["fp16", "kivi:bits=2,group=32", "snapkv:kernel=15,budget=25%+uniform:bits=8"]``.
    """
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        head = piece.split("=", 1)[0]
        if "=" in piece and ":" not in head and "+" not in head:
            if not out or ":" not in out[-1]:
                raise ValueError(
                    f"{text!r}: parameter {piece!r} follows no spec with parameters "
                    "(specs are name or name:key=value,...; separated by commas)"
                )
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def compose(text: str) -> ComposedCache:
    """The cache of a composed spec ``A+B``: A's policy, sinks and window, B's codecs."""
    a_text, _, b_text = text.partition("+")
    a, b = make(a_text), make(b_text)
    if len(b.tiers) != 1:
        raise ValueError(f"{b_text!r}: only single-tier methods can lend their codecs")
    t = b.tiers[0]
    out = ComposedCache(
        key_codec=t.key_codec.fresh(),
        value_codec=t.value_codec.fresh(),
        policy=None if a.policy is None else a.policy.fresh(),
        sinks=a.sinks,
        window=a.window,
    )
    out.parts = ((type(a), a.config()), (type(b), b.config()))
    return out


def parse(text: str) -> Spec:
    """Parse and validate a spec: unknown methods and parameters raise ``ValueError``."""
    if text.endswith(".json"):
        return _allocation(text)
    if "+" in text:
        compose(text)
        return Spec(text, "+".join(parse_spec(t)[0] for t in text.split("+", 1)), {})
    name, params = parse_spec(text)
    if name in BASELINES:
        allowed = {"group"}
        bad = sorted(set(params) - allowed) if name != "fp16" else sorted(params)
        if bad:
            raise ValueError(f"baseline {name!r} takes no parameter {', '.join(map(repr, bad))}")
        if "group" in params and params["group"] not in (32, 64, 128):
            raise ValueError(f"{name}: group must be 32, 64 or 128, got {params['group']!r}")
        return Spec(text, name, params)
    get_method(name)  # unknown method -> ValueError listing the installed ones
    make(text)  # validates the parameters by building one cache
    return Spec(text, name, params)


def _allocation(path: str) -> Spec:
    """A per-layer allocation file as a spec: its ``default`` and ``layers`` specs, each
    checked as :func:`parse` checks a spec (``ValueError`` naming the layer)."""
    from .allocation import Allocation

    plan = Allocation.load(path)
    for where, text in [
        ("default", plan.default),
        *((f"layer {k}", v) for k, v in plan.layers.items()),
    ]:
        if text.endswith(".json"):
            raise ValueError(f"{path}: {where}: an allocation's specs cannot be allocations")
        try:
            parse(text)
        except ValueError as e:
            raise ValueError(f"{path}: {where}: {e}") from None
    layers = {str(k): v for k, v in sorted(plan.layers.items())}
    return Spec(path, ALLOCATION, {"default": plan.default, "layers": layers})


def default_specs() -> list[Spec]:
    """The baselines, then every installed method at its recommended settings."""
    out = [Spec(b, b) for b in BASELINES]
    for name, m in methods().items():
        for params in m.recommended:
            text = (
                name if not params else name + ":" + ",".join(f"{k}={v}" for k, v in params.items())
            )
            out.append(Spec(text, name, dict(params)))
    return out


# velox bench's default: fp16 and mlx-lm's 4-bit cache, then a few recommended specs that
# span the families (affine codes, KIVI, rotated Lloyd-Max and polar codes, eviction with
# codes) at about 3.5x to 8x: the eviction row is the long-context suite's 8x setting,
# SnapKV's votes with a 15-token kernel keeping a quarter of the default 2,048-token context
# in 8-bit codes; --all runs every installed method's recommended settings
QUICK = (
    "fp16",
    "mlx-q4",
    "uniform:bits=4",
    "kivi:bits=2,group=32,window=128",
    "turboquant:bits=3",
    "polarquant:bits=3",
    "snapkv:budget=512,kernel=15,bits=8",
)


def quick_specs() -> list[Spec]:
    """The quick subset (:data:`QUICK`) of the installed methods, in that order."""
    have = set(methods())
    out = []
    for text in QUICK:
        name = parse_spec(text)[0]
        if name in BASELINES or name in have:
            out.append(Spec(text, name, parse_spec(text)[1]))
    return out


def build_caches(spec: Spec, model: Any, store: mx.Dtype | None) -> list:
    """Fresh per-layer caches for ``spec`` (``store``: storage dtype, None = the model's)."""
    if spec.name == ALLOCATION:
        default = _layer(parse(spec.params["default"]), store)
        layers = {int(k): _layer(parse(v), store) for k, v in spec.params["layers"].items()}
        return make_cache(model, default, layers=layers, storage_dtype=store)
    return make_cache(model, _layer(spec, store), storage_dtype=store)


def _layer(spec: Spec, store: mx.Dtype | None) -> Any:
    """A spec as :func:`velox_core.make_cache` takes it: the baselines as mlx-lm's caches
    storing ``store`` (None: the model's dtype), a composition as its cache per layer."""
    if spec.name == "fp16":
        return None if store is None else (lambda i: StoredKVCache(store))
    if spec.name.startswith("mlx-q"):
        bits, group = int(spec.name[5:]), spec.params.get("group", 64)
        if store is None:
            return lambda i: QuantizedKVCache(group_size=group, bits=bits)
        return lambda i: StoredQuantizedKVCache(group, bits, store)
    if "+" in spec.text:
        return lambda i: compose(spec.text)
    return spec.text


def describe_params(name: str) -> dict[str, Any]:
    """Parameters and defaults of an installed method (for ``velox methods``)."""
    return method_params(name)


def plain_caches(caches: list) -> list:
    """``caches`` with the baselines' float16-storing subclasses as mlx-lm's own classes,
    holding the same arrays (what ``velox_core.save_cache`` writes and mlx-lm reads)."""
    out = []
    for c in caches:
        if isinstance(c, StoredQuantizedKVCache):
            c = QuantizedKVCache.from_state(c.state)
        elif isinstance(c, StoredKVCache):
            c = KVCache.from_state(c.state)
        out.append(c)
    return out
