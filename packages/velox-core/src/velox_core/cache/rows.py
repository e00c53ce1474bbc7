"""The batch rows of one :class:`~velox_core.cache.VeloxCache`: what mlx-lm's batching calls.

:class:`BatchRowsMixin` keeps some rows (``filter``), takes one out (``extract``), appends
another cache's rows (``extend``, ``stack``: equal lengths and layouts only, velox caches do
not pad) and joins caches of any lengths (``merge``, a
:class:`~velox_core.cache.batch.VeloxBatch`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import mlx.core as mx

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__: list[str] = []


class BatchRowsMixin:
    """Batch-row operations of a VeloxCache (mixed in; uses its stores, codecs and policy)."""

    # the batched cache merge() makes: velox_core.cache.batch.VeloxBatch, set by the cache
    # package when it imports both (the batch module builds on the cache, never back)
    _batch_class: ClassVar[type]

    def filter(self, batch_indices) -> None:
        """Keep only the given batch rows (in place)."""
        self._planned.clear()
        idx = mx.array(batch_indices) if not isinstance(batch_indices, mx.array) else batch_indices
        for s in self._stores():
            s.map_batch(lambda a: a[idx])
        if self.stored.dims is not None:
            self.stored.dims = (int(idx.size), *self.stored.dims[1:])
        if self.policy is not None:
            self.policy.filter_batch(idx)
        for c in self._distinct_codecs():
            c.filter_batch(idx)

    def extract(self, idx: int) -> Self:
        """A new single-sequence cache holding batch row ``idx``."""
        out = self.copy()
        out.filter([idx])
        return out

    def extend(self, other: Self) -> None:
        """Append the batch rows of ``other`` (same settings and same stored layout)."""
        self._planned.clear()
        if type(other) is not type(self) or other.config() != self.config():
            raise ValueError("extend: both caches must have the same class and settings")
        mine, theirs = self.named_stores(), other.named_stores()
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
        if self.stored.dims is not None:
            self.stored.dims = (self.stored.dims[0] + other.stored.dims[0], *self.stored.dims[1:])
        if self.policy is not None:
            self.policy.extend_batch(other.policy)
        theirs = other._distinct_codecs()
        for i, c in enumerate(self._distinct_codecs()):
            c.extend_batch(theirs[i])

    @classmethod
    def stack(cls, caches: list[Self]) -> Self:
        """One cache holding the rows of several caches of equal length and layout (raises
        otherwise): one kernel launch attends all of them."""
        if not caches:
            raise ValueError("stack needs at least one cache")
        out = caches[0].copy()
        for c in caches[1:]:
            out.extend(c)
        return out

    @classmethod
    def merge(cls, caches: list[Self]):
        """mlx-lm's batch protocol: a :class:`~velox_core.cache.batch.VeloxBatch` of the
        caches, whatever their lengths (equal-length ones share one cache)."""
        return cls._batch_class.merge(caches)
