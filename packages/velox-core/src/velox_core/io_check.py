"""Field-by-field checks of a saved cache file's layer headers against its arrays.

The checksum of :mod:`velox_core.io` proves a file is the one its writer signed, not that the
writer was :func:`~velox_core.io.save_cache`: a file crafted with its checksum recomputed must
still be refused where its header contradicts its arrays. :func:`check_velox_layer`,
:func:`check_mlx_layer` and :func:`check_layout` raise a ``ValueError`` naming the layer and
the field, before a cache is built from the header (so no size in a header, such as a count of
per-head stores, makes a load allocate or loop past what the file holds) and, for the coded
segments, once it is built (the codec's own record layout: fields, dtypes, widths).
"""

from __future__ import annotations

import json
import re
from typing import Any

import mlx.core as mx

__all__: list[str] = []  # velox_core.io uses them; none is public

MAX_OFFSET = 2**31 - 1  # positions are int32
_FLOAT_NAMES = ("float16", "bfloat16", "float32")
_STORE = re.compile(r"[a-z_]+\d*(\.[a-z_]+)?")  # sink.k, tier0.v, pos, head3.pos, a method's own


def _int(where: str, field: str, v: Any, lo: int = 0, hi: int = MAX_OFFSET) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}: {field} must be a whole number, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{where}: {field} = {v} is outside [{lo}, {hi}]")
    return v


def _names(where: str, field: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v) or len(set(v)) < len(v):
        raise ValueError(f"{where}: {field} must be a list of distinct names, got {v!r}")
    return v


def check_finite_arrays(where: str, arrays: dict[str, mx.array]) -> None:
    """Refuse a NaN or an inf in any floating-point array (stored tokens, scales, norms,
    fitted codec and policy state): a cache holding one gives NaN attention."""
    floats = [(k, a) for k, a in arrays.items() if mx.issubdtype(a.dtype, mx.floating)]
    if not floats:
        return
    ok = mx.stack([mx.all(mx.isfinite(a)) for _, a in floats]).tolist()
    bad = [k for (k, _), good in zip(floats, ok, strict=True) if not good]
    if bad:
        raise ValueError(f"{where}: array {bad[0]} holds NaN or inf values")


def check_velox_layer(
    where: str, method: Any, meta: Any, arrays: dict[str, mx.array], state_version: int
) -> None:
    """Check a velox cache's header (``meta``, its ``method`` as the layer names it) against
    ``arrays``, the file's arrays of that cache by their names in the header."""
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: meta must be an object, got {type(meta).__name__}")
    if not isinstance(method, str):
        raise ValueError(f"{where}: method must be a name, got {method!r}")
    if meta.get("method") != method:
        raise ValueError(
            f"{where}: meta.method {meta.get('method')!r} differs from the layer's method "
            f"{method!r}"
        )
    if meta.get("version") != state_version:
        raise ValueError(
            f"{where}: meta.version must be {state_version}, got {meta.get('version')!r}"
        )
    if not isinstance(meta.get("config"), dict):
        raise ValueError(f"{where}: meta.config must be an object")
    offset = _int(where, "meta.offset", meta.get("offset"))
    dims = meta.get("dims")
    if dims is not None:
        if not isinstance(dims, list) or len(dims) != 4:
            raise ValueError(f"{where}: meta.dims must be [batch, kv_heads, key_dim, value_dim]")
        for name, d in zip(("batch", "kv_heads", "key_dim", "value_dim"), dims, strict=True):
            _int(where, f"meta.dims {name}", d, 1, 2**16)
    for field in ("dtype", "storage_dtype", "io_dtype"):
        v = meta.get(field)
        if v is not None and v not in _FLOAT_NAMES:
            raise ValueError(f"{where}: meta.{field} must be one of {_FLOAT_NAMES}, got {v!r}")
    ragged = meta.get("ragged")
    if ragged is not None:
        if dims is None:
            raise ValueError(f"{where}: meta.ragged is set but meta.dims is not")
        if dims[0] != 1:
            raise ValueError(f"{where}: meta.ragged needs batch 1, meta.dims has {dims[0]}")
        _int(where, "meta.ragged", ragged, dims[1], dims[1])  # one record per KV head
    stores = meta.get("stores")
    if not isinstance(stores, dict):
        raise ValueError(f"{where}: meta.stores must be an object")
    listed = _names(where, "meta.arrays", meta.get("arrays"))
    if set(listed) != set(arrays):
        raise ValueError(f"{where}: meta.arrays does not name the layer's arrays")
    own = arrays
    described = set()
    for name, info in stores.items():
        _check_store(where, name, info, own, dims, offset, ragged, meta.get("dtype"))
        described |= {f"store.{name}.{f}" for f in info["fields"]}
    stray = [n for n in listed if n.startswith("store.") and n not in described]
    if stray:
        raise ValueError(f"{where}: array {stray[0]!r} belongs to no store in meta.stores")
    for side in ("sink", "win"):
        a, b = stores.get(f"{side}.k"), stores.get(f"{side}.v")
        if (a is None) != (b is None) or (a and a["tokens"] != b["tokens"]):
            raise ValueError(f"{where}: meta.stores {side}.k and {side}.v hold different tokens")
    segments = re.compile(r"(sink|win|tier\d+)\.k")  # the token segments (not a method's own)
    held = sum(info["tokens"] for n, info in stores.items() if segments.fullmatch(n))
    if ragged is None and held > offset:
        raise ValueError(f"{where}: meta.stores hold {held} tokens, more than meta.offset {offset}")
    check_finite_arrays(where, own)


