"""Primitives: pure MLX functions (rotations, scalar quantizers, bit packing, sketches, k-means)."""

from .hadamard import HadamardRotation, RandomizedHadamard, block_size, hadamard
from .kmeans import assign, kmeans
from .lloyd_max import Codebook, lloyd_max
from .packing import BYTE_BITS, byte_table, lookup, mlx_readable, pack, packed_words, unpack
from .quant import affine_dequantize, affine_matmul, affine_quantize, scale_dtype
from .rotation import random_orthogonal
from .sketch import jl_matrix, sign_sketch

__all__ = [
    "BYTE_BITS",
    "Codebook",
    "HadamardRotation",
    "RandomizedHadamard",
    "affine_dequantize",
    "affine_matmul",
    "affine_quantize",
    "assign",
    "block_size",
    "byte_table",
    "hadamard",
    "jl_matrix",
    "kmeans",
    "lloyd_max",
    "lookup",
    "mlx_readable",
    "pack",
    "packed_words",
    "random_orthogonal",
    "scale_dtype",
    "sign_sketch",
    "unpack",
]
