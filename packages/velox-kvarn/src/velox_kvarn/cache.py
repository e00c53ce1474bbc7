"""``KVarNCache``: KVarN's tile codes of keys and values, fp16 sinks and the tile being filled.

KVarN (arXiv 2606.03458) rotates keys and values over their channels by a Hadamard
transform, balances each tile of ``group`` tokens by an iterated dual-scaling variance
normalization (a scale per token and one per channel, alternated until both axes have the
same deviation) and rounds it to nearest at ``key_bits`` / ``value_bits`` (keys per channel,
values per token), the scales absorbed and stored in fp16 (:mod:`velox_kvarn.codec`). The
tokens of a tile that is not whole wait in fp16, as the first ``sinks`` tokens do.

The algorithm follows the authors' reference code (their vLLM fork: the normalization's
PyTorch reference, the tile store, the kernels), which the paper names as its
implementation; the paper's method section itself could not be read here. Deviations from
that code (docs/kvarn.md):

- The tail. The authors code a tile the moment its ``group`` tokens exist (0 to ``group - 1``
  fp16 tokens); here ``window`` more fp16 tokens may be kept (0 by default, the authors'
  tail), and the codes take whole tiles ``lcm(flush, group)`` tokens at a time (velox's
  ``flush``; at the defaults 128, one tile).
- Head dims. The authors support 128, 256 and 512 (a Sylvester matrix). Other even head dims
  are rotated by a block-diagonal Hadamard (blocks of the largest power of two dividing the
  head dim); odd head dims are refused.
- Prefill. The authors' first prefill chunk attends its raw fp16 tokens; here a chunk attends
  the stored tokens (its own whole tiles coded), as every velox cache does.
- ``iters`` defaults to 8, the authors' backend setting (their reference functions: 16).
- Scales are bf16 for bf16 models (the authors: fp16). ``seed`` is velox's option of random
  signs on the rotation; by default the rotation is the authors' Sylvester matrix.
- Not carried over: the authors' optional quantile clipping of the rounding range (off by
  default there) and their MLA latent path.
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, config_fields

from .codec import KVarNKeys, KVarNValues
from .config import KVarNConfig

__all__ = ["KVarNCache"]


class KVarNCache(PresetCache):
    """KVarN's cache for one layer. Parameters: see :class:`KVarNConfig`.

    Each KV head's tiles are normalized and rounded on their own, so a model split by heads
    holds exactly its heads' share.
    """

    method = "kvarn"
    Config = KVarNConfig

    def make_codecs(self, cfg: KVarNConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        common = config_fields(cfg, "group", "iters", "seed")
        return KVarNKeys(kb, **common), KVarNValues(vb, **common)