def layer_arrays(where: str, listed: Any, arrays: dict[str, mx.array], prefix: str) -> None:
    """The file's arrays under ``prefix`` must be exactly those ``listed`` (``meta.arrays``)."""
    listed = _names(where, "meta.arrays", listed)
    here = {k[len(prefix) :] for k in arrays if k.startswith(prefix)}
    missing = [n for n in listed if n not in here]
    if missing:
        raise ValueError(f"{where}: meta.arrays names {missing[0]!r}, which the file lacks")
    extra = sorted(here - set(listed))
    if extra:
        raise ValueError(f"{where}: array {extra[0]!r} is not listed in meta.arrays")


def _check_store(where, name, info, own, dims, offset, ragged, dtype) -> None:
    if not isinstance(name, str) or not _STORE.fullmatch(name):
        raise ValueError(f"{where}: meta.stores has an unknown store {name!r}")
    head = re.match(r"head(\d+)\.", name)
    if head and (ragged is None or int(head.group(1)) >= ragged):
        raise ValueError(f"{where}: store {name} needs meta.ragged above {head.group(1)}")
    at = f"meta.stores[{name!r}]"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: {at} must be an object")
    tokens = _int(where, f"{at}.tokens", info.get("tokens"))
    if tokens > offset:
        raise ValueError(f"{where}: {at}.tokens {tokens} is more than meta.offset {offset}")
    block = _int(where, f"{at}.block", info.get("block"), 1, 2**16)
    if tokens % block:
        raise ValueError(f"{where}: {at}.tokens {tokens} is not a multiple of its block {block}")
    fields = _names(where, f"{at}.fields", info.get("fields"))
    per_block = _names(where, f"{at}.per_block", info.get("per_block"))
    if not fields or not set(per_block) <= set(fields):
        raise ValueError(f"{where}: {at} needs fields, and per_block among them")
    heads = None if dims is None else (1 if head else dims[1])
    given = name.split(".")[0] in ("sink", "win") or name.endswith("pos")
    if given and block != 1:
        raise ValueError(f"{where}: {at}.block must be 1 (tokens kept as given), got {block}")
    full = False
    for f in fields:
        key = f"store.{name}.{f}"
        a = own.get(key)
        if a is None:
            raise ValueError(f"{where}: {at} names field {f!r}, whose array {key} is missing")
        rows = tokens // block if f in per_block else tokens
        if a.ndim < 3 or a.shape[2] != rows:
            raise ValueError(
                f"{where}: array {key} has shape {tuple(a.shape)}, {at} needs {rows} rows on axis 2"
            )
        # (a record may share an array over the batch or the heads, a length of 1 there, but
        # not every array of it)
        if dims is not None and (a.shape[0] not in (dims[0], 1) or a.shape[1] not in (heads, 1)):
            raise ValueError(
                f"{where}: array {key} has shape {tuple(a.shape)}, meta.dims needs batch "
                f"{dims[0]} and {heads} heads"
            )
        full = full or dims is None or (a.shape[0] == dims[0] and a.shape[1] == heads)
    standard = re.fullmatch(r"(sink|win|tier\d+|head\d+)\.(k|v)|pos|head\d+\.pos", name)
    if standard and not full:  # (a method's own stores may share theirs: xKV's latents)
        raise ValueError(
            f"{where}: no array of store {name} has meta.dims' batch {dims[0]} and {heads} heads"
        )
    if name.endswith("pos"):  # absolute positions of the kept tokens
        a = own[f"store.{name}.{fields[0]}"]
        if a.dtype != mx.int32 or (a.size and not bool(mx.all((a >= 0) & (a < offset)).item())):
            raise ValueError(
                f"{where}: store {name} must hold int32 positions below meta.offset {offset}"
            )
    elif name.split(".")[0] in ("sink", "win"):  # tokens as given: (B, H, T, D) in dtype
        a = own[f"store.{name}.{fields[0]}"]
        dim = None if dims is None else dims[2 if name.endswith(".k") else 3]
        if fields != ["x"] or a.ndim != 4 or (dim is not None and a.shape[3] != dim):
            raise ValueError(
                f"{where}: store {name} must hold one x array of (batch, heads, tokens, {dim}) "
                "as meta.dims says"
            )
        if dtype is None or str(a.dtype).split(".")[-1] != dtype:
            raise ValueError(f"{where}: store {name} holds {a.dtype}, meta.dtype is {dtype!r}")


