"""``VeloxCache``: segments of coded tokens behind the mlx-lm 0.32 cache protocol.

Tokens flow through segments in temporal order::

    sinks (kept as given) | tier n-1 ... tier 0 (coded) | window (kept as given)

New tokens enter the window (after the first ``sinks`` tokens, which stay as given). When
the window holds ``window + flush`` tokens or more, every token past the newest ``window`` is
encoded into tier 0 at once, in whole codec blocks (with ``flush`` above 1 at least one token
stays as given, ``window=0`` included): a decode step only writes its token into the window's
buffer (which grows 16 tokens at a time), and the codes grow ``flush`` tokens at a time
(KIVI's residual: between ``window`` and ``window + flush - 1`` of the newest tokens stay as
given). With ``window=0``, nothing waiting and a chunk of at least ``flush`` tokens (a
prefill), its whole blocks are encoded at once, without passing through the window's store.
A tier with a ``span`` passes its oldest tokens to the next tier when it holds more than
``span`` (decoded and re-encoded once, at the next tier's precision). A retention policy, if
any, then cuts the cache back to its budget. ``offset`` is always the number of tokens seen;
``size()`` the number stored.

This module holds the class, its construction, ``update_and_fetch`` and ``attend``; mixed in
from its siblings: the coded tiers (:mod:`.tiers`), bytes, state and copies (:mod:`.state`),
batch rows (:mod:`.rows`), eviction with per-head storage (:mod:`.retention`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from .. import routing
from ..codec.base import Codec
from ..codec.identity import Identity
from ..policy.view import PolicyView
from ..validation import FLOAT_DTYPES, check_int, check_kv
from .attention import attend, decode_segments
from .planned import PlannedAttention, check_queries
from .retention import RetentionMixin
from .rows import BatchRowsMixin
from .state import StateMixin
from .stored import Stored
from .tiers import Tier, TierMixin

__all__: list[str] = []

FLUSH = 64  # tokens the window passes to the codes at once, by default


def _codec(c: Codec | None, name: str) -> Codec:
    if c is None:
        return Identity()
    if not isinstance(c, Codec):
        raise TypeError(f"{name} must be a velox_core Codec or None, got {type(c).__name__}")
    return c


# the reason a method needing an artifact fitted on the whole model gives (its
# split_refusal): the artifact is found by the model's fingerprint, which splitting changes
FITTED_ON_WHOLE_MODEL = (
    "it needs an artifact fitted on the whole model (found by the model's fingerprint, which "
    "splitting changes); slicing it per process is not implemented"
)


class VeloxCache(TierMixin, StateMixin, BatchRowsMixin, RetentionMixin):
    """A compressed KV cache for one attention layer.

    Args:
        key_codec: codec of the keys (None keeps them as given).
        value_codec: codec of the values (None keeps them as given).
        window: most recent tokens kept as given (a block codec may keep up to
            ``window + block - 1`` until a whole block is ready).
        sinks: first tokens kept as given (attention sinks).
        tiers: age tiers instead of ``key_codec``/``value_codec``: newest first, each with a
            ``span`` except the last.
        policy: a retention policy (token eviction), or None to keep every token.
        step: growth quantum of the buffers, in tokens.
        fused_above: prefill chunks longer than this attend through fused SDPA over decoded
            segments; shorter ones (decode) attend from the codes.
        flush: tokens the window passes to the codes at once (rounded up to whole codec
            blocks): up to ``flush - 1`` tokens past ``window`` wait as given. 1 encodes every
            token as soon as it leaves the window. Default: :attr:`default_flush`
            (:data:`FLUSH`), or 1 with a retention policy (which decides token by token what
            stays) or age tiers.
        check_finite: refuse keys or values holding a NaN or an inf at ``update_and_fetch``
            (a ``ValueError`` naming the layer and the positions; nothing is stored). Off by
            default: the check reads the new tokens back, one device sync per layer and step.
    """

    method: ClassVar[str] = "velox"
    # ``flush`` when not given (single tier, no policy); a preset whose calibration watches
    # the window token by token (``before_coding``) sets 1
    default_flush: ClassVar[int] = FLUSH
    # prefill chunks (more than ``fused_above`` tokens) are evaluated when stored
    eval_chunks: ClassVar[bool] = True
    # a split model (split_refusal): why a split by heads cannot hold a process's share
    # ("": each KV head is treated on its own), and whether an artifact fitted on the whole
    # model is needed (then any split is refused)
    mixes_heads: ClassVar[str] = ""
    fitted_on_whole_model: ClassVar[bool] = False
    # stored tokens per slice of a prefill chunk's attention (tiled_prefill_attention): None
    # chooses (slices on the CPU over long contexts), 0 never slices; may be set per cache
    prefill_tile: int | None = None

    def __init__(
        self,
        key_codec: Codec | None = None,
        value_codec: Codec | None = None,
        *,
        window: int = 0,
        sinks: int = 0,
        tiers: list[Tier] | None = None,
        policy: Any = None,
        step: int = 256,
        fused_above: int = 16,
        flush: int | None = None,
        check_finite: bool = False,
    ):
        self.window = check_int("window", window, minimum=0)
        # a retention policy decides per token what stays, and age tiers pass tokens on
        # token by token: their caches pass each token on
        if flush is None:
            single = policy is None and (tiers is None or len(tiers) == 1)
            flush = self.default_flush if single else 1
        self.flush = check_int("flush", flush, minimum=1)
        self.sinks = check_int("sinks", sinks, minimum=0)
        self.step = check_int("step", step, minimum=1)
        self.fused_above = check_int("fused_above", fused_above, minimum=0)
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be True or False, got {check_finite!r}")
        self.check_finite = check_finite
        self._bound_layer: int | None = None  # the model's layer index, once bound (messages)
        if tiers is not None:
            if key_codec is not None or value_codec is not None:
                raise ValueError("pass either tiers or key_codec/value_codec, not both")
            if not tiers:
                raise ValueError("tiers must hold at least one Tier")
        else:
            tiers = [Tier(_codec(key_codec, "key_codec"), _codec(value_codec, "value_codec"))]
        for i, t in enumerate(tiers):
            if not isinstance(t, Tier):
                raise TypeError(f"tiers[{i}] must be a Tier, got {type(t).__name__}")
            _codec(t.key_codec, f"tiers[{i}].key_codec")
            _codec(t.value_codec, f"tiers[{i}].value_codec")
            last = i == len(tiers) - 1
            if last and t.span is not None:
                raise ValueError("the last tier holds every older token: its span must be None")
            if not last:
                check_int(f"tiers[{i}].span", t.span, minimum=1)
        self.tiers = tiers
        self.policy = policy
        self.offset = 0
        self.stored = Stored(len(tiers), step)  # the tokens, segment by segment
        # all a retention policy sees of this cache: every hook is given this view
        self.policy_view = PolicyView(self)
        if policy is not None:
            policy.attach(self.policy_view)
        self._ident = Identity()
        self.storage_dtype: mx.Dtype | None = None
        self._io_dtype: mx.Dtype | None = None
        # False: while attention is routed to velox, update_and_fetch returns the new tokens
        # as given, not every stored token decoded (make_cache sets it for model types whose
        # layers read their keys only through mlx-lm's shared attention function)
        self.fetch_decoded = True
        # True while attention is routed to velox caches (velox_core.routed): set by
        # velox_core.routing on every live cache when routing turns on or off
        self.routed = False
        routing.track(self)
        self._planned = PlannedAttention()  # decode attention, planned once per coded segment
        self._init_retention()
        # window tokens past ``_keep`` at which the window passes them to the codes; a flush
        # of more than one token leaves at least one as given (with ``window=0`` too), so that
        # decode steps always join fp16 tokens and keep one kernel variant (the first flush
        # would otherwise build the variant without them in the middle of a generation)
        self._flush_at = self._quantum()
        self._keep = self.window if self.flush == 1 else max(self.window, 1)

    def set_storage_dtype(self, dtype: mx.Dtype | None) -> None:
        """Store unquantized tokens (and scales) in ``dtype`` whatever the model computes in.

        For example a model run in float32 on a CPU (where MLX's float16 matmuls are slow)
        can still keep a float16 cache. Only allowed while the cache is empty.
        """
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"storage dtype must be float16, bfloat16, float32 or None, got {dtype}"
            )
        if self.stored.dims is not None:
            raise ValueError("set_storage_dtype: the cache already holds tokens")
        self.storage_dtype = dtype

    # -- construction -----------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """JSON-serializable description from which :meth:`from_config` rebuilds the cache."""
        return {
            "tiers": [
                {"key": _spec(t.key_codec), "value": _spec(t.value_codec), "span": t.span}
                for t in self.tiers
            ],
            "window": self.window,
            "sinks": self.sinks,
            "step": self.step,
            "fused_above": self.fused_above,
            "flush": self.flush,
            "policy": None if self.policy is None else _spec(self.policy),
            **({"check_finite": True} if self.check_finite else {}),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VeloxCache:
        from ..registry import build_codec, build_policy

        cfg = dict(config)
        tiers = [
            Tier(build_codec(t["key"]), build_codec(t["value"]), t.get("span"))
            for t in cfg.pop("tiers")
        ]
        policy = cfg.pop("policy", None)
        policy = None if policy is None else build_policy(policy)
        return VeloxCache(tiers=tiers, policy=policy, **cfg)

    def fresh(self) -> VeloxCache:
        """An empty cache with the same settings (fresh codecs, fresh policy)."""
        return type(self).from_config(self.config())

    def describe(self) -> str:
        t = self.tiers[0]
        body = f"K={t.key_codec.describe()} V={t.value_codec.describe()}"
        if len(self.tiers) > 1:
            body = " | ".join(
                f"K={x.key_codec.describe()} V={x.value_codec.describe()} span={x.span}"
                for x in self.tiers
            )
        pol = "" if self.policy is None else f" policy={self.policy.describe()}"
        return f"{self.method}: {body} window={self.window} sinks={self.sinks}{pol}"

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Give codecs and the policy the model and layer index they may need."""
        self._bound_layer = layer
        for t in self.tiers:
            t.key_codec.bind(model, layer)
            t.value_codec.bind(model, layer)
        if self.policy is not None:
            self.policy.bind(model, layer)

    @classmethod
    def link_layers(cls, caches: list) -> None:
        """Called once per velox cache class by ``make_cache`` (after every layer is built and
        bound) and by ``load_cache``, with the whole model's caches (one per layer, any
        classes). A method whose layers share state (a coordinator of a group of layers)
        links its caches here; the default links nothing."""

    @classmethod
    def split_refusal(cls, config: dict, by_heads: bool, pipelined: bool) -> str:
        """Why a model split over processes (``by_heads``: ``model.shard``; ``pipelined``:
        mlx-lm's pipeline stages) cannot use caches of this class with ``config``, or "" where
        it can (:mod:`velox_core.split`). A class states it with two attributes:
        ``fitted_on_whole_model`` (True: its artifact is found by the whole model's
        fingerprint, so any split is refused) and ``mixes_heads`` (why a split by heads
        cannot hold a process's share: a budget shared among a layer's heads, scores
        averaged over them, channels permuted across them; "" where each KV head is treated
        on its own). A class whose answer depends on ``config`` overrides this method."""
        if cls.fitted_on_whole_model:
            return FITTED_ON_WHOLE_MODEL
        return cls.mixes_heads if by_heads else ""

    def check_dims(self, key_dim: int, value_dim: int, dtype: mx.Dtype | None = None) -> None:
        """Ask every codec whether it codes keys of ``key_dim`` and values of ``value_dim``
        channels (``make_cache`` does, from the model, before the first forward; the first
        ``update_and_fetch`` does for a cache made by hand); raises a ``ValueError`` naming
        the method, the side and the head dim otherwise."""
        dt = dtype or self.storage_dtype or mx.float16
        for t in self.tiers:
            for side, codec, dim in (
                ("key", t.key_codec, key_dim),
                ("value", t.value_codec, value_dim),
            ):
                try:
                    codec.check(dim, dt)
                except ValueError as exc:
                    raise ValueError(
                        f"{self.method}: its {side} codec {codec.describe()} cannot code a "
                        f"{side} head dim of {dim}: {exc}"
                    ) from None

    # -- the mlx-lm protocol ----------------------------------------------------------------
    def _check_first(self, keys: mx.array, values: mx.array) -> None:
        b, h, _, dk = keys.shape
        dv = values.shape[-1]
        if self.stored.dims is None:
            self.check_dims(dk, dv, keys.dtype)
            self.stored.dims = (b, h, dk, dv)
            self._io_dtype = keys.dtype
            self.stored.dtype = self.storage_dtype or keys.dtype
            if self.stored.dtype != keys.dtype:
                self.check_dims(dk, dv, self.stored.dtype)
            return
        if (b, h, dk, dv) != self.stored.dims:
            raise ValueError(
                f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match the "
                f"cache's (batch, kv_heads, key_dim, value_dim) = {self.stored.dims}"
            )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new post-RoPE keys and values; return what the caller's attention reads.

        mlx-lm's attention calls this, then its ``scaled_dot_product_attention`` with the
        returned arrays and the cache. Outside velox's routing that attention reads the
        arrays: every stored token decoded (lazily), as ``keys_and_values()``. Under
        :func:`velox_core.routed` (and with ``fetch_decoded`` off) velox's attention reads the
        cache's codes itself and ignores the arrays, so the new tokens are returned as given
        and nothing is decoded.

        Shapes:
            keys ``(B, H, T, Dk)``, values ``(B, H, T, Dv)``, fp16, bf16 or fp32.
        """
        if self.check_finite:
            self._refuse_nonfinite(keys, values)
        direct = self._flush_at == 1 and not self.window  # every token coded on arrival
        if self._write_direct(keys, values) if direct else self._write_window(keys, values):
            if self.routed and not self.fetch_decoded:
                return keys, values  # unused: routed attention reads the cache itself
            return self.keys_and_values()
        check_kv(keys, values)
        if self.ragged:
            self._require_routing()
        self._check_first(keys, values)
        keys, values = keys.astype(self.stored.dtype), values.astype(self.stored.dtype)
        new = (keys, values)
        t = keys.shape[2]
        if self.policy is not None:
            if t > 1 and self.policy.prefill == "prompt":
                self.policy.defer()  # the prompt's chunks are cut once, at its end
            else:
                self.policy.before_update(self.policy_view, t)
        start = self.offset
        self.offset += t
        take = min(self.sinks - self.stored.sink[0].tokens, t)
        if take > 0:
            self.stored.sink[0].append(self._ident.encode(keys[:, :, :take]))
            self.stored.sink[1].append(self._ident.encode(values[:, :, :take]))
            keys, values = keys[:, :, take:], values[:, :, take:]
        left = keys.shape[2]  # after the sinks
        direct = left >= self._flush_at and self._direct()
        n = self._encode_direct(keys, values, self.offset - left) if direct else 0
        if n < left:
            if n:
                keys, values = keys[:, :, n:], values[:, :, n:]
            self.stored.window[0].append(self._ident.encode(keys))
            self.stored.window[1].append(self._ident.encode(values))
        self._flush()
        if self.policy is not None:
            self.policy.after_update(self.policy_view, start)
        if t > self.fused_above and self.eval_chunks:
            # a prefill chunk: its codes evaluated now, layer by layer, so that the device
            # frees each layer's fp16 keys, values and encode intermediates before the next
            # layer's exist (the graph of a whole chunk otherwise holds every layer's)
            mx.eval([a for s in self._stores() for a in s.arrays()])
        if self.ragged:
            self._require_routing()
            return new  # unused: routed attention reads the cache itself
        if self.routed and not self.fetch_decoded:
            return new  # unused: routed attention reads the cache itself
        return self.keys_and_values()

    def _require_routing(self) -> None:
        if not self.routed:
            raise ValueError(
                "this cache keeps per-head budgets, which only velox attention can read: "
                "run the model inside velox_core.routed(model) (or generate())"
            )

    def _write_window(self, keys: mx.array, values: mx.array) -> bool:
        """A decode step's fast path: with the sinks full, no policy and no calibration hook,
        the step's tokens are written into the window's buffer in place (the general path's
        effect without its checks). Returns False where the general path must run.

        Store upkeep (a flush of the window's oldest tokens, the window's growth) runs before
        the write and is evaluated on its own (``mx.async_eval``), so every decode step's
        graph is the same write and attention: MLX's CUDA backend replays a graph it has
        seen."""
        win_k, win_v = self.stored.window
        if (
            self.stored.dims is None
            or self.policy is not None
            or self.stored.sink[0].tokens < self.sinks
            or type(self).before_coding is not VeloxCache.before_coding
            or not isinstance(keys, mx.array)
            or not isinstance(values, mx.array)
            or keys.ndim != 4
            or values.ndim != 4
            or keys.dtype != self.stored.dtype
            or values.dtype != self.stored.dtype
        ):
            return False
        (b, h, t, dk), (vb, vh, vt, dv) = keys.shape, values.shape
        n = win_k.tokens
        if (
            (b, h, dk, dv) != self.stored.dims
            or (vb, vh, vt) != (b, h, t)
            or t == 0
            or win_k.buf is None
        ):
            return False
        # (a step's hot path, so no calls: _flush_count's count and the store's capacity)
        over = n + t - self._keep
        flush = over // self._codec_block * self._codec_block if over >= self._flush_at else 0
        if flush > n:
            return False  # the flush would pass on this step's own tokens
        if flush or n + t > win_k.buf.tokens:
            like = (win_k.buf, win_v.buf)  # a flush may empty the window: its layout kept
            if flush:
                self._flush(ahead=t)
            n = win_k.tokens
            win_k.reserve(n + t, like[0])
            win_v.reserve(n + t, like[1])
            mx.async_eval([a for s in self._stores() for a in s.arrays()])
        wk, wv = win_k.buf.data["x"], win_v.buf.data["x"]
        wk[:, :, n : n + t] = keys
        wv[:, :, n : n + t] = values
        win_k.tokens += t
        win_v.tokens += t
        self.offset += t
        return True

    def stored_changed(self) -> None:
        """Called by whoever changes :attr:`stored` outside the cache's own methods (the
        coordinator of linked layers moving a layer's window into shared stores): the decode
        attention planned over the old segments is dropped."""
        self._planned.clear()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """Every stored token decoded, in the input dtype (lazy: costs nothing unless used)."""
        one = self._decoded_tier()  # one coded segment (a step's hot path)
        if one is not None:
            return one
        segs = self.segments()
        if not segs:
            raise ValueError("the cache is empty")
        return decode_segments(segs, self._io_dtype)

    def attend(
        self, queries: mx.array, scale: float, mask=None, sinks: mx.array | None = None
    ) -> mx.array:
        """Attention of ``queries`` ``(B, Hq, L, Dk)`` over every stored token, one joint
        softmax (for one decode query, over the tokens the policy picks:
        ``RetentionPolicy.decode_segments``; a policy that scores by this call's weights gets
        them: ``RetentionMixin._observed``). Returns ``(B, Hq, L, Dv)``."""
        lq = queries.shape[2] if getattr(queries, "ndim", 0) == 4 else 0
        fused = 0 < lq <= self.fused_above and (mask is None or lq == 1) and sinks is None
        # a plain decode step reaches the plan unchecked: the plan checks what it is made for
        checked = not fused or self.policy is not None or self.stored.heads is not None
        if checked:
            check_queries(self.stored, queries)
        out = None if self.policy is None else self._observed(queries, scale, mask, sinks)
        if out is not None:
            return out
        if self.stored.heads is not None:  # ragged (a step's hot path: no property)
            return self._attend_ragged(queries, scale, mask, sinks)
        if lq == 1 and self.policy is not None and (mask is None or isinstance(mask, str)):
            picked = self.policy.decode_segments(self.policy_view, queries, scale)  # sparse decode
            if picked is not None:
                return attend(queries, picked, scale, None, sinks, self.fused_above)
        if fused:
            out = self._planned(self, queries, scale)
            if out is not None:
                return out
        if not checked:
            check_queries(self.stored, queries)
        if lq > self.fused_above and sinks is None:  # a prefill chunk: the next step's kernels
            self._planned.plan_ahead(self, queries, scale)
        segs = self.segments()
        return attend(queries, segs, scale, mask, sinks, self.fused_above, self.prefill_tile)

    def size(self) -> int:
        """Stored tokens (the widest head's, with per-head budgets)."""
        body = max(self.body_sizes(), default=0) if self.ragged else 0
        return self.protected() + sum(s[0].tokens for s in self.stored.coded) + body

    def empty(self) -> bool:
        return self.size() == 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The causal mask of ``N`` new queries over the stored tokens (mlx-lm semantics)."""
        return create_attention_mask(N, self.size(), return_array, window_size)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()} offset={self.offset} size={self.size()}>"


def _spec(obj) -> dict[str, Any]:
    return {"name": obj.name, "config": obj.config()}
