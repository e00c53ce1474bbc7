"""``LatentCache``: velox codes for a multi-head latent attention (MLA) layer.

DeepSeek-V3's attention (mlx-lm's ``deepseek_v3``, and the models built on it: Kimi K2,
``glm4_moe_lite``) stores two arrays per token through ``cache.update_and_fetch``, one head
each: the normalized latent ``kv_latent`` (``kv_lora_rank`` channels, 512 on the real models)
and the RoPE'd key ``k_pe`` (``qk_rope_head_dim`` channels, 64). It attends with projections
of what the cache returns: ``q_pe @ k_pe.T`` is passed as the mask, and the latent serves as
the no-RoPE key and the value, absorbed into the queries and the output at decode, expanded
into per-head keys and values at prefill. Its keys and values are never the keys and values
of ordinary attention, so :meth:`VeloxCache.attend` cannot serve it.

A ``LatentCache`` codes both arrays with ``Uniform`` affine per-token groups, packed, and
returns them decoded (lazily: an array nobody reads is never computed). At decode the model
hands the latent it was returned, as keys and values alike, to mlx-lm's shared
``scaled_dot_product_attention`` with the RoPE scores as the mask: under velox's routing
(:func:`velox_core.routed`) the router passes that call to :meth:`LatentCache.attend`, which
recognises its own latent and attends from the codes in place
(:func:`velox_core.cache.absorbed.attention`), so the decoded latent is never built. Every
other call (prefill chunks, whose attention is given the latent's projections; codes MLX
cannot read; attention sinks) takes the model's attention over the decoded arrays, as
without routing: the *reference path*.

Storage: where both arrays are coded alike and every token on arrival (the same bits and
group, no window or sinks, ``flush=1``: the defaults at DeepSeek-V3's widths) one record a
token holds the two concatenated (:class:`~velox_core.cache.latent_joint.JointLatent`: one
encode, write and decode a step); otherwise a :class:`~velox_core.cache.velox.VeloxCache`
holds ``k_pe`` as its keys and the latent as its values, so the velox conventions hold:
``sinks`` first tokens and the ``window`` newest kept as given, the codes growing ``step``
tokens at a time. ``flush``
defaults to 1 here (each token coded as it leaves the window), not velox's 64: the absorbed
attention reads codes and fp16 tokens alike at every step, so tokens waiting as given buy
nothing, while
``flush=1`` with ``window=0`` keeps the bytes at the codes' ratio and the cache exactly
trimmable (speculative decoding). A spec's ``flush=N`` is honoured (up to ``N - 1`` tokens
then wait as given, KIVI's residual). ``nbytes`` counts every buffer with its capacity,
``logical_nbytes`` without it (the packed codes, their fp16 scales and zeros, the fp16
tokens).

``make_cache`` gives MLA layers a ``LatentCache`` for ``uniform`` specs (:data:`METHODS`:
``bits``, ``key_bits`` for ``k_pe``, ``value_bits`` for the latent, ``group``, ``clip``,
``window``, ``sinks``, ``flush``, ``check_finite``; per-token groups only) and keeps the
model's fp16 cache, with its warning, for every other method (eviction policies and
methods with their own attention or fitted codecs need the keys and values of ordinary
attention).
"""

from __future__ import annotations

import json
import weakref
from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..codec.uniform import MLXGrid
from ..validation import check_bits, check_bool, check_divides, check_float, check_int
from .latent_joint import JointLatent, joins
from .velox import VeloxCache

__all__: list[str] = []

# spec methods whose codes a LatentCache makes for an MLA layer
METHODS = frozenset({"uniform"})
STATE_VERSION = 1