def check_round_trip(where: str, cache: Any, meta: dict, arrays: dict[str, mx.array]) -> None:
    """The rebuilt cache must hold what the header describes: its own state lists the same
    stores (tokens, block, fields) and arrays (shapes, dtypes) at the same offset, so that
    nothing in the file is left unread (a store the method does not know) or read otherwise."""
    state = cache.state
    again = json.loads(state[0])
    mine = dict(zip(again["arrays"], state[1:]))
    for field in ("offset", "dims", "ragged", "policy_meta"):
        if json.loads(json.dumps(again.get(field))) != meta.get(field):  # as the file holds it
            raise ValueError(
                f"{where}: meta.{field} is not what method {meta['method']!r} reads back "
                f"(it holds {str(again.get(field))[:80]})"
            )
    if again.get("stores") != meta["stores"]:
        odd = sorted(set(meta["stores"]) ^ set(again.get("stores") or {}))
        odd = odd or [n for n in meta["stores"] if meta["stores"][n] != again["stores"][n]]
        raise ValueError(
            f"{where}: store {odd[0]!r} of meta.stores is not what method "
            f"{meta['method']!r} reads back"
        )
    for name, a in arrays.items():
        b = mine.get(name)
        if name.startswith("store.") and (
            b is None or b.dtype != a.dtype or tuple(b.shape) != tuple(a.shape)
        ):
            raise ValueError(f"{where}: array {name} is not read back as stored")


def check_layout(where: str, cache: Any, meta: dict, arrays: dict[str, mx.array]) -> None:
    """Compare each coded store's records with what the cache's own codec writes for one block
    of tokens of the recorded dims: the same fields, rows per block, dtypes and trailing shapes
    (a header that changes ``bits``, ``group`` or the method under arrays coded otherwise).
    ``arrays``: the layer's arrays by their names in the header."""
    dims, stores = meta.get("dims"), meta["stores"]
    if dims is None:
        return
    b, h, dk, dv = dims
    pairs = []
    for j, t in enumerate(cache.tiers):
        pairs += [(f"tier{j}.k", t.key_codec, dk, h), (f"tier{j}.v", t.value_codec, dv, h)]
    for j in range(meta.get("ragged") or 0):
        t = cache.tiers[0]
        pairs += [(f"head{j}.k", t.key_codec, dk, 1), (f"head{j}.v", t.value_codec, dv, 1)]
    dtype = getattr(mx, meta.get("dtype") or "float16")
    for name, codec, dim, heads in pairs:
        info = stores.get(name)
        if info is None:
            continue
        try:
            probe = codec.encode(
                mx.zeros((b, heads, codec.block, dim), dtype=dtype),
                mx.arange(codec.block, dtype=mx.int32),
            )
        except Exception as e:  # the codec cannot code this record's dims: the header lies
            raise ValueError(
                f"{where}: store {name}: the cache's codec {codec.describe()} cannot code the "
                f"recorded dims {dims} ({type(e).__name__}: {e})"
            ) from None
        if set(info["fields"]) != set(probe.data) or set(info["per_block"]) != set(probe.per_block):
            raise ValueError(
                f"{where}: store {name} has fields {sorted(info['fields'])}, the codec "
                f"{codec.describe()} writes {sorted(probe.data)}"
            )
        if info["block"] != probe.block:
            raise ValueError(
                f"{where}: store {name} has block {info['block']}, the codec "
                f"{codec.describe()} codes {probe.block} tokens together"
            )
        for f, want in probe.data.items():
            got = arrays[f"store.{name}.{f}"]
            if got.dtype != want.dtype or tuple(got.shape[3:]) != tuple(want.shape[3:]):
                raise ValueError(
                    f"{where}: store {name} field {f} is {got.dtype} {tuple(got.shape)}, the "
                    f"codec {codec.describe()} writes {want.dtype} (..., "
                    f"{', '.join(map(str, want.shape[3:]))}) (its parameters differ from the "
                    "arrays')"
                )


