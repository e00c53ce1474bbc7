"""``KNormPolicy``: keep the tokens whose keys have the lowest L2 norm (arXiv 2406.11430).

Devoto et al. observe that, in most layers and heads of decoder-only models, the attention a
cached token receives is anti-correlated with the L2 norm of its key: low-norm keys (the
attention sinks among them) draw high attention. So the key alone, before any query, says
which tokens to keep: each KV head keeps its ``budget - protected`` body tokens of lowest
``||k||`` (score ``-||k||``, computed in float32 from the stored keys), and the rest leave
memory. No query and no attention weight is needed, so the policy works with any attention
(routed or not). A key's score never changes (keys are stored post-RoPE at their absolute
positions), so cutting step by step or at once keeps the same tokens.

Deviations from the paper (also in docs/knorm.md):

* **Cadence.** The authors' experiments compress the prompt's cache once after the forward
  pass, with a keep *ratio*; here ``budget`` counts tokens per KV head and the cache is cut
  after each prefill chunk (peak memory: ``budget`` plus one chunk), and, with ``every``,
  again during decode. A key's score does not depend on what else is stored, so a layer
  keeps the tokens one cut over the same keys keeps (ties aside); but a later chunk attends
  to the kept part of the earlier ones, so the layers above a cut compute other keys than
  one pass over the whole prompt gives (``prefill="prompt"`` cuts once, at the prompt's end).
* **Layers.** The authors skip the first layer(s) (``skip_layers=[0, 1]`` in their examples);
  velox cuts every layer it is given: skip layers with
  ``velox_core.make_cache(model, KNormCache(...), layers={0: VeloxCache(), 1: VeloxCache()})``.
* ``sinks``, ``window`` (always kept, unscored) and ``Uniform`` codes of the kept tokens are
  velox settings, not in the paper (defaults: none); with ``bits`` keys are scored from their
  stored codes.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import RetentionPolicy

__all__ = ["KNormPolicy", "key_norm_scores"]


def key_norm_scores(keys: mx.array) -> mx.array:
    """KNorm's score of each token: minus the L2 norm of its key, in float32.

    Shapes:
        keys ``(..., T, D)`` (any float dtype); returns float32 ``(..., T)``.
    """
    k = keys.astype(mx.float32)
    return -mx.sqrt(mx.sum(k * k, axis=-1))


class KNormPolicy(RetentionPolicy):
    """KNorm's retention policy: each KV head keeps its lowest-norm keys.

    Args:
        budget: tokens kept per KV head (sinks + body + window), or None (keep all).
        every: during decode, cut again once the cache holds ``budget + every`` tokens
            (None: only after prefill chunks, as the paper compresses the prompt).
    """

    name = "knorm"

    def score(self, view) -> list[mx.array | None]:
        """Per KV head ``(B, T_h)`` float32: ``-||k||`` of each body key."""
        return [None if k is None else key_norm_scores(k[:, 0]) for k in view.body_keys()]
