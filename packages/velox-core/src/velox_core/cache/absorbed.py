"""The absorbed decode attention of multi-head latent attention, read from the latent's codes.

At decode DeepSeek-V3's attention (mlx-lm's ``deepseek_v3`` and the models built on it)
absorbs its key and value projections into the queries and the output, so its attention is
multi-query attention of every query head over one head, the stored latent, which is both
the keys and the values, with the RoPE half of the scores (``q_pe @ k_pe^T``) passed as an
additive mask::

    softmax(q c^T * scale + mask) c        q (B, Hq, L, R), c the stored latents (T, R)

:func:`attention` computes it over a :class:`~velox_core.cache.latent.LatentCache`'s
segments in temporal order (sinks, codes, window) without decoding the codes:

* the coded tokens' scores are one ``mx.quantized_matmul`` of every query row against the
  codes (velox's per-token ``Uniform`` words are MLX's affine layout, ``w = scale * code +
  zero``: the zero is MLX's bias), the fp16 tokens' a plain matmul;
* the scores are joined, the mask added, and one softmax (``precise``: float32 sums) runs over
  every stored token, as the model's fp16 path does over the decoded latent (in the queries'
  dtype on a GPU; in float32 on the CPU, whose ``quantized_matmul`` sums in the dtype it is
  given);
* the output is the weights against the same codes, ``mx.quantized_matmul(p, codes,
  transpose=False)``, plus the fp16 tokens' share. With the context as the inner dimension of
  that product and only ``Hq * L`` rows and ``R`` columns to tile, the coded tokens are split
  into chunks of :func:`chunk_tokens` tokens on a batch axis (a view of the codes) and the
  chunks' products summed, so the product runs on many tiles rather than a few long ones.

:func:`readable` says which segments it reads: per-token ``Uniform`` codes in MLX's layout
(2-6 or 8 bits, groups of 32, 64 or 128) and fp16 tokens; on MLX's CUDA backend a single
batch row only (its ``quantized_matmul`` reads contiguous codes, and the rows of a cache's
buffers are not), and only where ``KernelConfig.latent_codes`` turns it on there
(``VELOX_LATENT_CODES=1``): on CUDA the path measures no faster than the decoded latent
(docs/latent.md).
"""

from __future__ import annotations

import mlx.core as mx

from ..codec.base import Codec, Packed
from ..codec.identity import Identity
from ..codec.uniform import Uniform
from ..ops.packing import mlx_layout
from ..ops.quant import affine_matmul

__all__: list[str] = []

# the mix's chunks: at least CHUNK tokens each, at most CHUNKS of them (the chunk doubles
# until they fit); fewer than two chunks' worth of coded tokens are mixed in one product
CHUNK = 512
CHUNKS = 32


def chunk_tokens(tokens: int) -> int:
    """Coded tokens per chunk of the output's product over ``tokens`` coded tokens (0: one
    product over all of them)."""
    c = CHUNK
    while tokens // c > CHUNKS:
        c *= 2
    return c if tokens // c >= 2 else 0


def turned_off() -> str:
    """Why :func:`attention` is off on this backend and configuration ("" where it is on)."""
    from ..kernels import backend
    from ..kernels.config import kernel_config

    on = kernel_config().latent_codes
    if on is False:
        return "turned off (KernelConfig.latent_codes, VELOX_LATENT_CODES=0)"
    if on is None and backend() == "cuda":
        return (
            "MLX's CUDA backend, where this path measures no faster (VELOX_LATENT_CODES=1 "
            "turns it on)"
        )
    return ""


def readable(segments: list[tuple[Codec, Packed]]) -> str:
    """Why :func:`attention` cannot read these ``(codec, record)`` segments ("" where it
    can): :func:`turned_off`, or :func:`codes_unreadable`."""
    return turned_off() or codes_unreadable(segments)