def check_mlx_layer(where: str, cls_name: str, state: list) -> None:
    """Check an mlx-lm cache's state (``KVCache``: keys, values, offset; ``RotatingKVCache``
    adds keep, max_size and the write index; ``QuantizedKVCache``: codes, scales and biases
    of each side, offset, group size and bits) before the class is built from it."""
    if cls_name == "QuantizedKVCache":
        if len(state) != 5 or not all(isinstance(s, tuple) and len(s) == 3 for s in state[:2]):
            raise ValueError(f"{where}: QuantizedKVCache state must be (keys, values) triples")
        offset, group, bits = state[2:]
        group = _int(where, "group_size", group, 1, 2**16)
        bits = _int(where, "bits", bits, 1, 8)
        if group not in (32, 64, 128) or bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"{where}: group_size {group} / bits {bits} are not mlx-lm's")
        sides = state[:2]
    else:
        n = 6 if cls_name == "RotatingKVCache" else 3
        if len(state) != n:
            raise ValueError(f"{where}: {cls_name} state must have {n} items, got {len(state)}")
        offset = state[2]
        sides = [(state[0],), (state[1],)]
    offset = _int(where, "offset", offset)
    if any(x is None for s in sides for x in s):
        if not all(x is None for s in sides for x in s) or offset:
            raise ValueError(f"{where}: an empty {cls_name} needs no arrays and offset 0")
        return
    arrays = [x for s in sides for x in s]
    if not all(isinstance(a, mx.array) and a.ndim == 4 for a in arrays):
        raise ValueError(f"{where}: {cls_name} arrays must be (batch, heads, tokens, dim)")
    lead = {tuple(a.shape[:3]) for a in arrays}
    if len(lead) != 1:
        raise ValueError(f"{where}: {cls_name} arrays differ in batch, heads or tokens: {lead}")
    tokens = arrays[0].shape[2]
    if cls_name == "QuantizedKVCache":
        for name, (w, s, z) in zip(("keys", "values"), sides, strict=True):
            if w.dtype != mx.uint32 or s.dtype != z.dtype or s.shape != z.shape:
                raise ValueError(f"{where}: {name} must be uint32 codes with like scales/biases")
            if w.shape[3] * 32 // bits != s.shape[3] * group:
                raise ValueError(
                    f"{where}: {name} codes of {w.shape[3]} words at {bits} bits do not fill "
                    f"{s.shape[3]} groups of {group}"
                )
    else:
        for a in arrays:
            if not mx.issubdtype(a.dtype, mx.floating):
                raise ValueError(f"{where}: {cls_name} arrays must be floating point")
    if cls_name == "RotatingKVCache":
        keep = _int(where, "keep", state[3])
        size = _int(where, "max_size", state[4], 1)
        idx = _int(where, "write index", state[5], 0, tokens)
        # a prefill chunk may leave more than max_size tokens until the next update trims
        if keep > size or offset < tokens:
            raise ValueError(
                f"{where}: RotatingKVCache keep {keep}, max_size {size}, {tokens} tokens, "
                f"offset {offset} and index {idx} disagree"
            )
    elif offset > tokens:  # (below is a trimmed cache: its slots past the offset are free)
        raise ValueError(f"{where}: offset {offset} is past the {tokens} tokens stored")
    check_finite_arrays(where, {f"item{i}": a for i, a in enumerate(arrays)})


def check_host_layer(where: str, cls_name: str, state: list) -> None:
    """Check a host's cache state (:attr:`velox_core.hosts.Host.saved_classes`: keys and
    values, maybe numbers) before the class is built from it: its arrays (batch, heads, tokens,
    dim), floating point, alike in batch, heads and tokens, finite; its numbers whole and not
    negative. The class's own counts are checked once it is built (``offset``, ``size()``)."""
    flat = [x for s in state for x in (s if isinstance(s, tuple) else (s,))]
    arrays = [x for x in flat if isinstance(x, mx.array)]
    for x in flat:
        if x is not None and not isinstance(x, mx.array):
            _int(where, f"{cls_name} state number", x)
    if not all(a.ndim == 4 and mx.issubdtype(a.dtype, mx.floating) for a in arrays):
        raise ValueError(f"{where}: {cls_name} arrays must be floating (batch, heads, tokens, dim)")
    lead = {tuple(a.shape[:3]) for a in arrays}
    if len(lead) > 1:
        raise ValueError(f"{where}: {cls_name} arrays differ in batch, heads or tokens: {lead}")
    check_finite_arrays(where, {f"item{i}": a for i, a in enumerate(arrays)})
