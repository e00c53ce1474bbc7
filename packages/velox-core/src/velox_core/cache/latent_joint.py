"""``JointLatent``: a :class:`~velox_core.cache.latent.LatentCache`'s tokens as one record.

Where the latent and the RoPE key are coded alike (the same bits, the same group, no clip
window or sinks, each token coded on arrival: ``LatentCache``'s defaults at DeepSeek-V3's
widths), a token's latent and ``k_pe`` are concatenated channel-wise and coded as one
``(kv_lora_rank + qk_rope_head_dim)``-channel row: a decode step is one encode, one write per
buffer (codes, scales, zeros) and one decode, where a pair of records takes two of each.
The groups never straddle the two (``group`` divides the latent's width) and the latent's
width is a multiple of 32 channels, so either part of a record is a slice of its arrays in
the same layout (:meth:`JointLatent.part`): the latent's for the absorbed attention, as a
record of the latent alone would be.

It answers the calls a ``LatentCache`` makes of its store (those of
:class:`~velox_core.cache.velox.VeloxCache` that it uses), so the cache takes either.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..codec.base import Packed
from ..codec.uniform import Uniform
from ..validation import check_int
from .attention import Segment
from .store import PackedStore

__all__: list[str] = []

LAYOUT = "joint"  # the state's name for this layout
# updates of more tokens than this (prefill chunks) are evaluated when stored, as VeloxCache
# evaluates them: each layer's inputs and encode intermediates freed before the next layer's
EVAL_ABOVE = 16


def joins(latent_dim: int, group: int) -> bool:
    """Whether a record of ``latent_dim`` latent channels and the RoPE key after them splits
    at whole groups and whole 32-channel runs (the unit of every packed layout)."""
    return latent_dim % 32 == 0 and latent_dim % group == 0


class JointLatent:
    """One packed record a token: the latent, then ``k_pe``.

    Args:
        codec: codes every token's ``latent_dim + pe_dim`` channels (per-token groups).
        dims: ``(latent_dim, pe_dim)``.
        step: the buffers' largest growth quantum, in tokens (``PackedStore``'s).
    """

    # the latent's codes are a slice of each token's record, not an array of their own
    codes_sliced = True

    def __init__(self, codec: Uniform, dims: tuple[int, int], step: int = 256):
        self.codec = codec
        self.dims = dims
        self.store = PackedStore(step)
        self.offset = 0
        self.storage_dtype: mx.Dtype | None = None

    # -- the calls LatentCache makes --------------------------------------------------------
    def set_storage_dtype(self, dtype: mx.Dtype | None) -> None:
        """Code the tokens from ``dtype`` (the scales' dtype follows it); only while empty."""
        if self.store.tokens:
            raise ValueError("set_storage_dtype: the cache already stores tokens")
        self.storage_dtype = dtype

    def update_and_fetch(self, k_pe: mx.array, latent: mx.array) -> tuple[mx.array, mx.array]:
        """Store the tokens; return every stored token's ``k_pe`` and latent, decoded (lazy).

        A step's record is written into the buffers' room in place; a growth is evaluated on
        its own (``mx.async_eval``), so that every step's graph is the same encode and write.
        Each part is decoded from its channels of the stored tokens' codes, a contiguous
        array (as a pair of records returns them).
        """
        (b, h, t, dl), pe_shape = latent.shape, k_pe.shape
        st = self.store
        if h != 1 or pe_shape[:3] != (b, 1, t) or (dl, pe_shape[3]) != self.dims:
            raise ValueError(
                f"latent {tuple(latent.shape)} / k_pe {tuple(pe_shape)} are not (batch, 1, "
                f"tokens, {self.dims[0]}) / (batch, 1, tokens, {self.dims[1]})"
            )
        if st.buf is not None and b != self.batch:
            raise ValueError(f"batch {b} differs from the cache's {self.batch}")
        io = latent.dtype
        x = mx.concatenate([latent, k_pe.astype(io)], axis=-1)
        if self.storage_dtype is not None and io != self.storage_dtype:
            x = x.astype(self.storage_dtype)
        packed = self.codec.encode(x)
        if st.buf is None:
            st.append(packed)
        else:
            if st.tokens + t > st.capacity:
                st.reserve(st.tokens + t)
                mx.async_eval(st.arrays())
            st.put(packed)
        if t > EVAL_ABOVE:
            mx.eval(st.arrays())
        self.offset += t
        # each part decoded from its own channels of the stored tokens' codes: the outputs
        # are contiguous, as the model's attention needs (it broadcasts the one latent head
        # over every query head, which MLX does by materializing a strided operand per head),
        # and a step copies no decoded channels (only, where the backend does, the codes')
        rec = st.view()
        return (
            self.codec.decode_as(self.part(rec, "pe"), io),
            self.codec.decode_as(self.part(rec, "latent"), io),
        )

    @property
    def batch(self) -> int:
        return self.store.buf.batch

    def size(self) -> int:
        return self.store.tokens

    def is_trimmable(self) -> bool:
        return True

    def reuses_prefix(self) -> bool:
        return True  # every token coded alone on arrival: a trim is exact

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens; returns ``n`` (``ValueError`` beyond the stored)."""
        check_int("n", n, minimum=0)
        if n > self.size():
            raise ValueError(f"cannot trim {n} tokens: the cache stores {self.size()}")
        self.store.truncate(self.store.tokens - n)
        self.offset -= n
        return n

    def part(self, record: Packed, which: str) -> Packed:
        """The ``"latent"`` or ``"pe"`` channels of a record of this layout, as a record of
        those channels alone would hold them (slices of its arrays)."""
        d, total = self.dims[0], sum(self.dims)

        def cut(name: str, a: mx.array) -> mx.array:
            at = d * a.shape[-1] // total  # codes words or scale groups before the RoPE key
            return a[..., :at] if which == "latent" else a[..., at:]

        return Packed({k: cut(k, a) for k, a in record.data.items()}, record.tokens)

    def one_segment(self) -> Segment | None:
        """Every stored token, as :class:`VeloxCache`'s one coded segment (keys: ``k_pe``,
        values: the latent); None while empty."""
        v = self.store.view()
        if v is None:
            return None
        return Segment(self.codec, self.part(v, "pe"), self.codec, self.part(v, "latent"))

    def segments(self) -> list[Segment]:
        one = self.one_segment()
        return [] if one is None else [one]

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    @property
    def logical_nbytes(self) -> int:
        return self.store.logical_nbytes

    # -- state and batch rows ---------------------------------------------------------------
    def _state_dict(self) -> tuple[dict, dict[str, mx.array]]:
        v = self.store.view()
        arrays = {} if v is None else {f"joint.{k}": a for k, a in v.data.items()}
        meta = {"layout": LAYOUT, "offset": self.offset, "tokens": self.store.tokens}
        return meta, arrays

    def load(self, meta: dict[str, Any], arrays: list[mx.array]) -> None:
        """Hold what :meth:`_state_dict` described (``arrays`` in its order)."""
        names = ("codes", "scale", "zero")
        if meta.get("layout") != LAYOUT or len(arrays) not in (0, len(names)):
            raise ValueError(f"not a joint latent state ({len(arrays)} arrays, meta {meta})")
        tokens = int(meta["tokens"])
        if arrays:
            self.store.replace(Packed(dict(zip(names, arrays)), tokens))
        elif tokens:
            raise ValueError(f"a joint latent state of {tokens} tokens holds no arrays")
        self.offset = int(meta["offset"])

    def filter(self, batch_indices) -> None:
        idx = batch_indices if isinstance(batch_indices, mx.array) else mx.array(batch_indices)
        self.store.map_batch(lambda a: a[idx])

    def extend(self, other: JointLatent) -> None:
        """Append ``other``'s batch rows (the same tokens: no padding)."""
        if not isinstance(other, JointLatent) or (other.size(), other.offset) != (
            self.size(),
            self.offset,
        ):
            raise ValueError(
                "extend: both caches must hold the same tokens in the same layout "
                "(equal-length sequences); velox caches do not pad"
            )
        mine, theirs = self.store.view(), other.store.view()
        if mine is None or theirs is None:
            raise ValueError("extend: both caches must hold tokens")
        joined = mine.map(lambda k, a: mx.concatenate([a, theirs.data[k]], 0))
        self.store.replace(joined)
