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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from ..codec.base import Codec, Packed
from ..codec.identity import Identity
from ..routing import is_enabled as is_routed
from ..validation import FLOAT_DTYPES, check_int, check_kv
from .attention import Segment, attend, decode_segments
from .planned import PlannedAttention
from .retention import RetentionMixin
from .store import PackedStore

__all__ = ["Tier", "VeloxCache"]

STATE_VERSION = 1
FLUSH = 64  # tokens the window passes to the codes at once, by default
WINDOW_STEP = 16  # the window's growth quantum, in tokens


@dataclass
class Tier:
    """A coded segment: its key and value codecs and how many tokens it holds at most."""

    key_codec: Codec
    value_codec: Codec
    span: int | None = None

    def fresh(self) -> Tier:
        return Tier(self.key_codec.fresh(), self.value_codec.fresh(), self.span)


def _codec(c: Codec | None, name: str) -> Codec:
    if c is None:
        return Identity()
    if not isinstance(c, Codec):
        raise TypeError(f"{name} must be a velox_core Codec or None, got {type(c).__name__}")
    return c


class VeloxCache(RetentionMixin):
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

    # the batched cache merge() makes: velox_core.cache.batch.VeloxBatch, set by the cache
    # package when it imports both (the batch module builds on this one, never back)
    _batch_class: ClassVar[type]

    method: ClassVar[str] = "velox"
    # ``flush`` when not given (single tier, no policy); a preset whose calibration watches
    # the window token by token (``before_coding``) sets 1
    default_flush: ClassVar[int] = FLUSH
    # prefill chunks (more than ``fused_above`` tokens) are evaluated when stored
    eval_chunks: ClassVar[bool] = True

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
        if policy is not None:
            policy.attach(self)
        self.offset = 0
        self._dims: tuple[int, int, int, int] | None = None  # (B, H, Dk, Dv)
        self._dtype: mx.Dtype | None = None
        # sinks are sized exactly (no slack); the window grows by WINDOW_STEP tokens, so most
        # decode steps write their token in place, and shrinks to what it keeps at a flush;
        # coded tiers grow by ``step``
        self._sink = (PackedStore(1), PackedStore(1))
        self._tier = [(PackedStore(step), PackedStore(step)) for _ in tiers]
        self._win = (PackedStore(WINDOW_STEP), PackedStore(WINDOW_STEP))
        self._ident = Identity()
        self.storage_dtype: mx.Dtype | None = None
        self._io_dtype: mx.Dtype | None = None
        # False: while attention is routed to velox, update_and_fetch returns the new tokens
        # as given, not every stored token decoded (make_cache sets it for model types whose
        # layers read their keys only through mlx-lm's shared attention function)
        self.fetch_decoded = True
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
        if self._dims is not None:
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
        if self._dims is None:
            self.check_dims(dk, dv, keys.dtype)
            self._dims = (b, h, dk, dv)
            self._io_dtype = keys.dtype
            self._dtype = self.storage_dtype or keys.dtype
            if self._dtype != keys.dtype:
                self.check_dims(dk, dv, self._dtype)
            return
        if (b, h, dk, dv) != self._dims:
            raise ValueError(
                f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match the "
                f"cache's (batch, kv_heads, key_dim, value_dim) = {self._dims}"
            )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new post-RoPE keys and values; return every stored token decoded (lazily).

        Shapes:
            keys ``(B, H, T, Dk)``, values ``(B, H, T, Dv)``, fp16, bf16 or fp32.
        """
        if self.check_finite:
            self._refuse_nonfinite(keys, values)
        if self._write_window(keys, values):
            if not self.fetch_decoded and _routing_on():
                return keys, values  # unused: routed attention reads the cache itself
            return self.keys_and_values()
        check_kv(keys, values)
        if self.ragged:
            _require_routing()
        self._check_first(keys, values)
        keys, values = keys.astype(self._dtype), values.astype(self._dtype)
        new = (keys, values)
        t = keys.shape[2]
        if self.policy is not None:
            self.policy.before_update(self, t)
        start = self.offset
        self.offset += t
        take = min(self.sinks - self._sink[0].tokens, t)
        if take > 0:
            self._sink[0].append(self._ident.encode(keys[:, :, :take]))
            self._sink[1].append(self._ident.encode(values[:, :, :take]))
            keys, values = keys[:, :, take:], values[:, :, take:]
        left = keys.shape[2]  # after the sinks
        direct = left >= self._flush_at and self._direct()
        n = self._encode_direct(keys, values, self.offset - left) if direct else 0
        if n < left:
            if n:
                keys, values = keys[:, :, n:], values[:, :, n:]
            self._win[0].append(self._ident.encode(keys))
            self._win[1].append(self._ident.encode(values))
        self._flush()
        if self.policy is not None:
            self.policy.after_update(self, start)
        if t > self.fused_above and self.eval_chunks:
            # a prefill chunk: its codes evaluated now, layer by layer, so that the device
            # frees each layer's fp16 keys, values and encode intermediates before the next
            # layer's exist (the graph of a whole chunk otherwise holds every layer's)
            mx.eval([a for s in self._stores() for a in s.arrays()])
        if self.ragged:
            _require_routing()
            return new  # unused: routed attention reads the cache itself
        if not self.fetch_decoded and _routing_on():
            return new  # unused: routed attention reads the cache itself
        return self.keys_and_values()

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

    def _write_window(self, keys: mx.array, values: mx.array) -> bool:
        """A decode step's fast path: with the sinks full, no policy and no calibration hook,
        tokens that leave the window below the flush quantum are written into its buffer in
        place and nothing else happens (what the general path would do, without its checks
        and records). Returns False where the general path must run."""
        win_k, win_v = self._win
        if (
            self._dims is None
            or self.policy is not None
            or self._sink[0].tokens < self.sinks
            or type(self).before_coding is not VeloxCache.before_coding
            or not isinstance(keys, mx.array)
            or not isinstance(values, mx.array)
            or keys.ndim != 4
            or values.ndim != 4
            or keys.dtype != self._dtype
            or values.dtype != self._dtype
        ):
            return False
        (b, h, t, dk), (vb, vh, vt, dv) = keys.shape, values.shape
        n = win_k.tokens
        if (
            (b, h, dk, dv) != self._dims
            or (vb, vh, vt) != (b, h, t)
            or t == 0
            or n + t - self._keep >= self._flush_at
            or n + t > win_k.capacity
        ):
            return False
        wk, wv = win_k.buf.data["x"], win_v.buf.data["x"]
        wk[:, :, n : n + t] = keys
        wv[:, :, n : n + t] = values
        win_k.tokens += t
        win_v.tokens += t
        self.offset += t
        return True

    def _direct(self) -> bool:
        """Whether new tokens go straight into tier 0 (no window, nothing waiting in it, and
        no calibration hook): the same records as passing through the window, without
        storing them there first."""
        return (
            self.window == 0
            and self._win[0].tokens == 0
            and type(self).before_coding is VeloxCache.before_coding
        )

    def _encode_direct(self, keys: mx.array, values: mx.array, pos0: int) -> int:
        """Encode the whole codec blocks of ``keys``/``values`` (absolute positions from
        ``pos0``) into tier 0; returns how many tokens that took (the rest, less than a
        block, waits in the window)."""
        first = self.tiers[0]
        block = _lcm(first.key_codec.block, first.value_codec.block)
        t = keys.shape[2]
        n = t // block * block
        if n == 0:
            return 0
        if n < t:
            keys, values = keys[:, :, :n], values[:, :, :n]
        pos = mx.arange(pos0, pos0 + n, dtype=mx.int32)
        self._append_body(
            first.key_codec.encode(keys, pos), first.value_codec.encode(values, pos), pos
        )
        return n

    def before_coding(self) -> bool:
        """Hook run on every update before window overflow moves into the coded tiers.

        Methods that fit their codecs on stored tokens (calibration) override it: fit from
        the window when it holds enough tokens and return True, or return False to keep every
        token in the window for now (nothing moves this update). The default moves at once.
        """
        return True

    def _quantum(self) -> int:
        """Tokens the window passes to tier 0 at once: ``flush`` in whole codec blocks."""
        first = self.tiers[0]
        return _lcm(self.flush, _lcm(first.key_codec.block, first.value_codec.block))

    def _flush(self) -> None:
        """Move window overflow into tier 0 (once it reaches the flush quantum) and tier
        overflow down the tiers."""
        if not self.before_coding():
            return
        first = self.tiers[0]
        block = _lcm(first.key_codec.block, first.value_codec.block)
        over = self._win[0].tokens - self._keep
        n = over // block * block if over >= self._flush_at else 0
        if n > 0:
            pos0 = self.offset - self._win[0].tokens
            pos = mx.arange(pos0, pos0 + n, dtype=mx.int32)
            wk, wv = self._win[0].view(), self._win[1].view()
            self._append_body(
                first.key_codec.encode(wk.slice(0, n).data["x"], pos),
                first.value_codec.encode(wv.slice(0, n).data["x"], pos),
                pos,
            )
            self._win[0].drop_front(n)
            self._win[1].drop_front(n)
        for i in range(len(self.tiers) - 1):
            src, dst = self.tiers[i], self.tiers[i + 1]
            blk = _lcm(
                _lcm(src.key_codec.block, src.value_codec.block),
                _lcm(dst.key_codec.block, dst.value_codec.block),
            )
            over = self._tier[i][0].tokens - src.span
            n = over // blk * blk
            if n <= 0:
                continue
            kp = self._tier[i][0].view().slice(0, n)
            vp = self._tier[i][1].view().slice(0, n)
            pos0 = self._body_start(i)
            pos = mx.arange(pos0, pos0 + n, dtype=mx.int32)
            k = src.key_codec.decode(kp).astype(self._dtype)
            v = src.value_codec.decode(vp).astype(self._dtype)
            self._tier[i + 1][0].append(dst.key_codec.encode(k, pos))
            self._tier[i + 1][1].append(dst.value_codec.encode(v, pos))
            self._tier[i][0].drop_front(n)
            self._tier[i][1].drop_front(n)

    def _body_start(self, i: int) -> int:
        """Absolute position of the oldest token of tier ``i`` (no eviction assumed)."""
        after = self._win[0].tokens + sum(self._tier[j][0].tokens for j in range(i + 1))
        return self.offset - after

    def segments(self) -> list[Segment]:
        """Stored tokens in temporal order, as (codec, record) pairs for keys and values."""
        if self.ragged:
            raise ValueError("per-head budgets: segments differ by head (see _head_segments)")
        out = []
        pairs = [(self._sink, self._ident, self._ident)]
        pairs += [
            (self._tier[i], t.key_codec, t.value_codec)
            for i, t in reversed(list(enumerate(self.tiers)))
        ]
        pairs += [(self._win, self._ident, self._ident)]
        for (ks, vs), kc, vc in pairs:
            k = ks.view()
            if k is not None:
                out.append(Segment(kc, k, vc, vs.view()))
        return out

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """Every stored token decoded, in the input dtype (lazy: costs nothing unless used)."""
        segs = self.segments()
        if not segs:
            raise ValueError("the cache is empty")
        return decode_segments(segs, self._io_dtype)

    def attend(
        self, queries: mx.array, scale: float, mask=None, sinks: mx.array | None = None
    ) -> mx.array:
        """Attention of ``queries`` over every stored token, one joint softmax.

        Shapes:
            queries ``(B, Hq, L, Dk)``; returns ``(B, Hq, L, Dv)``.
        """
        if self._dims is not None:
            b, h, dk, _ = self._dims
            qs = tuple(getattr(queries, "shape", ()))
            if len(qs) != 4 or qs[0] != b or qs[1] % h or qs[3] != dk:
                raise ValueError(
                    f"attend: queries {qs} must be (batch={b}, a multiple of {h} heads, L, "
                    f"key_dim={dk})"
                )
        if self.policy is not None:
            self.policy.observe(self, queries, scale)
        if self.ragged:
            return self._attend_ragged(queries, scale, mask, sinks)
        lq = queries.shape[2]
        if lq <= self.fused_above and (mask is None or lq == 1) and sinks is None:
            out = self._planned(self, queries, scale)
            if out is not None:
                return out
        return attend(queries, self.segments(), scale, mask, sinks, self.fused_above)

    def size(self) -> int:
        """Stored tokens (the widest head's, with per-head budgets)."""
        body = max(self.body_sizes(), default=0) if self.ragged else 0
        return self.protected() + sum(s[0].tokens for s in self._tier) + body

    def empty(self) -> bool:
        return self.size() == 0

    def is_trimmable(self) -> bool:
        """Whether :meth:`trim` leaves exactly the cache that never stored the trimmed tokens,
        for any count (mlx-lm asks before speculative decoding and before reusing a longer
        prompt cache; False makes it refuse or prefill instead).

        True when nothing is evicted (no retention policy), no codec is fitted on the stored
        tokens (``before_coding``), and every token is either kept as given (no codec) or
        coded alone the moment it arrives: one tier, ``window=0``,
        ``flush=1`` and codecs of one token a block (``uniform:bits=4,flush=1``, say).
        Otherwise a trim past the fp16 tokens would decode coded tokens back into the window,
        which the cache that never saw the trimmed tokens would hold as given; :meth:`trim`
        still does that when called.
        """
        if self.policy is not None or self.ragged:
            return False
        if type(self).before_coding is not VeloxCache.before_coding:
            return False  # codecs fitted on the stored tokens: a trim cannot undo a fit
        t = self.tiers[0]
        if all(isinstance(c, Identity) for x in self.tiers for c in (x.key_codec, x.value_codec)):
            return True  # nothing is coded: every token stays as given
        return (
            len(self.tiers) == 1
            and self.window == 0
            and self.flush == 1
            and t.key_codec.block == 1
            and t.value_codec.block == 1
        )

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens; returns ``n``.

        Raises ``ValueError`` when ``n`` exceeds the stored tokens (or is negative).
        """
        self._planned.clear()
        check_int("n", n, minimum=0)
        if n > self.size():
            raise ValueError(f"cannot trim {n} tokens: the cache stores {self.size()}")
        if self.ragged and n > self._win[0].tokens:
            raise ValueError(
                f"cannot trim {n} tokens: with per-head budgets only the {self._win[0].tokens} "
                "window tokens can be trimmed"
            )
        left = n
        left = _trim_store(self._win, left)
        for i in range(len(self.tiers)):
            if left == 0:
                break
            left = self._trim_tier(i, left)
        if left:
            _trim_store(self._sink, left)
        self.offset -= n
        return n

    def _trim_tier(self, i: int, n: int) -> int:
        ks, vs = self._tier[i]
        if n >= ks.tokens:
            rest = n - ks.tokens
            ks.truncate(0), vs.truncate(0)
            if i == 0 and self._pos is not None:
                self._pos.truncate(0)
            return rest
        t = self.tiers[i]
        block = _lcm(t.key_codec.block, t.value_codec.block)
        keep = ks.tokens - n
        cut = keep // block * block
        if cut != keep:
            # a block is split: decode its surviving tokens back into the window
            k = t.key_codec.decode(ks.view().slice(cut, cut + block)).astype(self._dtype)
            v = t.value_codec.decode(vs.view().slice(cut, cut + block)).astype(self._dtype)
            ks.truncate(cut), vs.truncate(cut)
            win_k, win_v = self._win[0].view(), self._win[1].view()
            self._win[0].replace(Packed.concat([self._ident.encode(k[:, :, : keep - cut]), win_k]))
            self._win[1].replace(Packed.concat([self._ident.encode(v[:, :, : keep - cut]), win_v]))
        else:
            ks.truncate(keep), vs.truncate(keep)
        if i == 0 and self._pos is not None:
            self._pos.truncate(ks.tokens)
        return 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The causal mask of ``N`` new queries over the stored tokens (mlx-lm semantics)."""
        return create_attention_mask(N, self.size(), return_array, window_size)

    # -- memory -----------------------------------------------------------------------------
    def _stores(self) -> list[PackedStore]:
        return list(self._named_stores().values())

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
    def from_state(cls, state) -> VeloxCache:
        if not state or not isinstance(state[0], str):
            raise ValueError("VeloxCache state must start with its JSON meta string")
        cache = cls.from_config(json.loads(state[0])["config"])
        cache.state = state
        return cache

    def copy(self) -> VeloxCache:
        """An independent cache with the same settings and contents (arrays are shared: MLX
        arrays are values, and a write into a shared buffer copies it)."""
        out = type(self).from_state(self.state)
        out.fetch_decoded = self.fetch_decoded
        return out

    def __deepcopy__(self, memo) -> VeloxCache:
        # mlx-lm's batch generator and server deep-copy prompt caches
        out = self.copy()
        memo[id(self)] = out
        return out

    def _named_stores(self) -> dict[str, PackedStore]:
        out = {
            "sink.k": self._sink[0],
            "sink.v": self._sink[1],
            "win.k": self._win[0],
            "win.v": self._win[1],
        }
        for i, (k, v) in enumerate(self._tier):
            out[f"tier{i}.k"], out[f"tier{i}.v"] = k, v
        if self._pos is not None:
            out["pos"] = self._pos
        for i, (k, v, p) in enumerate(self._heads or []):
            out[f"head{i}.k"], out[f"head{i}.v"], out[f"head{i}.pos"] = k, v, p
        return out

    def _named_codecs(self) -> dict[str, Codec]:
        out = {}
        for i, t in enumerate(self.tiers):
            out[f"tier{i}.k"], out[f"tier{i}.v"] = t.key_codec, t.value_codec
        return out

    def _state_dict(self) -> tuple[dict, dict[str, mx.array]]:
        arrays: dict[str, mx.array] = {}
        stores = {}
        for name, s in self._named_stores().items():
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
            "dims": self._dims,
            "dtype": None if self._dtype is None else _dtype_name(self._dtype),
            "stores": stores,
            "arrays": list(arrays),
            "ragged": len(self._heads) if self.ragged else None,
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
        self._dims = None if meta["dims"] is None else tuple(meta["dims"])
        dt = meta["dtype"]
        if dt is not None and getattr(mx, dt, None) not in FLOAT_DTYPES:
            raise ValueError(f"VeloxCache state has an unsupported dtype {dt!r}")
        self._dtype = None if dt is None else getattr(mx, dt)
        self.storage_dtype = _dtype_from(meta.get("storage_dtype"))
        self._io_dtype = _dtype_from(meta.get("io_dtype")) or self._dtype
        if meta.get("ragged"):
            if self._pos is None:
                raise ValueError("VeloxCache state has per-head storage but no retention policy")
            self._heads = [
                [PackedStore(self.step) for _ in range(3)] for _ in range(meta["ragged"])
            ]
        named = self._named_stores()
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
        if self._dims is not None and self.size() and self._win[0].view() is not None:
            got = self._win[0].view().data["x"].shape
            if (got[0], got[1], got[3]) != (self._dims[0], self._dims[1], self._dims[2]):
                raise ValueError("VeloxCache state: window arrays disagree with the recorded dims")

    # -- batching ---------------------------------------------------------------------------
    def filter(self, batch_indices) -> None:
        """Keep only the given batch rows (in place)."""
        self._planned.clear()
        idx = mx.array(batch_indices) if not isinstance(batch_indices, mx.array) else batch_indices
        for s in self._stores():
            s.map_batch(lambda a: a[idx])
        if self._dims is not None:
            self._dims = (int(idx.size), *self._dims[1:])
        if self.policy is not None:
            self.policy.filter_batch(idx)
        for c in self._distinct_codecs():
            c.filter_batch(idx)

    def extract(self, idx: int) -> VeloxCache:
        """A new single-sequence cache holding batch row ``idx``."""
        out = self.copy()
        out.filter([idx])
        return out

    def extend(self, other: VeloxCache) -> None:
        """Append the batch rows of ``other`` (same settings and same stored layout)."""
        self._planned.clear()
        if type(other) is not type(self) or other.config() != self.config():
            raise ValueError("extend: both caches must have the same class and settings")
        mine, theirs = self._named_stores(), other._named_stores()
        for name, s in mine.items():
            if s.tokens != theirs[name].tokens or self.offset != other.offset:
                raise ValueError(
                    "extend: caches must hold the same tokens in every segment (equal-length "
                    "sequences); velox caches do not pad"
                )
        for name, s in mine.items():
            o = theirs[name].view()
            if o is not None:
                s.replace(s.view().map(lambda k, a, o=o: mx.concatenate([a, o.data[k]], axis=0)))
        if self._dims is not None:
            self._dims = (self._dims[0] + other._dims[0], *self._dims[1:])
        if self.policy is not None:
            self.policy.extend_batch(other.policy)
        theirs = other._distinct_codecs()
        for i, c in enumerate(self._distinct_codecs()):
            c.extend_batch(theirs[i])

    @classmethod
    def stack(cls, caches: list[VeloxCache]) -> VeloxCache:
        """One cache holding the rows of several caches of equal length and layout (raises
        otherwise): one kernel launch attends all of them."""
        if not caches:
            raise ValueError("stack needs at least one cache")
        out = caches[0].copy()
        for c in caches[1:]:
            out.extend(c)
        return out

    @classmethod
    def merge(cls, caches: list[VeloxCache]):
        """mlx-lm's batch protocol: a :class:`~velox_core.cache.batch.VeloxBatch` of the
        caches, whatever their lengths (equal-length ones share one cache)."""
        return cls._batch_class.merge(caches)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()} offset={self.offset} size={self.size()}>"


def _routing_on() -> bool:
    """Whether attention is routed to velox caches now (:mod:`velox_core.routing`)."""
    return is_routed()


def _require_routing() -> None:
    if not _routing_on():
        raise ValueError(
            "this cache keeps per-head budgets, which only velox attention can read: "
            "run the model inside velox_core.routed(model) (or generate())"
        )


def _dtype_name(dt: mx.Dtype) -> str:
    return str(dt).split(".")[-1]


def _dtype_from(name: str | None) -> mx.Dtype | None:
    if name is None:
        return None
    dt = getattr(mx, name, None)
    if dt not in FLOAT_DTYPES:
        raise ValueError(f"VeloxCache state has an unsupported dtype {name!r}")
    return dt


def _spec(obj) -> dict[str, Any]:
    return {"name": obj.name, "config": obj.config()}


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def _trim_store(pair: tuple[PackedStore, PackedStore], n: int) -> int:
    k, v = pair
    take = min(n, k.tokens)
    k.truncate(k.tokens - take), v.truncate(v.tokens - take)
    return n - take
