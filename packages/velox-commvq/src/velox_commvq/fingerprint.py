"""A fingerprint of a model's weights and config, to match codebook artifacts to models.

The same fingerprint as velox-qfilters' (one model has one fingerprint whatever the method):
a SHA-256 over the model's identifying config (:func:`identity`) and, for every parameter
array (sorted by name), its name, shape and 257 evenly spaced entries (float entries rounded
to bfloat16, so casting a checkpoint between float32, float16 and bfloat16 keeps it). Another
checkpoint (another model, a fine-tune, a quantization) changes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

__all__ = ["fingerprint", "identity"]

_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rope_traditional",
    "rope_scaling",
    "partial_rotary_factor",
    "sliding_window",
    "vocab_size",
)
_SAMPLES = 257


def identity(model: Any) -> dict[str, Any]:
    """The config entries that fix a model's attention geometry (those it has)."""
    args = getattr(model, "args", None)
    if dataclasses.is_dataclass(args):
        cfg = dataclasses.asdict(args)
    else:
        cfg = dict(args) if isinstance(args, dict) else dict(getattr(args, "__dict__", {}))
    out = {"class": f"{type(model).__module__}.{type(model).__name__}"}
    for k in _KEYS:
        v = cfg.get(k)
        if v is None:
            continue
        try:
            json.dumps(v)
        except TypeError:
            v = repr(v)
        out[k] = v
    return out


def fingerprint(model: Any) -> str:
    """The model's fingerprint, a 32-digit hex string."""
    h = hashlib.sha256(json.dumps(identity(model), sort_keys=True).encode())
    params = tree_flatten(model.parameters())
    if not params:
        raise ValueError("fingerprint: the model has no parameters")
    samples = []
    for name, a in sorted(params, key=lambda p: p[0]):
        flat = a.reshape(-1)
        n = flat.size
        idx = np.unique(np.linspace(0, max(n - 1, 0), num=min(n, _SAMPLES)).astype(np.int64))
        s = flat[mx.array(idx)] if n else flat
        if mx.issubdtype(a.dtype, mx.floating):
            s = s.astype(mx.bfloat16).astype(mx.float32)
        samples.append((f"{name}|{tuple(a.shape)}|".encode(), s))
    mx.eval([s for _, s in samples])
    for tag, s in samples:
        h.update(tag)
        h.update(np.asarray(s).tobytes())
    return h.hexdigest()[:32]
