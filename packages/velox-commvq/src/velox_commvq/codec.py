"""``CommVQKeys``: pre-RoPE keys as RoPE-commutative residual VQ codes (arXiv 2506.18879).

Each key reaches the cache post-RoPE. The codec un-rotates it at its absolute position (kept
per token, int32), divides it by its L2 norm (kept per token and head, fp16) and codes the
unit vector with the model's fitted codebooks (:mod:`velox_commvq.vq`), stage by stage, each
stage taking the nearest of its codewords to what the earlier stages left (greedy, as the
authors' ``KeyCompressor.encode``). Decoding sums the codewords, scales by the norm and
rotates at the position; attention scores never decode (:mod:`velox_commvq.scores`).

Codebooks come from an artifact (:mod:`velox_commvq.artifact`): ``bind(model, layer)``
(called by ``velox_core.make_cache``) finds the file fitted for the model and raises if there
is none. The layer's codebooks are read when the cache first receives tokens; from then on
they are codec state (float16, counted in ``nbytes``, saved with the cache), the first
``stages_for(bits)`` stages only, with ``J b[0]`` moved into ``a`` so that ``b[0] = 0`` is not
stored (the same codewords).

Deviations from the paper and the authors' code:

* Geometry. The authors give each head one code per stage (all 64 pairs of a 128-dim head
  share a 6+6-bit index: ``G = 64``, ``K = 64``); their training script runs 21 stages (252
  bits per head, 1.97 bits per coordinate). Here ``G`` and ``K`` are fitted choices
  (default ``G = 4``, ``K = 16``: 1 bit per coordinate per stage, 2 stages for 2 bits),
  because the codebooks are resident bytes of every layer's cache: the authors' 21 x 64 x 64
  blocks per head are 1.4 MB per layer of a 2-KV-head model, more than 4,096 tokens of its
  2-bit keys.
* The norm is per token and KV head; the authors' code divides by one norm per token taken
  over all KV heads together.
* Codes are bit-packed (``velox_core.ops.pack``), not int16 per index.
* Values go through any velox codec; the paper's learned value encoder is not implemented.

On a GPU with kernels enabled, decode steps attend through velox-core's portable decode
kernel on the codes (:mod:`velox_commvq.kernels`: query tables built once per call, RoPE on
the looked-up sums in the kernel); elsewhere scores from the codes run the pure-MLX reference
(:func:`code_scores`).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import Codec, Packed
from velox_core.artifacts import bound_layer
from velox_core.codec.prerope import PreRope
from velox_core.ops import pack, unpack
from velox_core.ops.rope import RopeSpec
from velox_core.validation import check_bits, check_int, check_path

from . import kernels as _kernels
from .artifact import KIND, load_cached, resolve_codebooks
from .pairs import angles, from_pairs, rotate_pairs, to_pairs
from .scores import code_scores
from .vq import Geometry, decode_pairs, encode_pairs, jrot

__all__ = ["CommVQKeys"]

_EPS = 1e-12


class CommVQKeys(PreRope, Codec):
    """CommVQ's key codec.

    Args:
        bits: bits per key coordinate (1 or 2 with the default codebooks: a whole number of
            stages of the fitted quantizer).
        codebooks: path of the artifact; None finds the one fitted for the model at ``bind``.
        layer: the model layer whose codebooks to use (set by ``bind``).
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone codec
            (:class:`~velox_core.codec.prerope.PreRope`).

    Packed layout per token: ``codes`` uint32 ``(ceil(S * P/G * 2 * log2(K) / 32),)`` (stage
    by stage, group by group, ``c1`` then ``c2``), ``norm`` float16 ``()`` per head, and
    ``pos`` int32 stored once per token for all heads, ``(B, 1, T)``.
    """

    name = "commvq-key"
    rope_method = "commvq"
    compressed_scores = True

    def __init__(
        self,
        bits: int = 2,
        codebooks: str | os.PathLike | None = None,
        layer: int | None = None,
        rope_base: float | None = None,
        rope_traditional: bool = False,
        rope_scale: float = 1.0,
        rope_dims: int | None = None,
    ):
        self.bits = check_bits("key_bits", bits, 1, 8)
        self.codebooks = check_path("codebooks", codebooks)
        self.layer = None if layer is None else check_int("layer", layer, minimum=0)
        self.init_rope(rope_base, rope_traditional, rope_scale, rope_dims)
        self._path = self.codebooks
        self._books: dict[str, mx.array] | None = None
        self._theta: tuple[RopeSpec, int, mx.array] | None = None  # pair_theta, once

    def config(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "codebooks": self.codebooks,
            "layer": self.layer,
            **self.rope_config(),
        }

    def fresh(self) -> CommVQKeys:
        """An empty copy that keeps what ``bind`` found (artifact and RoPE) and the codebooks
        once read (they are the model's, not the sequence's: a cache loaded from a file needs
        no artifact for its fresh copies)."""
        out = type(self).from_config(self.config())
        out._path, out._rope, out._books = self._path, self._rope, self._books
        return out

    # -- the model: its RoPE and its artifact ---------------------------------------------------
    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Read ``model.layers[layer]``'s RoPE and find the artifact fitted for ``model``."""
        if not bound_layer(self, model, layer):
            return
        self.bind_rope(model, self.layer)
        self._path, self._books = str(resolve_codebooks(model, self.codebooks)), None
        self._select(load_cached(self._path), None)  # fail now if the layer or the bits are missing

    def _select(self, books, dim: int | None) -> dict[str, mx.array]:
        a, b = books.layer(self.layer)
        n = books.geometry.stages_for(self.bits)
        if dim is not None and 2 * a.shape[2] != dim:
            raise ValueError(
                f"commvq: layer {self.layer}'s codebooks code {2 * a.shape[2]}-dim keys, the "
                f"cache holds {dim}-dim keys: they were fitted for another model"
            )
        if self._rope is not None and books.layouts[self.layer] != self._rope.layout:
            raise ValueError(
                f"commvq: layer {self.layer}'s codebooks were fitted under the RoPE pair layout "
                f"[dims, traditional] = {books.layouts[self.layer]}, this cache's RoPE has "
                f"{self._rope.layout}"
            )
        pairs = mx.array([books.pairs], dtype=mx.int32)
        a, b = a[:, :n].astype(mx.float32), b[:, :n].astype(mx.float32)
        # a[j] + c, J b[k] - c give the same codewords: move J b[0] into a, so that b[0] = 0
        # and is not stored (one 2-vector per head, stage and pair fewer resident bytes)
        a = a + jrot(b[:, :, :, :1])
        b = b[:, :, :, 1:] - b[:, :, :, :1]
        return {"a": a.astype(mx.float16), "b": b.astype(mx.float16), "pairs": pairs}

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        self.rope_for(dim).pairs(dim, "commvq")  # raises if the RoPE does not pair this head
        if self._books is None:
            if self._path is None or self.layer is None:
                raise KIND.unbound("codebooks", "CommVQ codes keys only with codebooks")
            self._books = self._select(load_cached(self._path), dim)
        elif 2 * self._books["a"].shape[2] != dim:
            raise ValueError(f"commvq: codebooks code {2 * self._books['a'].shape[2]}-dim keys")

    # -- state: the codebooks and the RoPE, once known --------------------------------------
    def state(self) -> dict[str, mx.array]:
        return {} if self._books is None else {**self._books, **self.rope_state()}

    def set_state(self, state: dict[str, mx.array]) -> None:
        state = self.pop_rope_state(state)
        if not state:
            self._books = None
            return
        a, b = state.get("a"), state.get("b")
        if (
            set(state) != {"a", "b", "pairs"}
            or a.ndim != 5
            or b.shape != (*a.shape[:3], a.shape[3] - 1, 2)
        ):
            raise ValueError(
                f"{self.name}: state must hold a (H, S, P, K, 2), b (H, S, P, K-1, 2) and pairs"
            )
        self._books = state

    def _b(self) -> mx.array:
        """The second codebook with its implicit zero entry 0. Shapes: ``(H, S, P, K, 2)``."""
        b = self._books["b"]
        return mx.concatenate([mx.zeros((*b.shape[:3], 1, 2), b.dtype), b], axis=3)

    @property
    def geometry(self) -> Geometry:
        a = self._books["a"]
        return Geometry(int(self._books["pairs"].item()), int(a.shape[3]), int(a.shape[1]))

    @property
    def ready(self) -> bool:
        """Whether the codebooks and the RoPE are known (after the first tokens, or loaded)."""
        return self._books is not None and self._rope is not None

    @property
    def rope(self) -> RopeSpec:
        """The RoPE the keys were un-rotated with (the layer's, or the standalone settings)."""
        if self._rope is None:
            raise ValueError("commvq: the RoPE is not known before the cache receives keys")
        return self._rope

    @property
    def stages(self) -> int:
        """Residual stages of the codes (``stages_for(bits)`` of the fitted ones)."""
        return int(self._books["a"].shape[1])

    def codewords(self) -> tuple[mx.array, mx.array]:
        """The small codebooks ``A`` and ``B`` (``B`` with its implicit zero entry 0).

        Shapes: two float16 ``(H, S, P, K, 2)``.
        """
        return self._books["a"], self._b()

    def pair_theta(self) -> mx.array:
        """Each RoPE pair's frequency (radians per position, 0 for unrotated channels), in
        the codes' pair order, made once. Shapes: float32 ``(D/2,)``."""
        dim = 2 * int(self._books["a"].shape[2])
        hit = self._theta
        if hit is None or hit[0] is not self._rope or hit[1] != dim:
            theta = np.asarray(self.rope.pairs(dim, "commvq")[2], dtype=np.float32)
            hit = self._theta = (self._rope, dim, mx.array(theta))
        return hit[2]

    # -- coding ------------------------------------------------------------------------------
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        b, h, t, d = x.shape
        pos = self.key_positions(positions, b, t)
        self.check(d, x.dtype)
        bk = self._books
        if bk["a"].shape[0] != h:
            raise ValueError(f"commvq: codebooks for {bk['a'].shape[0]} KV heads, keys have {h}")
        cos, sin = angles(pos, self._rope, d)  # (B, 1, T, P)
        z = rotate_pairs(to_pairs(x, self._rope), cos, sin, inverse=True)
        norm = mx.sqrt(mx.sum(z * z, axis=(-2, -1)))  # (B, H, T)
        u = z / mx.maximum(norm, _EPS)[..., None, None]
        codes = encode_pairs(u, bk["a"], self._b(), self.geometry.pairs)
        words = pack(codes.reshape(b, h, t, -1), self.geometry.index_bits)
        return Packed({"codes": words, "norm": norm.astype(mx.float16), "pos": pos}, t)

    def codes(self, packed: Packed) -> mx.array:
        """The integer codes of a record. Shapes: returns uint8 ``(B, H, T, S, P/G, 2)``."""
        g, a = self.geometry, self._books["a"]
        n = a.shape[1] * (a.shape[2] // g.pairs) * 2
        c = unpack(packed.data["codes"], g.index_bits, n)
        return c.reshape(*c.shape[:3], a.shape[1], a.shape[2] // g.pairs, 2)

    def decode_pre(self, packed: Packed) -> mx.array:
        """Decoded keys before RoPE, as pairs. Shapes: returns float32 ``(B, H, T, P, 2)``."""
        bk = self._books
        u = decode_pairs(self.codes(packed), bk["a"], self._b(), self.geometry.pairs)
        return u * packed.data["norm"].astype(mx.float32)[..., None, None]

    def decode(self, packed: Packed) -> mx.array:
        d = 2 * self._books["a"].shape[2]
        cos, sin = angles(packed.data["pos"], self._rope, d)
        return from_pairs(rotate_pairs(self.decode_pre(packed), cos, sin), self._rope)

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ k.T`` from the codes, RoPE applied in the code domain (no key decoded).

        Shapes:
            q ``(B, H, M, D)`` float32 (scale applied); returns float32 ``(B, H, M, T)``.
        """
        bk, p = self._books, packed.data
        cos, sin = angles(p["pos"], self._rope, q.shape[-1])
        qp = to_pairs(q, self._rope)
        return code_scores(
            qp, self.codes(packed), p["norm"], cos, sin, bk["a"], self._b(), self.geometry.pairs
        )

    def kernel_keys(self, packed: Packed, q_shape, values):
        """The decode kernels' key side (GPU): :func:`velox_commvq.kernels.kernel_keys`."""
        return _kernels.kernel_keys(self, packed, q_shape, values)
