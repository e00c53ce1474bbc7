"""NSNQuant's universal codebooks: k-means codebooks of synthetic standard-normal vectors.

NSNQuant (arXiv 2505.18231) brings every token of every model close to the standard normal
law (the normalize-shift-normalize transform and a Hadamard rotation), so that one codebook,
fitted once on synthetic Gaussian samples and never on a model's activations, quantizes all
of them. Here a width of ``bits`` bits an entry codes sub-vectors of ``dim`` channels with
``2**(bits * dim)`` codewords (one code of at most 8 bits a sub-vector):

=====  ====  =========  ============================================
bits   dim   codewords  codebook
=====  ====  =========  ============================================
1      8     256        k-means of N(0, I_8) samples
2      4     256        k-means of N(0, I_4) samples
3      2     64         k-means of N(0, I_2) samples
4      2     256        k-means of N(0, I_2) samples
5-8    1     32-256     the Lloyd-Max quantizer of N(0, 1) (exact)
=====  ====  =========  ============================================

The k-means books are shipped with the package (``codebooks.safetensors``, made by
``python -m velox_nsnquant --write``: :func:`train` with :data:`SAMPLES` samples,
:data:`ITERS` Lloyd iterations, seed :data:`SEED`), so that a saved cache decodes with the
codewords it was coded with on any machine; the scalar books are computed (velox-core's
``lloyd_max_gaussian``).
"""

from __future__ import annotations

import argparse
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from velox_core.ops.lloyd_max import lloyd_max_gaussian
from velox_core.validation import check_bits, check_int

__all__ = ["BOOKS", "ITERS", "SAMPLES", "SEED", "codebook", "subvector", "train"]

FILE = Path(__file__).with_name("codebooks.safetensors")
SAMPLES = 1 << 18  # synthetic Gaussian vectors per k-means book
ITERS = 60  # Lloyd iterations
SEED = 0
BOOKS = {1: 8, 2: 4, 3: 2, 4: 2}  # widths with a shipped k-means book: sub-vector dims
_BLOCK = 1 << 22  # distance entries per block of an assignment


def subvector(bits: int) -> int:
    """Channels a code covers at ``bits`` bits an entry: 8, 4, 2, 2 at 1 to 4 bits, 1 above
    (one code of at most 8 bits)."""
    check_bits("bits", bits)
    return BOOKS.get(bits, 1)


def _nearest(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Index of the nearest codeword of each row (blocks of rows, ties to the first)."""
    cn = np.sum(c * c, axis=1)
    step = max(1, _BLOCK // c.shape[0])
    out = np.empty(x.shape[0], dtype=np.int64)
    for i in range(0, x.shape[0], step):
        out[i : i + step] = np.argmin(cn - 2.0 * (x[i : i + step] @ c.T), axis=1)
    return out


def train(bits: int, samples: int = SAMPLES, iters: int = ITERS, seed: int = SEED) -> np.ndarray:
    """The k-means codebook of ``bits`` bits an entry (a width of :data:`BOOKS`), fitted on
    ``samples`` vectors of ``N(0, I)`` drawn with numpy's seeded generator (float64 Lloyd
    iterations from ``k`` distinct samples; an empty cell keeps its codeword).

    Shapes: returns float32 ``(2**(bits * dim), dim)``.
    """
    if bits not in BOOKS:
        raise ValueError(f"nsnquant: k-means books are for bits {sorted(BOOKS)}, got {bits}")
    check_int("samples", samples, minimum=1)
    check_int("iters", iters, minimum=0)
    dim = BOOKS[bits]
    k = 1 << (bits * dim)
    if samples < k:
        raise ValueError(f"nsnquant: {samples} samples cannot seed {k} codewords")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, dim))
    c = x[rng.choice(samples, size=k, replace=False)].copy()
    for _ in range(iters):
        a = _nearest(x, c)
        counts = np.bincount(a, minlength=k)
        sums = np.stack([np.bincount(a, weights=x[:, j], minlength=k) for j in range(dim)], 1)
        filled = counts > 0
        c[filled] = sums[filled] / counts[filled, None]
    return c.astype(np.float32)


@cache
def _shipped() -> dict[str, mx.array]:
    if not FILE.is_file():
        raise FileNotFoundError(
            f"nsnquant: the codebook file {FILE} is missing; make it with "
            "python -m velox_nsnquant --write"
        )
    return mx.load(str(FILE))


@cache
def codebook(bits: int) -> mx.array:
    """The universal codebook of ``bits`` bits an entry (1 to 8).

    Shapes: returns float32 ``(2**(bits * dim), dim)``, ``dim = subvector(bits)``.
    """
    dim = subvector(bits)
    if dim == 1:
        return mx.array(lloyd_max_gaussian(bits).centroids)[:, None]
    book = _shipped().get(f"bits{bits}")
    want = (1 << (bits * dim), dim)
    if book is None or tuple(book.shape) != want or book.dtype != mx.float32:
        raise ValueError(f"nsnquant: {FILE} lacks a float32 {want} book for {bits} bits")
    return book


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m velox_nsnquant",
        description="Fit NSNQuant's universal k-means codebooks on synthetic Gaussian samples.",
    )
    ap.add_argument("--write", action="store_true", help=f"write them to {FILE}")
    args = ap.parse_args(argv)
    books = {f"bits{b}": mx.array(train(b)) for b in sorted(BOOKS)}
    for name, book in books.items():
        print(f"{name}: {tuple(book.shape)}")
    if args.write:
        mx.save_safetensors(str(FILE), books, {"samples": str(SAMPLES), "iters": str(ITERS)})
        print(f"wrote {FILE}")
    return 0
