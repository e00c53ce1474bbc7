"""``VeloxBatch``: one layer's velox caches of several sequences, as mlx-lm batches them.

mlx-lm's ``batch_generate``, ``BatchGenerator`` and server make one cache per sequence, then
``merge`` them into a batched cache and drive it through ``prepare`` / ``finalize`` (prompts
of different lengths, right-padded), ``filter`` (finished sequences leave), ``extend`` (new
ones join) and ``extract`` (a sequence's cache for the prompt cache). mlx-lm's
``BatchKVCache`` stores every row padded to the longest and masks the padding; a velox cache
cannot pad cheaply (codes are coded in blocks and flushes that would shift by the padding),
so a ``VeloxBatch`` keeps **groups**: each group is an ordinary :class:`VeloxCache` whose rows
hold the same number of tokens in the same layout (batched in one cache, one kernel launch a
decode step), and rows of other lengths live in groups of their own. Each row's tokens are
stored and coded exactly as a single-sequence cache would store them: padding is never
stored (during a padded prompt each group takes only its rows' real tokens), so a batched
run attends the same codes as the sequences' own runs.

Rows are in group order: the batch's rows ``0 .. b0-1`` are group 0's, and so on. ``offset``
is an int while every row has the same length and a ``(B,)`` int32 array otherwise, as
``BatchKVCache`` gives it to the model's RoPE. With more than one group (or a padded prompt)
the model's attention must be routed to velox (``velox_core.routed(model)``): there is no
single padded tensor of keys to hand back.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .velox import VeloxCache

__all__: list[str] = []


def _rows(cache: VeloxCache) -> int | None:
    """Batch rows a cache holds (None while empty: an empty cache takes any batch)."""
    return cache.stored.batch


def _layout(cache: VeloxCache) -> tuple:
    """What two caches must share to be one group: settings, offset, tokens per store, and
    the policy's per-sequence decisions (:meth:`RetentionPolicy.batch_key
    <velox_core.policy.base.RetentionPolicy.batch_key>`)."""
    stores = tuple(sorted((n, s.tokens) for n, s in cache.named_stores().items()))
    dims = None if cache.stored.dims is None else cache.stored.dims[1:]
    key = None if cache.policy is None else cache.policy.batch_key()
    return (repr(cache.config()), cache.offset, stores, dims, cache.ragged, repr(key))


class VeloxBatch:
    """Groups of equal-layout velox caches of one layer, batched along rows.

    Args:
        groups: caches in row order, each with its row count in ``rows``.
        rows: rows per group (1 for an empty single-sequence cache).

    Made by :meth:`VeloxCache.merge` (mlx-lm's batch protocol), not by hand.
    """

    def __init__(self, groups: list[VeloxCache], rows: list[int]):
        if len(groups) != len(rows) or not groups:
            raise ValueError("VeloxBatch needs one row count per group, and a group at least")
        self.groups = groups
        self.rows = rows
        # during a padded prompt: each row's real token range [start, end) in the padded
        # input and the padded tokens seen since prepare; one (start, end) per group
        self._span: list[tuple[int, float]] | None = None
        self._seen = 0
        self._step: list[tuple[int, int]] | None = None  # this call's slice per group

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def merge(cls, caches: list[Any]) -> VeloxBatch:
        """One batched cache from single-sequence (or batched) caches of one layer.

        Consecutive caches with the same settings and layout (equal lengths) share a group;
        the inputs are copied, never changed.
        """
        if not caches:
            raise ValueError("merge needs at least one cache")
        parts: list[tuple[VeloxCache, int]] = []
        for c in caches:
            if isinstance(c, VeloxBatch):
                parts += [(g.copy(), r) for g, r in zip(c.groups, c.rows)]
            elif isinstance(c, VeloxCache):
                parts.append((c.copy(), _rows(c) or 1))
            else:
                raise TypeError(f"merge: expected velox caches, got {type(c).__name__}")
        groups, rows = [parts[0][0]], [parts[0][1]]
        for g, r in parts[1:]:
            if _layout(g) == _layout(groups[-1]) and not g.ragged and _fits(groups[-1], g):
                groups[-1].extend(g)
                rows[-1] += r
            else:
                groups.append(g)
                rows.append(r)
        return cls(groups, rows)

    def __deepcopy__(self, memo) -> VeloxBatch:
        out = VeloxBatch([g.copy() for g in self.groups], list(self.rows))
        out._span, out._seen = (None if self._span is None else list(self._span)), self._seen
        memo[id(self)] = out
        return out

    # -- rows ---------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return sum(self.rows)

    def _bounds(self) -> list[tuple[int, int]]:
        out, r0 = [], 0
        for r in self.rows:
            out.append((r0, r0 + r))
            r0 += r
        return out

    def _locate(self, row: int) -> tuple[int, int]:
        for i, (r0, r1) in enumerate(self._bounds()):
            if r0 <= row < r1:
                return i, row - r0
        raise IndexError(f"batch row {row} out of range for {self.batch_size} rows")

    @property
    def offset(self) -> int | mx.array:
        """Tokens each row holds, as the RoPE offset of its next token: an int while all rows
        agree, else ``(B,)`` int32 (during a left-padded prompt, shifted by the padding of
        this chunk so that a row's first real token gets its own position)."""
        if self._span is None and len(self.groups) == 1:
            return self.groups[0].offset  # the common case, read twice per layer and step
        per = []
        for i, g in enumerate(self.groups):
            off = g.offset
            if self._span is not None:
                off -= max(0, self._span[i][0] - self._seen)
            per += [off] * self.rows[i]
        if all(p == per[0] for p in per):
            return per[0]
        return mx.array(per, dtype=mx.int32)

    def parts(self) -> list[tuple[VeloxCache, tuple[int, int], tuple[int, int] | None]]:
        """Each group with its rows ``(r0, r1)`` in the batch and the token range ``(a, e)``
        of the newest ``update_and_fetch``'s input that it stored (None before any update of
        a padded prompt, or where it stored the whole input): what a caller that sees the
        batch's padded input (the model's hidden states, say) hands each group's rows."""
        whole = self._span is None and len(self.groups) == 1
        step = None if whole or self._step is None else self._step
        return [
            (g, bounds, None if step is None else step[i])
            for i, (g, bounds) in enumerate(zip(self.groups, self._bounds()))
        ]

    # -- mlx-lm's batch protocol --------------------------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Announce a padded prompt: row ``i``'s real tokens are the padded input's
        ``[left_padding[i], left_padding[i] + lengths[i])`` (``right_padding`` is what
        follows them). Rows with different ranges are split into groups of their own."""
        b = self.batch_size
        lp = [0] * b if left_padding is None else [int(x) for x in _as_list(left_padding)]
        if len(lp) != b or any(x < 0 for x in lp):
            raise ValueError(f"prepare: left_padding must be {b} counts >= 0, got {lp}")
        if lengths is None:
            if right_padding is not None and any(int(x) for x in _as_list(right_padding)):
                raise ValueError("prepare: right_padding needs lengths")
            ends = [float("inf")] * b
        else:
            ln = [int(x) for x in _as_list(lengths)]
            if len(ln) != b or any(x < 0 for x in ln):
                raise ValueError(f"prepare: lengths must be {b} counts >= 0, got {ln}")
            ends = [s + n for s, n in zip(lp, ln)]
        spans = list(zip(lp, ends))
        if all(s == (0, float("inf")) for s in spans):
            return
        groups, rows, per_group = [], [], []
        for (r0, r1), g in zip(self._bounds(), self.groups):
            # runs of consecutive rows with the same range (rows keep their order)
            runs = [[0]]
            for i in range(1, r1 - r0):
                if spans[r0 + i] == spans[r0 + runs[-1][0]]:
                    runs[-1].append(i)
                else:
                    runs.append([i])
            for local in runs:
                part = g
                if len(runs) > 1:
                    part = g.copy()
                    if _rows(g) is not None:
                        part.filter(local)
                groups.append(part)
                rows.append(len(local))
                per_group.append(spans[r0 + local[0]])
        self.groups, self.rows = groups, rows
        self._span, self._seen = per_group, 0

    def finalize(self) -> None:
        """End a padded prompt (every row has taken its real tokens)."""
        self._span, self._step = None, None

    def filter(self, batch_indices) -> None:
        """Keep the given rows, in the given order (in place)."""
        idx = _as_list(batch_indices)
        runs: list[tuple[int, list[int]]] = []
        for row in idx:
            gi, local = self._locate(int(row))
            if runs and runs[-1][0] == gi and local > runs[-1][1][-1]:
                runs[-1][1].append(local)
            else:
                runs.append((gi, [local]))
        uses: dict[int, int] = {}
        for gi, _ in runs:
            uses[gi] = uses.get(gi, 0) + 1
        groups, rows, spans = [], [], []
        for gi, locals_ in runs:
            g = self.groups[gi]
            uses[gi] -= 1
            whole = locals_ == list(range(self.rows[gi]))
            if not whole:
                g = g.copy() if uses[gi] else g
                if _rows(g) is not None:
                    g.filter(locals_)
            elif uses[gi]:
                g = g.copy()
            groups.append(g)
            rows.append(len(locals_))
            if self._span is not None:
                spans.append(self._span[gi])
        if not groups:
            raise ValueError("filter: keep at least one row (mlx-lm clears an empty batch)")
        self.groups, self.rows = groups, rows
        self._span = spans if self._span is not None else None

    def extend(self, other: Any) -> None:
        """Append (copies of) the rows of another batched or single-sequence velox cache."""
        if self._span is not None:
            raise ValueError("extend: finish the padded prompt first (finalize)")
        other = other if isinstance(other, VeloxBatch) else VeloxBatch.merge([other])
        if other._span is not None:
            raise ValueError("extend: the other cache is inside a padded prompt")
        self.groups += [g.copy() for g in other.groups]
        self.rows += other.rows

    def extract(self, idx: int) -> VeloxCache:
        """Row ``idx`` as a new single-sequence cache."""
        gi, local = self._locate(int(idx))
        g = self.groups[gi]
        return g.copy() if self.rows[gi] == 1 else g.extract(local)

    # -- the model's calls ----------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store new post-RoPE tokens, each group its rows' (real) tokens.

        Shapes: keys ``(B, H, N, Dk)``, values ``(B, H, N, Dv)``. With one group and no
        padded prompt, returns what that cache returns; else the new tokens as given, for
        the routed attention (which reads the caches, not them).
        """
        b, n = keys.shape[0], keys.shape[2]
        if b != self.batch_size:
            raise ValueError(f"update_and_fetch: {b} rows for a batch of {self.batch_size}")
        if self._span is None and len(self.groups) == 1:
            return self.groups[0].update_and_fetch(keys, values)
        if not self.groups[0].routed:
            raise ValueError(
                "a batch of velox caches with rows of different lengths needs velox "
                "attention: run the model inside velox_core.routed(model)"
            )
        step = []
        for gi, ((r0, r1), g) in enumerate(zip(self._bounds(), self.groups)):
            a, e = 0, n
            if self._span is not None:
                s, t = self._span[gi]
                a = min(max(s - self._seen, 0), n)
                e = int(min(max(t - self._seen, a), n))
            if e > a:
                g.update_and_fetch(keys[r0:r1, :, a:e], values[r0:r1, :, a:e])
            step.append((a, e))
        if self._span is not None:
            self._seen += n
        self._step = step
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        """Attention of each group's queries over its own tokens.

        Shapes: queries ``(B, Hq, L, Dk)``; returns ``(B, Hq, L, Dv)``. During a padded
        prompt the rows' padding queries get zeros.
        """
        if len(self.groups) == 1 and self._step is None:
            return self.groups[0].attend(queries, scale, mask, sinks)
        if mask is not None and not isinstance(mask, str):
            raise ValueError(
                "a batch of velox caches of different lengths takes the causal mask only "
                "(make_mask's), not an array mask"
            )
        lq = queries.shape[2]
        step = self._step or [(0, lq)] * len(self.groups)
        outs, pending = [], []
        for gi, ((r0, r1), g) in enumerate(zip(self._bounds(), self.groups)):
            a, e = step[gi]
            if e <= a:
                pending.append(gi)
                outs.append(None)
                continue
            o = g.attend(queries[r0:r1, :, a:e], scale, mask if e - a > 1 else None, sinks)
            if (a, e) != (0, lq):
                pad = [(0, 0), (0, 0), (a, lq - e), (0, 0)]
                o = mx.pad(o, pad)
            outs.append(o)
        like = next(o for o in outs if o is not None) if len(pending) < len(outs) else None
        for gi in pending:
            r = self.rows[gi]
            dv = like.shape[-1] if like is not None else queries.shape[-1]
            outs[gi] = mx.zeros((r, queries.shape[1], lq, dv), dtype=queries.dtype)
        return mx.concatenate(outs, axis=0)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The causal mask (mlx-lm semantics); for groups of different lengths, ``"causal"``
        (each group aligns it to its own tokens) or None for one query."""
        if len(self.groups) == 1 and self._span is None:
            return self.groups[0].make_mask(N, return_array, window_size)
        if return_array or window_size is not None:
            raise ValueError(
                "a batch of velox caches of different lengths has no single mask array; "
                "this model asks for one (sliding-window attention?)"
            )
        return None if N == 1 else "causal"

    # -- the rest of the cache interface ------------------------------------------------------
    @property
    def state(self) -> list:
        """Every group's state (what ``mx.eval`` needs); save single-sequence caches instead."""
        return [g.state for g in self.groups]

    @property
    def meta_state(self):
        raise TypeError(
            "a batched velox cache is not saved as one; extract(i) each sequence and save those"
        )

    def size(self) -> int:
        return max(g.size() for g in self.groups)

    def empty(self) -> bool:
        return all(g.empty() for g in self.groups)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def logical_nbytes(self) -> int:
        return sum(g.logical_nbytes for g in self.groups)

    def is_trimmable(self) -> bool:
        return all(g.is_trimmable() for g in self.groups)

    def trim(self, n: int) -> int:
        for g in self.groups:
            g.trim(n)
        return n

    def describe(self) -> str:
        return f"{len(self.groups)} group(s) of {self.rows} rows: {self.groups[0].describe()}"

    def __repr__(self) -> str:
        return f"<VeloxBatch {self.describe()}>"


def _fits(a: VeloxCache, b: VeloxCache) -> bool:
    """Whether ``b``'s rows can join ``a``'s cache (empty caches join empty ones only)."""
    return (a.stored.dims is None) == (b.stored.dims is None)


def _as_list(x) -> list:
    if isinstance(x, mx.array):
        return x.tolist()
    return list(x)
