"""Token eviction inside :class:`~velox_core.cache.VeloxCache`: the machinery policies drive.

A retention policy scores the coded *body* (the tokens between the sinks and the window) and
names the tokens to keep; the cache gathers them (:meth:`RetentionMixin.evict`), so evicted
tokens leave memory. Keys are stored post-RoPE and ``offset`` stays the absolute count of
tokens seen, so nothing is renumbered. The body's absolute positions are kept beside it
(int32, counted in ``nbytes``) for policies that use them.

Budgets may differ per head: a keep list of one index array per head switches the body to
*per-head storage* (one record per KV head, batch 1), so moving budget between heads costs
no padding. Attention then runs head by head over that head's sinks, body and window.
"""

from __future__ import annotations

import mlx.core as mx

from ..codec.base import Packed
from .attention import Segment, attend, attend_weights
from .store import PackedStore

__all__: list[str] = []


class RetentionMixin:
    """Eviction and per-head storage for VeloxCache (mixed in; uses its stores)."""

    def _init_retention(self) -> None:
        if self.policy is None:
            return
        if len(self.tiers) != 1:
            raise ValueError("a retention policy works on a single coded tier, not age tiers")
        t = self.tiers[0]
        for c, what in ((t.key_codec, "key"), (t.value_codec, "value")):
            if c.block != 1 or not getattr(c, "per_head", True):
                raise ValueError(
                    f"retention policy {self.policy.name!r} needs a per-token, per-head {what} "
                    f"codec; {c.describe()} codes tokens in blocks of {c.block} or across heads"
                )
        self.stored.positions = PackedStore(self.step)

    # -- what policies see -------------------------------------------------------------------
    @property
    def ragged(self) -> bool:
        """True once per-head budgets differ (one record per KV head)."""
        stored = getattr(self, "stored", None)
        return stored is not None and stored.heads is not None

    def body_sizes(self) -> list[int]:
        """Body tokens per KV head."""
        if self.ragged:
            return [k.tokens for k, _, _ in self.stored.heads]
        h = self.stored.dims[1] if self.stored.dims else 0
        return [self.stored.coded[0][0].tokens] * h

    def protected(self) -> int:
        """Tokens a policy never evicts: the sinks and the window."""
        return self.stored.n_sink + self.stored.n_window

    @property
    def kv_heads(self) -> int | None:
        """KV heads of the stored tokens (None before the first update)."""
        return self.stored.dims[1] if self.stored.dims else None

    @property
    def key_dim(self) -> int | None:
        """Channels of a stored key (None before the first update)."""
        return self.stored.dims[2] if self.stored.dims else None

    def set_body_values(self, start: int, values: mx.array) -> None:
        """Overwrite the values of body tokens ``[start, start + n)`` in every head, coded by
        the value codec (for a policy that merges values into the tokens it keeps, as
        velox-cam's does); keys and positions are untouched.

        The codec is given the positions of the first row and head (the tokens' positions
        wherever a cut kept the same tokens in every head).

        Shapes:
            values ``(B, H, n, Dv)``, any float dtype (stored in the cache's dtype).
        """
        if self.policy is None or self.ragged:
            raise ValueError(
                "set_body_values: needs a cache with a retention policy and one body record "
                "(not per-head budgets)"
            )
        if self.stored.dims is None:
            raise ValueError("set_body_values: the cache holds no tokens")
        b, h, _, dv = self.stored.dims
        if values.ndim != 4 or tuple(values.shape[:2]) != (b, h) or values.shape[3] != dv:
            raise ValueError(
                f"set_body_values: values {tuple(values.shape)} must be (batch={b}, "
                f"kv_heads={h}, n, value_dim={dv})"
            )
        n = values.shape[2]
        if not 0 <= start <= start + n <= self.stored.positions.tokens:
            raise ValueError(
                f"set_body_values: tokens [{start}, {start + n}) are not within the "
                f"{self.stored.positions.tokens} body tokens"
            )
        self._planned.clear()  # the coded segment changes: its decode plan with it
        # (tokens in use: read from the buffer itself, without a view of them)
        pos = self.stored.positions.buf.data["x"][0, 0, start : start + n, 0]
        codec = self.tiers[0].value_codec
        self.stored.coded[0][1].write(start, codec.encode(values.astype(self.stored.dtype), pos))

    # -- storing and evicting ------------------------------------------------------------------
    def _append_body(self, kp: Packed, vp: Packed, positions: mx.array) -> None:
        self._planned.clear()  # the coded segment changes: its decode plan with it
        if self.stored.positions is None:
            self.stored.coded[0][0].append(kp)
            self.stored.coded[0][1].append(vp)
            return
        b, h = self.stored.dims[:2]
        n = kp.tokens
        pos = mx.broadcast_to(positions.astype(mx.int32).reshape(1, 1, n, 1), (b, h, n, 1))
        if not self.ragged:
            ks, vs = self.stored.coded[0]
            ps = self.stored.positions
            if all(s.buf is not None and s.tokens + n <= s.buf.tokens for s in (ks, vs, ps)):
                # a decode step after a cut, which left the buffers room for the tokens stored
                # until the next one: written in place (the records are the codecs' own)
                ks.put(kp)
                vs.put(vp)
                ps.buf.data["x"][:, :, ps.tokens : ps.tokens + n] = pos
                ps.tokens += n
                return
            ks.append(kp)
            vs.append(vp)
            ps.append(Packed({"x": pos}, n))
            return
        for i, (ks, vs, ps) in enumerate(self.stored.heads):
            ks.append(kp.map(lambda _, a, i=i: a[:, i : i + 1]))
            vs.append(vp.map(lambda _, a, i=i: a[:, i : i + 1]))
            ps.append(Packed({"x": pos[:, i : i + 1]}, kp.tokens))

    def evict(self, keep) -> None:
        """Keep only the named body tokens (the rest leave memory).

        Args:
            keep: indices into the body, ascending (temporal order is kept): an int array
                ``(n,)`` shared by every head, ``(B, H, n)`` per head, or a list of one
                ``(n_h,)`` array per KV head (per-head budgets; batch 1 only).
        """
        self._planned.clear()
        if self.policy is None:
            raise ValueError("evict: this cache has no retention policy")
        if isinstance(keep, (list, tuple)):
            self._evict_ragged(list(keep))
            return
        if self.ragged:
            self._evict_ragged([keep] * len(self.stored.heads))
            return
        kv = self.stored.coded[0][0].view()
        if kv is None:
            return
        idx = keep.astype(mx.int32)
        if idx.ndim == 3 and idx.shape[:2] != kv.data[next(iter(kv.data))].shape[:2]:
            raise ValueError(
                f"evict: per-head index of shape {tuple(idx.shape)} does not match the body"
            )
        # room for the body until the next cut: with decode cuts every `every` tokens, the
        # kept tokens and `every` more (cut in place each time, no slack); else the kept ones
        every = self.policy.every
        room = None if every is None else idx.shape[-1] + every
        rows: dict = {}  # the gather's row indices, made once for the three stores
        for store in (*self.stored.coded[0], self.stored.positions):
            store.keep(idx, room, rows)

    def _evict_ragged(self, keep: list) -> None:
        b, h = self.stored.dims[:2]
        if len(keep) != h:
            raise ValueError(f"evict: {len(keep)} per-head index arrays for {h} KV heads")
        if b != 1:
            raise ValueError("per-head budgets store one record per head and need batch size 1")
        if not self.ragged:
            kv, vv, pv = self.stored.body()
            self.stored.heads = []
            for i in range(h):
                stores = [PackedStore(self.step) for _ in range(3)]
                for s, rec in zip(stores, (kv, vv, pv)):
                    if rec is not None:
                        s.replace(rec.map(lambda _, a, i=i: a[:, i : i + 1]))
                self.stored.heads.append(stores)
            for s in (*self.stored.coded[0], self.stored.positions):
                s.replace(None)
        every = self.policy.every  # each head's room until the next cut, as evict's
        for idx, stores in zip(keep, self.stored.heads):
            idx = idx.astype(mx.int32).reshape(-1)
            room = None if every is None else idx.size + every
            rows: dict = {}
            for s in stores:
                s.keep(idx, room, rows)

    # -- the policy sees each attention call ----------------------------------------------
    def _observed(self, queries: mx.array, scale: float, mask, sinks) -> mx.array | None:
        """Show the policy this call's queries. Where it scores tokens by this call's
        attention weights (:meth:`~velox_core.RetentionPolicy.wants_weights`) and the call
        is a few queries over one body record without sink logits, attend here on the
        reference path and hand it the weights (:meth:`~velox_core.RetentionPolicy.
        observe_weights`), returning the output; otherwise call
        :meth:`~velox_core.RetentionPolicy.observe` and return None (the cache attends)."""
        pol, view = self.policy, self.policy_view
        lq = queries.shape[2]
        if (
            self.stored.heads is None
            and sinks is None
            and lq <= self.fused_above
            and pol.wants_weights(lq)
        ):
            out, weights = attend_weights(queries, self.segments(), scale, mask)
            pol.observe_weights(view, queries, scale, weights)
            return out
        pol.observe(view, queries, scale)
        return None

    # -- attention over per-head storage ---------------------------------------------------------
    def _head_segments(self, i: int) -> list[Segment]:
        ident = self._ident
        out = []
        sink_k, sink_v = self.stored.sink[0].view(), self.stored.sink[1].view()
        if sink_k is not None:
            out.append(Segment(ident, _head(sink_k, i), ident, _head(sink_v, i)))
        ks, vs, _ = self.stored.heads[i]
        if ks.tokens:
            t = self.tiers[0]
            out.append(Segment(t.key_codec, ks.view(), t.value_codec, vs.view()))
        win_k, win_v = self.stored.window[0].view(), self.stored.window[1].view()
        if win_k is not None:
            out.append(Segment(ident, _head(win_k, i), ident, _head(win_v, i)))
        return out

    def _attend_ragged(self, queries: mx.array, scale: float, mask, sinks) -> mx.array:
        if mask is not None and not isinstance(mask, str):
            raise ValueError("per-head budgets support only the 'causal' mask (no mask arrays)")
        h = len(self.stored.heads)
        r = queries.shape[1] // h
        outs = []
        for i in range(h):
            qi = queries[:, i * r : (i + 1) * r]
            si = None if sinks is None else sinks[i * r : (i + 1) * r]
            segs = self._head_segments(i)
            outs.append(attend(qi, segs, scale, mask, si, self.fused_above, self.prefill_tile))
        return mx.concatenate(outs, axis=1)


def _head(p: Packed, i: int) -> Packed:
    return p.map(lambda _, a: a[:, i : i + 1])
