"""velox-commvq: CommVQ, RoPE-commutative additive vector quantization of pre-RoPE keys,
attended from the codes (arXiv 2506.18879)."""

from velox_core import Method, Uniform
from velox_core.artifacts import fingerprint, identity
from velox_core.ops.rope import RopeSpec, find_rope, rope_spec

from .artifact import (
    Codebooks,
    MissingCodebooksError,
    find_codebooks,
    load_codebooks,
    resolve_codebooks,
    save_codebooks,
    search_dirs,
)
from .cache import CommVQCache
from .codec import CommVQKeys
from .config import CommVQConfig
from .em import fit_residual, fit_stage
from .fit import fit_codebooks, pre_rope_units
from .scores import code_scores, query_tables
from .vq import Geometry, decode_pairs, encode_pairs

__all__ = [
    "METHOD",
    "Codebooks",
    "CommVQCache",
    "CommVQConfig",
    "CommVQKeys",
    "Geometry",
    "MissingCodebooksError",
    "RopeSpec",
    "code_scores",
    "decode_pairs",
    "encode_pairs",
    "find_codebooks",
    "find_rope",
    "fingerprint",
    "fit_codebooks",
    "fit_residual",
    "fit_stage",
    "identity",
    "load_codebooks",
    "pre_rope_units",
    "query_tables",
    "resolve_codebooks",
    "rope_spec",
    "save_codebooks",
    "search_dirs",
]

METHOD = Method.of(
    CommVQCache,
    summary="pre-RoPE keys as RoPE-commutative residual VQ codes fitted per model, "
    "scored from the codes; Uniform values",
    paper="https://arxiv.org/abs/2506.18879",
    codecs=(CommVQKeys, Uniform),
    recommended=({"key_bits": 2, "value_bits": 4},),
)
