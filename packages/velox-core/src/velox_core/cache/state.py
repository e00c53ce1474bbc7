"""Bytes, state and copies of :class:`~velox_core.cache.VeloxCache`.

:class:`StateMixin` holds what measures and records a cache: its resident bytes (every
buffer, capacity included, and every fitted codec array), the mlx-lm ``state`` (a JSON meta
string then the arrays: every store's record, every codec's fitted state, the policy's) from
which ``from_state`` rebuilds it, and ``copy`` / ``deepcopy`` through that state; and the
``check_finite`` refusal of non-finite keys and values.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import mlx.core as mx

from ..codec.base import Codec, Packed
from ..validation import FLOAT_DTYPES, check_kv
from .store import PackedStore

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__: list[str] = []

STATE_VERSION = 1


class StateMixin:
    """Bytes, state, save/load and copies of a VeloxCache (mixed in; uses its stores, codecs,
    policy and ``config()``)."""

    # -- memory -----------------------------------------------------------------------------
    def _stores(self) -> list[PackedStore]:
        return list(self.named_stores().values())

    def _codecs(self) -> list[Codec]:
        return [c for t in self.tiers for c in (t.key_codec, t.value_codec)]

    def _distinct_codecs(self) -> list[Codec]:
        """Each codec once (a codec object shared by two places holds one fitted state)."""
        return list({id(c): c for c in self._codecs()}.values())

    def _fitted_nbytes(self) -> int:
        """Bytes outside the token buffers: fitted codec arrays and the policy's state."""
        policy = 0 if self.policy is None else self.policy.nbytes
        return sum(c.state_nbytes for c in self._codecs()) + policy

    @property
    def nbytes(self) -> int:
        """Resident bytes: every buffer (capacity included) and every fitted codec array."""
        return sum(s.nbytes for s in self._stores()) + self._fitted_nbytes()

    @property
    def logical_nbytes(self) -> int:
        """Resident bytes without the unused capacity of the buffers."""
        return sum(s.logical_nbytes for s in self._stores()) + self._fitted_nbytes()

    # -- input checks -----------------------------------------------------------------------
    def _refuse_nonfinite(self, keys: mx.array, values: mx.array) -> None:
        """``check_finite``: raise before anything is stored if a key or value is NaN or inf
        (one sync reads both flags back)."""
        check_kv(keys, values)
        ok = mx.stack([mx.all(mx.isfinite(keys)), mx.all(mx.isfinite(values))]).tolist()
        if all(ok):
            return
        parts = []
        for name, x, fine in (("keys", keys, ok[0]), ("values", values, ok[1])):
            if not fine:
                nan, inf = (int(mx.sum(f(x)).item()) for f in (mx.isnan, mx.isinf))
                parts.append(f"{name} hold {nan} NaN and {inf} inf of {x.size} entries")
        t = keys.shape[2]
        where = "" if self._bound_layer is None else f" (layer {self._bound_layer})"
        raise ValueError(
            f"{self.method}{where}: non-finite input at positions {self.offset} to "
            f"{self.offset + t - 1}: {'; '.join(parts)}; nothing was stored (check_finite=True)"
        )

    # -- state ------------------------------------------------------------------------------
    @property
    def state(self) -> list:
        """``[meta (JSON str), *arrays]``: everything needed to rebuild the cache."""
        meta, arrays = self._state_dict()
        return [json.dumps(meta), *arrays.values()]

    @state.setter
    def state(self, v) -> None:
        if not v or not isinstance(v[0], str):
            raise ValueError("VeloxCache state must start with its JSON meta string")
        meta = json.loads(v[0])
        names = meta.get("arrays", [])
        if len(names) != len(v) - 1:
            raise ValueError(f"VeloxCache state lists {len(names)} arrays, got {len(v) - 1}")
        self._load_state_dict(meta, dict(zip(names, v[1:])))

    @classmethod
    def from_state(cls, state) -> Self:
        if not state or not isinstance(state[0], str):
            raise ValueError("VeloxCache state must start with its JSON meta string")
        cache = cls.from_config(json.loads(state[0])["config"])
        cache.state = state
        return cache

    def copy(self) -> Self:
        """An independent cache with the same settings and contents (arrays are shared: MLX
        arrays are values, and a write into a shared buffer copies it)."""
        out = type(self).from_state(self.state)
        out.fetch_decoded = self.fetch_decoded
        return out

    def __deepcopy__(self, memo) -> Self:
        # mlx-lm's batch generator and server deep-copy prompt caches
        out = self.copy()
        memo[id(self)] = out
        return out

    def named_stores(self) -> dict[str, PackedStore]:
        """Every store of the cache by its name in the state record: its segments'
        (:meth:`Stored.named <velox_core.cache.stored.Stored.named>`) and any a preset adds
        (the shared stores of linked layers, say)."""
        return self.stored.named()

    def _named_codecs(self) -> dict[str, Codec]:
        out = {}
        for i, t in enumerate(self.tiers):
            out[f"tier{i}.k"], out[f"tier{i}.v"] = t.key_codec, t.value_codec
        return out

    def _state_dict(self) -> tuple[dict, dict[str, mx.array]]:
        arrays: dict[str, mx.array] = {}
        stores = {}
        for name, s in self.named_stores().items():
            v = s.view()
            if v is None:
                continue
            stores[name] = {
                "tokens": v.tokens,
                "block": v.block,
                "per_block": sorted(v.per_block),
                "fields": list(v.data),
            }
            for f, a in v.data.items():
                arrays[f"store.{name}.{f}"] = a
        for name, c in self._named_codecs().items():
            for f, a in c.state().items():
                arrays[f"codec.{name}.{f}"] = a
        if self.policy is not None:
            for f, a in self.policy.state().items():
                arrays[f"policy.{f}"] = a
        meta = {
            "version": STATE_VERSION,
            "method": self.method,
            "config": self.config(),
            "offset": self.offset,
            "dims": self.stored.dims,
            "dtype": None if self.stored.dtype is None else _dtype_name(self.stored.dtype),
            "stores": stores,
            "arrays": list(arrays),
            "ragged": len(self.stored.heads) if self.ragged else None,
            "storage_dtype": None
            if self.storage_dtype is None
            else _dtype_name(self.storage_dtype),
            "io_dtype": None if self._io_dtype is None else _dtype_name(self._io_dtype),
            "policy_meta": None if self.policy is None else self.policy.meta(),
        }
        return meta, arrays

    def _load_state_dict(self, meta: dict, arrays: dict[str, mx.array]) -> None:
        self._planned.clear()
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported VeloxCache state version {meta.get('version')!r}")
        self.offset = int(meta["offset"])
        self.stored.dims = None if meta["dims"] is None else tuple(meta["dims"])
        dt = meta["dtype"]
        if dt is not None and getattr(mx, dt, None) not in FLOAT_DTYPES:
            raise ValueError(f"VeloxCache state has an unsupported dtype {dt!r}")
        self.stored.dtype = None if dt is None else getattr(mx, dt)
        self.storage_dtype = _dtype_from(meta.get("storage_dtype"))
        self._io_dtype = _dtype_from(meta.get("io_dtype")) or self.stored.dtype
        if meta.get("ragged"):
            if self.stored.positions is None:
                raise ValueError("VeloxCache state has per-head storage but no retention policy")
            self.stored.heads = [
                [PackedStore(self.step) for _ in range(3)] for _ in range(meta["ragged"])
            ]
        named = self.named_stores()
        for name, s in named.items():
            info = meta["stores"].get(name)
            if info is None:
                s.replace(None)
                continue
            data = {f: arrays[f"store.{name}.{f}"] for f in info["fields"]}
            s.replace(Packed(data, info["tokens"], info["block"], frozenset(info["per_block"])))
        for name, c in self._named_codecs().items():
            pre = f"codec.{name}."
            c.set_state({k[len(pre) :]: a for k, a in arrays.items() if k.startswith(pre)})
        if self.policy is not None:
            self.policy.set_state(
                {k[7:]: a for k, a in arrays.items() if k.startswith("policy.")},
                meta.get("policy_meta"),
            )
        if (
            self.stored.dims is not None
            and self.size()
            and self.stored.window[0].view() is not None
        ):
            got = self.stored.window[0].view().data["x"].shape
            if (got[0], got[1], got[3]) != (
                self.stored.dims[0],
                self.stored.dims[1],
                self.stored.dims[2],
            ):
                raise ValueError("VeloxCache state: window arrays disagree with the recorded dims")


def _dtype_name(dt: mx.Dtype) -> str:
    return str(dt).split(".")[-1]


def _dtype_from(name: str | None) -> mx.Dtype | None:
    if name is None:
        return None
    dt = getattr(mx, name, None)
    if dt not in FLOAT_DTYPES:
        raise ValueError(f"VeloxCache state has an unsupported dtype {name!r}")
    return dt
