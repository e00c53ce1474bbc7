"""The codec protocol and the ``Packed`` record.

A codec turns a block of vectors ``(B, H, T, D)`` into a :class:`Packed` record and back.
Every byte it keeps for those tokens is an array of the record, so its size is measured.
What a codec fits once (a rotation, codebooks, a channel order) is its *state*, also arrays,
also counted. A codec may compute attention in the compressed domain: :meth:`Codec.scores`
for ``q @ k.T`` and :meth:`Codec.mix` for ``p @ v``; the defaults decode first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import mlx.core as mx

from ..configured import Configured
from ..kernels.joint import KernelSide
from ..kernels.records import CodeRecord

__all__: list[str] = []


@dataclass
class Packed:
    """Coded tokens: named MLX arrays whose axis 2 runs over tokens (or blocks of tokens).

    Attributes:
        data: the arrays. Each has shape ``(B, H, rows, ...)`` where ``rows`` is ``tokens``,
            or ``tokens // block`` for the names in ``per_block``.
        tokens: number of tokens held.
        block: tokens coded together (1 for per-token codecs).
        per_block: names of arrays with one row per block (shared statistics).
    """

    data: dict[str, mx.array]
    tokens: int
    block: int = 1
    per_block: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        if self.block < 1 or self.tokens % self.block:
            raise ValueError(
                f"Packed: {self.tokens} tokens is not a multiple of block {self.block}"
            )
        for name, a in self.data.items():
            if a.ndim < 3 or a.shape[2] != self.rows(name, self.tokens):
                raise ValueError(
                    f"Packed: array {name!r} has shape {tuple(a.shape)}, expected "
                    f"{self.rows(name, self.tokens)} rows on axis 2"
                )

    def rows(self, name: str, tokens: int) -> int:
        return tokens // self.block if name in self.per_block else tokens

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.data.values())

    @property
    def batch(self) -> int:
        return next(iter(self.data.values())).shape[0]

    def arrays(self) -> list[mx.array]:
        return list(self.data.values())

    def map(self, fn: Callable[[str, mx.array], mx.array], tokens: int | None = None) -> Packed:
        """A record with ``fn(name, array)`` applied to every array."""
        tokens = self.tokens if tokens is None else tokens
        data = {k: fn(k, a) for k, a in self.data.items()}
        return Packed(data, tokens, self.block, self.per_block)

    def tiles(self, most: int) -> list[tuple[int, int, Packed]]:
        """``(start, stop, tokens [start, stop))`` in tiles of at most ``most`` tokens (whole
        blocks each, one block at least), in order: for a codec that reads its codes a tile
        at a time."""
        step = max(most // self.block, 1) * self.block
        if self.tokens <= step:
            return [(0, self.tokens, self)]
        ends = [(a, min(a + step, self.tokens)) for a in range(0, self.tokens, step)]
        return [(a, z, self.slice(a, z)) for a, z in ends]

    def slice(self, start: int, stop: int) -> Packed:
        """Tokens ``[start, stop)``; both must be multiples of ``block``."""
        if start % self.block or stop % self.block or not 0 <= start <= stop <= self.tokens:
            raise ValueError(
                f"Packed.slice({start}, {stop}) must be block-aligned ({self.block}) "
                f"within {self.tokens} tokens"
            )
        # written out rather than through map: a cache's every attention call slices its
        # stores' buffers, so the per-array Python cost counts
        per_block, block = self.per_block, self.block
        data = {
            k: a[:, :, start // block : stop // block] if k in per_block else a[:, :, start:stop]
            for k, a in self.data.items()
        }
        return Packed(data, stop - start, block, per_block)

    def take(self, index: mx.array) -> Packed:
        """Gather tokens by index along axis 2 (per-token records only).

        Shapes:
            index ``(n,)`` shared by every head, or ``(B, H, n)`` per head.
        """
        if self.per_block:
            raise ValueError("Packed.take: tokens of a block-coded record cannot be gathered")
        n = index.shape[-1]
        if index.ndim == 1:
            return self.map(lambda k, a: mx.take(a, index, axis=2), tokens=n)

        def gather(_, a):
            idx = index.reshape(*index.shape, *([1] * (a.ndim - 3)))
            return mx.take_along_axis(a, idx, axis=2)

        return self.map(gather, tokens=n)

    @staticmethod
    def concat(parts: list[Packed]) -> Packed:
        """Join records along tokens (same layout required)."""
        parts = [p for p in parts if p is not None and p.tokens > 0]
        if not parts:
            raise ValueError("Packed.concat needs at least one non-empty record")
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        data = {k: mx.concatenate([p.data[k] for p in parts], axis=2) for k in first.data}
        return Packed(data, sum(p.tokens for p in parts), first.block, first.per_block)


class Codec(Configured, ABC):
    """Turns ``(B, H, T, D)`` vectors into a :class:`Packed` record and back.

    Subclasses set ``name`` (the registry name), ``block`` (tokens coded together),
    implement :meth:`encode`, :meth:`decode` and :meth:`config`, and may override
    :meth:`scores` / :meth:`mix` with compressed-domain versions (then set
    ``compressed_scores`` / ``compressed_mix`` to True). ``decodes_slices`` declares that a
    block-aligned slice of a record decodes exactly on its own.

    A codec whose codes the fused decode kernels read gives them its records through
    :meth:`kernel_keys` / :meth:`kernel_values` (the one way from a codec to a kernel:
    :mod:`velox_core.kernels.joint`).
    """

    name: ClassVar[str] = "codec"
    compressed_scores: ClassVar[bool] = False
    compressed_mix: ClassVar[bool] = False
    # True where decoding a block-aligned slice of a record (Packed.slice) gives exactly
    # those tokens of the whole record's decode (no token's decode reads another block or a
    # statistic of the whole record): prefill attention may then decode stored tokens a slice
    # at a time (velox_core.cache.attention.tiled_prefill_attention). A subclass that changes
    # decode must set it anew.
    decodes_slices: ClassVar[bool] = False
    block: int = 1

    # -- configuration (settings or config(), from_config, fresh, describe:
    # velox_core.configured) ------------------------------------------------------------------

    # -- fitted state ----------------------------------------------------------------------
    def check(self, dim: int, dtype: mx.Dtype) -> None:
        """Validate the head dim and dtype on first use; raise ``ValueError`` if unsupported."""

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Called by ``make_cache`` with the model and layer index, for codecs that need them."""

    def state(self) -> dict[str, mx.array]:
        """Arrays fitted by this codec (resident, saved with the cache)."""
        return {}

    def set_state(self, state: dict[str, mx.array]) -> None:
        if state:
            raise ValueError(f"{self.name}: this codec has no state, got {sorted(state)}")

    @property
    def state_nbytes(self) -> int:
        return sum(a.nbytes for a in self.state().values())

    def filter_batch(self, index: mx.array) -> None:
        """Keep the fitted state of the given batch rows (codecs that fit one state per
        sequence; the cache calls it from ``filter``)."""

    def extend_batch(self, other: Codec) -> None:
        """Append ``other``'s per-sequence fitted state (the cache calls it from ``extend``,
        after its own checks)."""

    # -- coding ------------------------------------------------------------------------------
    @abstractmethod
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Shapes: x ``(B, H, T, D)`` with ``T % block == 0``; positions ``(T,)`` int32."""

    @abstractmethod
    def decode(self, packed: Packed) -> mx.array:
        """Shapes: returns float32 ``(B, H, T, D)``."""

    def decode_as(self, packed: Packed, dtype: mx.Dtype) -> mx.array:
        """:meth:`decode` in ``dtype`` (a prefill attends the decoded tokens in the model's
        dtype); codecs with a fused dequantization skip the float32 intermediate.

        Shapes: returns ``(B, H, T, D)`` in ``dtype``.
        """
        return self.decode(packed).astype(dtype)

    def stored_rotation(self) -> Any | None:
        """The orthogonal rotation ``R`` this codec stores its vectors in, or None.

        A codec that codes ``R x`` (``forward(x) = R x`` and ``inverse`` on ``(..., D)``)
        returns it, so that a prefill can attend in the rotated domain: ``q . x`` is
        ``(R q) . (R x)`` and ``sum_i p_i x_i`` is ``inverse(sum_i p_i R x_i)``, which spares
        rotating every stored token back (:meth:`decode_rotated_as`).
        """
        return None

    def decode_rotated_as(self, packed: Packed, dtype: mx.Dtype) -> mx.array:
        """``R x_hat`` in ``dtype``, for the :meth:`stored_rotation` ``R``: codecs that store
        rotated vectors return them without the inverse rotation; this default rotates
        :meth:`decode_as`'s output.

        Shapes: returns ``(B, H, T, D)`` in ``dtype``.
        """
        rot = self.stored_rotation()
        if rot is None:
            raise TypeError(f"{self.name}: decode_rotated_as needs a codec with a rotation")
        return rot.forward(self.decode_as(packed, dtype)).astype(dtype)

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ k_hat.T`` for grouped queries.

        Shapes:
            q ``(B, H, M, D)`` float32 (``M`` = query heads per KV head x query tokens, scale
            already applied); returns float32 ``(B, H, M, T)``.
        """
        return q @ mx.swapaxes(self.decode(packed), -1, -2)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``w @ v_hat``.

        Shapes:
            w ``(B, H, M, T)`` float32 attention weights; returns float32 ``(B, H, M, D)``.
        """
        return w @ self.decode(packed)

    def kernel_values(self, packed: Packed, dim: int) -> KernelSide | None:
        """This codec's record as the decode kernels' value side (its
        :class:`~velox_core.kernels.joint.KernelSide`: the record, and the map back to the
        model's domain where the values are coded in another), or None: no kernel mixes
        these codes (the default), and the segment takes the reference path. Called only
        where kernels run (:func:`velox_core.kernels.use_kernels`); ``dim`` is the query's
        head dim."""
        return None

    def kernel_keys(
        self, packed: Packed, q_shape: tuple[int, int, int, int], values: CodeRecord
    ) -> KernelSide | None:
        """This codec's record as the decode kernels' key side for grouped queries of
        ``q_shape`` beside the value record ``values`` (the record, and the query the
        kernels score it with where that is not the model's), or None: no kernel scores
        these codes beside those values (the default), and the segment takes the reference
        path. Called only where kernels run, after the value codec's
        :meth:`kernel_values`."""
        return None