class LatentCache(_BaseCache):
    """Packed affine codes of an MLA layer's latent and RoPE key.

    Args:
        bits: code width of the latent (2 to 8).
        pe_bits: code width of ``k_pe`` (default ``bits``).
        group: channels per scale/zero group of the latent; must divide ``kv_lora_rank``.
        pe_group: channels per group of ``k_pe`` (default ``group``, capped at the
            ``k_pe`` width); must divide ``qk_rope_head_dim``.
        clip: factor in ``(0, 1]`` on each group's min and max.
        window, sinks, flush, step, check_finite: as :class:`VeloxCache`'s, but ``flush``
            defaults to 1.

    Batching: ``filter``, ``extract`` and ``extend`` (equal lengths) work on the rows;
    ``merge`` (mlx-lm's batch of caches of different lengths) is refused.
    """

    method: ClassVar[str] = "latent"

    def __init__(
        self,
        bits: int = 4,
        pe_bits: int | None = None,
        group: int = 64,
        pe_group: int | None = None,
        clip: float = 1.0,
        window: int = 0,
        sinks: int = 0,
        flush: int = 1,
        step: int = 256,
        check_finite: bool = False,
    ):
        # not ``bits``: mlx-lm's shared attention takes a cache with a ``bits`` attribute for
        # its own quantized cache
        self.latent_bits = check_bits("bits", bits, minimum=2, maximum=8)
        self.pe_bits = bits if pe_bits is None else check_bits("pe_bits", pe_bits, 2, 8)
        self.group = check_int("group", group, minimum=1)
        self.pe_group = None if pe_group is None else check_int("pe_group", pe_group, minimum=1)
        self.clip = check_float("clip", clip, minimum=0.0, maximum=1.0, open_min=True)
        self.window = check_int("window", window, minimum=0)
        self.sinks = check_int("sinks", sinks, minimum=0)
        self.flush = check_int("flush", flush, minimum=1)
        self.step = check_int("step", step, minimum=1)
        self.check_finite = check_bool("check_finite", check_finite)
        self.storage_dtype: mx.Dtype | None = None  # set_storage_dtype
        self.layer: int | None = None  # the model's layer index (messages), set by make_cache
        self.dims: tuple[int, int] | None = None  # (latent width, k_pe width), once known
        self._store: VeloxCache | JointLatent | None = None  # built once the widths are known
        # the latent the last update_and_fetch returned (a weak reference: the model's
        # arrays are not kept alive), which attend recognises as its keys and values
        self._fetched: weakref.ref | None = None
        # what the last routed attention call read: "codes", or why it read the decoded
        # latent (None until one)
        self.decode_path: str | None = None

    # -- construction -----------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {
            "bits": self.latent_bits,
            "pe_bits": self.pe_bits,
            "group": self.group,
            "pe_group": self.pe_group,
            "clip": self.clip,
            "window": self.window,
            "sinks": self.sinks,
            "flush": self.flush,
            "step": self.step,
            "check_finite": self.check_finite,
        }

    @classmethod
    def from_params(cls, method: str, params: dict[str, Any]) -> LatentCache:
        """A cache from a method spec's parameters (``make_cache``: ``uniform`` only).

        ``bits`` codes both arrays; ``key_bits`` overrides it for ``k_pe`` (the RoPE half of
        the keys), ``value_bits`` for the latent (the no-RoPE keys and the values); ``flush``
        defaults to 1 (the module's docstring says why). Raises ``ValueError`` for another
        method or a setting the latent cannot take.
        """
        if method not in METHODS:
            raise ValueError(
                f"latent attention: method {method!r} cannot code the latent; "
                f"methods that can: {', '.join(sorted(METHODS))}"
            )
        from .uniform import UniformCache

        p = {**UniformCache.defaults(), **params}
        unknown = sorted(set(params) - set(UniformCache.defaults()))
        if unknown:
            raise ValueError(f"{method}: unknown parameter {', '.join(map(repr, unknown))}")
        for side in ("key_axis", "value_axis"):
            if p[side] != "token":
                raise ValueError(
                    f"latent attention: {side}={p[side]!r} is not supported (the latent and "
                    "k_pe are coded in per-token groups only: axis 'token')"
                )
        bits = p["bits"]
        return cls(
            bits=bits if p["value_bits"] is None else p["value_bits"],
            pe_bits=bits if p["key_bits"] is None else p["key_bits"],
            group=p["group"],
            clip=p["clip"],
            window=p["window"],
            sinks=p["sinks"],
            flush=1 if p["flush"] is None else p["flush"],
            check_finite=p["check_finite"],
        )

    def fresh(self) -> LatentCache:
        """An empty cache with the same settings."""
        out = type(self)(**self.config())
        out.storage_dtype = self.storage_dtype
        return out

    def describe(self) -> str:
        return (
            f"latent: latent={self.latent_bits}b/g{self.group} k_pe={self.pe_bits}b/"
            f"g{self._pe_group_text()} window={self.window} sinks={self.sinks}"
        )

    def _pe_group_text(self) -> str:
        if self.dims is not None:
            return str(self._pe_group(self.dims[1]))
        return str(self.pe_group or self.group)

    def _pe_group(self, pe_dim: int) -> int:
        return self.pe_group if self.pe_group is not None else min(self.group, pe_dim)

    def check_dims(self, latent_dim: int, pe_dim: int, joint: bool | None = None) -> None:
        """Refuse widths the groups do not divide (``ValueError`` naming the parameter, the
        width and divisors to use); on success the widths are fixed and the store built (one
        record a token where ``joint``, by default where the settings allow it)."""
        check_divides(
            "latent", "group", self.group, latent_dim, "latent width (kv_lora_rank)",
            "per-token groups split a token's latent channels",
        )  # fmt: skip
        pg = self._pe_group(pe_dim)
        check_divides(
            "latent", "pe_group", pg, pe_dim, "k_pe width (qk_rope_head_dim)",
            "per-token groups split a token's RoPE key channels",
        )  # fmt: skip
        if self.dims is not None and self.dims != (latent_dim, pe_dim):
            raise ValueError(
                f"latent: widths (latent {latent_dim}, k_pe {pe_dim}) differ from the cache's "
                f"(latent {self.dims[0]}, k_pe {self.dims[1]})"
            )
        if self._store is None:
            self.dims = (latent_dim, pe_dim)
            self._store = self._build(pg, joint)

    def set_storage_dtype(self, dtype: mx.Dtype | None) -> None:
        """Keep the fp16 tokens and the scales in ``dtype`` (as
        :meth:`VeloxCache.set_storage_dtype`); only while the cache is empty."""
        if self._store is not None:
            self._store.set_storage_dtype(dtype)
        self.storage_dtype = dtype

    def _build(self, pe_group: int, joint: bool | None) -> VeloxCache | JointLatent:
        alike = self.pe_bits == self.latent_bits and pe_group == self.group
        plain = not (self.window or self.sinks or self.check_finite) and self.flush == 1
        if joint is None:
            joint = alike and plain and joins(self.dims[0], self.group)
        if joint:
            codec = MLXGrid(self.latent_bits, self.group, clip=self.clip)
            store = JointLatent(codec, self.dims, self.step)
            store.set_storage_dtype(self.storage_dtype)
            return store
        store = VeloxCache(
            key_codec=MLXGrid(self.pe_bits, pe_group, clip=self.clip),
            value_codec=MLXGrid(self.latent_bits, self.group, clip=self.clip),
            window=self.window,
            sinks=self.sinks,
            flush=self.flush,
            step=self.step,
            check_finite=self.check_finite,
        )
        store.set_storage_dtype(self.storage_dtype)
        return store

    # -- the mlx-lm protocol ----------------------------------------------------------------
    @property
    def offset(self) -> int:
        return 0 if self._store is None else self._store.offset

    def update_and_fetch(self, kv_latent: mx.array, k_pe: mx.array) -> tuple[mx.array, mx.array]:
        """Store the new tokens' latent and RoPE key; return every stored token's, decoded.

        Both are returned lazily: the model computes its RoPE scores from ``k_pe``, while the
        latent is decoded only where something reads it. Under velox's routing the absorbed
        decode attention is given this latent and reads the codes instead (:meth:`attend`);
        elsewhere the model's attention runs on it as on mlx-lm's fp16 cache.

        Shapes:
            kv_latent ``(B, 1, T, kv_lora_rank)``, k_pe ``(B, 1, T, qk_rope_head_dim)``;
            returns the same, over every stored token.
        """
        if self._store is None:
            try:
                self.check_dims(kv_latent.shape[-1], k_pe.shape[-1])
            except ValueError as exc:
                where = "" if self.layer is None else f" (layer {self.layer})"
                raise ValueError(f"{exc}{where}") from None
        pe, latent = self._store.update_and_fetch(k_pe, kv_latent)
        self._fetched = weakref.ref(latent)
        return latent, pe

    def attend(
        self, queries: mx.array, keys: Any, values: Any, scale: float, mask=None, sinks=None
    ) -> mx.array | None:
        """The absorbed decode attention from the latent's codes, or None where the call is
        not that one or the codes cannot be read (the caller then runs the model's attention
        on the arrays it was given, the reference path).

        velox's router calls it for every shared-attention call of a layer with this cache.
        It attends when ``keys`` and ``values`` are both the latent the last
        :meth:`update_and_fetch` returned (DeepSeek-V3's decode step: queries absorbed into
        the latent; its prefill passes the latent's projections instead), with no attention
        sinks and a mask that is None or an array over the stored tokens, and the codes are
        in MLX's layout (:func:`velox_core.cache.absorbed.readable`). :attr:`decode_path`
        says which path the call took.

        Shapes:
            queries ``(B, Hq, L, kv_lora_rank)``; mask broadcasting to ``(B, Hq, L, T)``;
            returns ``(B, Hq, L, kv_lora_rank)``.
        """
        from . import absorbed

        fetched = None if self._fetched is None else self._fetched()
        if fetched is None or keys is not fetched or values is not fetched:
            self.decode_path = "decoded: attention is given other arrays than the latent"
            return None
        why = absorbed.turned_off() or self._unreadable(queries, fetched, mask, sinks)
        segments = [] if why else self._segments()
        why = why or absorbed.codes_unreadable(segments)
        if why:
            self.decode_path = f"decoded: {why}"
            return None
        self.decode_path = "codes"
        if isinstance(mask, str):
            mask = None  # "causal" over one query: every stored token
        return absorbed.attention(queries, segments, scale, mask)

    def _segments(self) -> list:
        """``(codec, record)`` of the stored latents in temporal order."""
        one = self._store.one_segment()  # a step's hot path: one coded segment
        segments = [one] if one is not None else self._store.segments()
        return [(s.value_codec, s.values) for s in segments]

    def _unreadable(self, queries: mx.array, latent: mx.array, mask, sinks) -> str:
        """Why :meth:`attend` leaves a call with the model's ``latent`` (the one the last
        :meth:`update_and_fetch` returned) to the reference path ("" where it does not)."""
        if sinks is not None:
            return "attention sinks"
        b, shape = latent.shape[0], tuple(queries.shape)
        if len(shape) != 4 or shape[0] != b or shape[3] != self.dims[0]:
            return f"queries {shape} are not (batch={b}, heads, L, latent={self.dims[0]})"
        if isinstance(mask, str):
            return "" if mask == "causal" and shape[2] == 1 else f"mask {mask!r}"
        if mask is not None and (mask.ndim > 4 or mask.shape[-1] != self.size()):
            return f"a mask of shape {tuple(mask.shape)} over {self.size()} stored tokens"
        if getattr(self._store, "codes_sliced", False):
            from ..kernels import backend

            if backend() == "cuda":
                return "one record a token on MLX's CUDA backend (contiguous codes only there)"
        return ""

    def size(self) -> int:
        return 0 if self._store is None else self._store.size()

    def empty(self) -> bool:
        return self.size() == 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The causal mask of ``N`` new queries over the stored tokens (as ``KVCache``'s)."""
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(N, self.offset, return_array, window_size)

    def is_trimmable(self) -> bool:
        """As :meth:`VeloxCache.is_trimmable`: exact for ``window=0``, ``flush=1`` (every token
        coded on arrival); otherwise a trim past the fp16 tokens decodes coded ones back."""
        if self._store is None:
            return self.window == 0 and self.flush == 1
        return self._store.is_trimmable()

    def reuses_prefix(self) -> bool:
        """As :meth:`VeloxCache.reuses_prefix`: whether :meth:`trim` keeps the first tokens as
        this cache holds them (a prompt cache may serve a shorter prompt's prefix from it)."""
        return self.is_trimmable() or (self._store is not None and self._store.reuses_prefix())

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens; returns ``n``."""
        if self._store is None:
            check_int("n", n, minimum=0)
            if n:
                raise ValueError(f"cannot trim {n} tokens: the cache stores 0")
            return 0
        return self._store.trim(n)

    # -- bytes ------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Resident bytes: codes, scales, zeros and fp16 tokens, buffer capacity included."""
        return 0 if self._store is None else self._store.nbytes

    @property
    def logical_nbytes(self) -> int:
        """Resident bytes without the buffers' unused capacity."""
        return 0 if self._store is None else self._store.logical_nbytes

    # -- state ------------------------------------------------------------------------------
    def _meta(self) -> tuple[dict, list[mx.array]]:
        inner, arrays = (None, {}) if self._store is None else self._store._state_dict()
        meta = {
            "version": STATE_VERSION,
            "method": self.method,
            "config": self.config(),
            "dims": self.dims,
            "layer": self.layer,
            "store": inner,
        }
        return meta, list(arrays.values())

    @property
    def state(self) -> list:
        """``[meta (JSON str), *arrays]``: everything :meth:`from_state` rebuilds it from."""
        meta, arrays = self._meta()
        return [json.dumps(meta), *arrays]

    @state.setter
    def state(self, v) -> None:
        if not v or not isinstance(v[0], str):
            raise ValueError("LatentCache state must start with its JSON meta string")
        meta = json.loads(v[0])
        if meta.get("version") != STATE_VERSION or meta.get("method") != self.method:
            raise ValueError(
                f"not a LatentCache state (method {meta.get('method')!r}, version "
                f"{meta.get('version')!r})"
            )
        self.layer = meta.get("layer")
        inner = meta.get("store")
        if meta.get("dims") is None or inner is None:
            if len(v) > 1:
                raise ValueError(f"LatentCache state of an empty cache holds {len(v) - 1} arrays")
            self.dims, self._store = None, None
            return
        self.dims, self._store = None, None
        joint = inner.get("layout") == "joint"
        self.check_dims(*meta["dims"], joint=joint)
        if joint:
            self._store.load(inner, list(v[1:]))
        else:
            self._store.state = [json.dumps(inner), *v[1:]]

    @property
    def meta_state(self) -> tuple[str]:
        """The JSON meta (``state[0]``), mlx-lm's name for a cache's non-array state."""
        return (json.dumps(self._meta()[0]),)

    @classmethod
    def from_state(cls, state) -> LatentCache:
        if not state or not isinstance(state[0], str):
            raise ValueError("LatentCache state must start with its JSON meta string")
        cache = cls(**json.loads(state[0])["config"])
        cache.state = state
        return cache

    def copy(self) -> LatentCache:
        """An independent cache with the same settings and contents."""
        return type(self).from_state(self.state)

    def __deepcopy__(self, memo) -> LatentCache:
        out = self.copy()
        memo[id(self)] = out
        return out

    # -- batch rows -------------------------------------------------------------------------
    def filter(self, batch_indices) -> None:
        """Keep only the given batch rows (in place)."""
        if self._store is not None:
            self._store.filter(batch_indices)

    def extract(self, idx: int) -> LatentCache:
        """A new single-sequence cache holding batch row ``idx``."""
        out = self.copy()
        out.filter([idx])
        return out

    def extend(self, other: LatentCache) -> None:
        """Append the batch rows of ``other`` (same settings, equal lengths: no padding)."""
        if type(other) is not type(self) or other.config() != self.config():
            raise ValueError("extend: both caches must be LatentCaches with the same settings")
        if self._store is None or other._store is None:
            raise ValueError("extend: both caches must hold tokens")
        self._store.extend(other._store)

    def merge(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            "LatentCache.merge: batching MLA caches of different lengths is not implemented "
            "(velox's batched cache attends through routed attention, which latent attention "
            "does not call); generate one sequence at a time, or use the fp16 cache "
            "(make_cache(model, 'fp16')) for batch generation"
        )

    def __repr__(self) -> str:
        return f"<LatentCache {self.describe()} offset={self.offset} size={self.size()}>"
