"""``QJLCache``: QJL sign-sketched keys, per-token quantized values, an fp16 window.

Keys go through :class:`~velox_qjl.codec.QJL` (sign sketch, norms, outlier channels per
block of ``group`` tokens); values through ``velox_core.Uniform`` per token (``value_bits``,
``group`` channels per group), the paper's Section 3.2 "standard token-wise quantization".
The newest tokens stay in fp16 (the paper's code keeps a 128-token buffer).

Deviations from the paper (arXiv 2406.03482) and its code (docs/qjl.md lists them all):

- outlier channels are detected per block of ``group`` tokens, as the authors' code does, not
  once per layer from the prompt as the paper's text says; both sketches use rows of one
  seeded projection (the code's choice; exactly independent for Gaussian rows, since the two
  parts live on disjoint channels);
- orthogonalized rows use the exact constant ``1 / (sqrt(d) c_d)`` (the code keeps
  ``sqrt(pi/2)``, 0.2% off at d = 128); the projection is kept, and counted, in float16;
- one sketch size for every layer (the code uses m = 512 in the first 15 layers): use
  ``make_cache(model, layers={...})`` for per-layer settings;
- the code quantizes its key buffer all at once every 128 tokens while values stream out of a
  128-token window; here keys and values leave the window together, ``flush`` tokens (in
  whole outlier blocks) at a time, so between ``window`` and ``window + flush - 1`` of the
  newest tokens are fp16;
- the prompt attends over the stored (sketched) keys beyond the window, where the paper's
  prefill uses the exact keys; trimming inside a block re-sketches that block's surviving
  tokens from their reconstruction (velox-core's block trim).
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, Uniform, config_fields

from .codec import QJL
from .config import QJLConfig

__all__ = ["QJLCache"]


class QJLCache(PresetCache):
    """QJL's cache for one layer. Parameters: see :class:`QJLConfig`."""

    method = "qjl"
    Config = QJLConfig

    def make_codecs(self, cfg: QJLConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        names = ("sketch", "outliers", "outlier_bits", "group", "orthogonal", "seed")
        return QJL(kb, **config_fields(cfg, *names)), Uniform(vb, cfg.group, axis="token")
