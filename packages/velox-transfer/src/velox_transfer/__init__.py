"""velox-transfer: one model's KV cache mapped to another's, so the other decodes at once.

A user who switches models mid-session (a small model for easy turns and a larger one for
hard ones, a draft and a target) would re-run the whole prefill on the new model. A mapper
fitted once per model pair (:func:`fit_mapper`: closed-form ridge regressions from the
source's content-space keys and values, of its layers at each position and a few before it,
to each target layer's, factorised through a low-rank projection the target layers share)
turns the source's caches into the target's (:func:`transfer_cache`), as fp16 ``KVCache``
or straight into any velox codec. It saves the receiver's prefill; it does not shrink the cache.

    mapper = fit_mapper(source, target, fit_seqs, heldout_seqs)
    mapper.save("pair-mapper")
    mapper = load_mapper("pair-mapper", source=source, target=target)
    caches = transfer_cache(source_caches, mapper, "fp16", model=target, tokens=n - 1)
"""

from .apply import transfer_cache
from .evaluate import Row, evaluate, format_table
from .fit import ALPHAS, LAGS, RANK_TOL, fit_mapper
from .mapper import FORMAT, VERSION, LayerMap, Mapper, MapperError, load_mapper
from .spec import LayerSpec, ModelSpec

__all__ = [
    "ALPHAS",
    "FORMAT",
    "LAGS",
    "RANK_TOL",
    "VERSION",
    "LayerMap",
    "LayerSpec",
    "Mapper",
    "MapperError",
    "ModelSpec",
    "Row",
    "evaluate",
    "fit_mapper",
    "format_table",
    "load_mapper",
    "transfer_cache",
]