def codes_unreadable(segments: list[tuple[Codec, Packed]]) -> str:
    """Why :func:`attention` cannot read these segments' codes where it is on ("" where it
    can): a codec other than per-token uniform codes in MLX's layout, or a batch of several
    rows on CUDA."""
    from ..kernels import backend

    for codec, packed in segments:
        if isinstance(codec, Identity):
            continue
        if not isinstance(codec, Uniform) or codec.axis != "token":
            return f"the latent's codec ({codec.describe()}) is not per-token uniform codes"
        if not mlx_layout(codec.bits, codec.group):
            return (
                f"uniform codes of {codec.bits} bits in groups of {codec.group} are not "
                "MLX's layout (2-6 or 8 bits, groups of 32, 64 or 128)"
            )
        if packed.batch > 1 and backend() == "cuda":
            return (
                "a batch of several rows on MLX's CUDA backend (its quantized_matmul reads "
                "contiguous codes only)"
            )
    return ""


def attention(
    queries: mx.array, segments: list[tuple[Codec, Packed]], scale: float, mask=None
) -> mx.array:
    """``softmax(q c^T * scale + mask) c`` over the segments' latents (see the module).

    Args:
        queries: ``(B, Hq, L, R)``, the absorbed queries (``R`` the latent's channels).
        segments: ``(codec, record)`` of the stored latents in temporal order, each
            :func:`readable`.
        scale: the model's attention scale.
        mask: None, or an additive or boolean array broadcasting to ``(B, Hq, L, T)`` over
            the ``T`` stored tokens.

    Shapes:
        returns ``(B, Hq, L, R)`` in ``queries.dtype``.
    """
    from ..kernels import backend

    b, hq, lq, r = queries.shape
    rows = hq * lq
    t = sum(p.tokens for _, p in segments)
    # MLX's quantized_matmul on the CPU sums in its input's dtype: float32 there (the GPUs'
    # sum in float32 whatever they read)
    q = queries.astype(mx.float32) if backend() == "cpu" else queries
    q = (q * scale).reshape(b, 1, rows, r)
    scores = [_scores(q, codec, packed) for codec, packed in segments]
    s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)  # (B, 1, rows, T)
    if mask is not None:
        m = mask if mask.shape == (b, hq, lq, t) else mx.broadcast_to(mask, (b, hq, lq, t))
        m = m.reshape(b, 1, rows, t)
        if m.dtype == mx.bool_:
            s = mx.where(m, s, mx.finfo(s.dtype).min)
        else:
            s = s + m
    p = mx.softmax(s, axis=-1, precise=True)
    out, start = None, 0
    for codec, packed in segments:
        n = packed.tokens
        w = p if len(segments) == 1 else p[..., start : start + n]
        part = _mix(w, codec, packed)
        out = part if out is None else out + part
        start += n
    return out.reshape(b, hq, lq, r).astype(queries.dtype)


def _scores(q: mx.array, codec: Codec, packed: Packed) -> mx.array:
    """``q c^T`` over one segment: ``(B, 1, M, R)`` against its ``n`` latents, ``(B, 1, M,
    n)``."""
    if isinstance(codec, Identity):
        return q @ mx.swapaxes(packed.data["x"], -1, -2)
    d = packed.data
    return affine_matmul(q, d["codes"], d["scale"], d["zero"], codec.bits, codec.group, True)


def _mix(w: mx.array, codec: Codec, packed: Packed) -> mx.array:
    """``w c`` over one segment: weights ``(B, 1, M, n)`` against its ``n`` latents, ``(B, 1,
    M, R)``; the coded tokens in chunks of :func:`chunk_tokens` (see the module)."""
    if isinstance(codec, Identity):
        return w @ packed.data["x"]
    d, bits, group = packed.data, codec.bits, codec.group
    n = packed.tokens
    c = chunk_tokens(n)
    if not c:
        return affine_matmul(w, d["codes"], d["scale"], d["zero"], bits, group, False)
    whole = n // c * c
    b, _, m, _ = w.shape

    def chunks(a: mx.array) -> mx.array:  # (B, 1, whole, X) -> (B, 1, whole / c, c, X)
        return a[:, :, :whole].reshape(b, 1, whole // c, c, a.shape[-1])

    wc = mx.swapaxes(w[..., :whole].reshape(b, 1, m, whole // c, c), 2, 3)
    parts = affine_matmul(
        wc, chunks(d["codes"]), chunks(d["scale"]), chunks(d["zero"]), bits, group, False
    )
    out = mx.sum(parts, axis=2)
    if whole < n:
        tail = packed.slice(whole, n).data
        rest = affine_matmul(
            w[..., whole:], tail["codes"], tail["scale"], tail["zero"], bits, group, False
        )
        out = out + rest
    return out
